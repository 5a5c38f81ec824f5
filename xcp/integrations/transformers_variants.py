"""The attention variants a transformers layer asks of xcp: logit soft-capping and attention chunks.

Kept apart from the attention function (:mod:`xcp.integrations.transformers`), which asks :func:`variants`
for the keyword arguments of :func:`xcp.attention` (and of a sharded KV cache's attention) that a layer's
call needs:

- ``softcap``: the attention interface's ``softcap=`` keyword, which Gemma-2, VaultGemma and T5Gemma pass
  (``config.attn_logit_softcapping``): scores ``softcap * tanh(s / softcap)``, as their eager attention caps
  them after the scaling and before the mask;
- ``chunk``: Llama-4's chunked layers. The attention call carries nothing of it; transformers builds their
  mask from ``config.attention_chunk_size`` for the layers whose ``config.layer_types`` entry is
  ``chunked_attention`` (every layer where the config has no ``layer_types``), chunks aligned at the first
  position of the (packed) sequence, which are xcp's chunks on the global positions. The mask function sees
  the chunked overlay (:func:`check_chunk_part` accepts it where it is that chunk and no padding).

ALiBi reaches no transformers 5.24 model through the attention interface (BLOOM, MPT and Falcon compute it
inside their own attention classes, which :func:`xcp.integrations.transformers.prepare` refuses): call
:func:`xcp.attention` with ``alibi_slopes=`` directly. Nothing here imports transformers.

Llama-4's attention temperature tuning (``attn_temperature_tuning`` on its layers without RoPE) scales each
query by a function of its position, which it takes from ``torch.arange`` over the tokens the layer holds:
on a shard, not the global positions. :func:`prepare` refuses such a layer (:func:`_local_positions`).
"""

from __future__ import annotations

from typing import Any

import torch

from .transformers_prepare import refuse_layer

CHUNK_PART = "chunked_overlay.<locals>.inner_mask"
"""The piece of transformers' chunked mask function (``chunked_causal_mask_function``) that xcp serves."""


def layer_chunk(module: Any) -> int | None:
    """The attention chunk of ``module``'s layer (``config.attention_chunk_size`` where the layer is chunked),
    or None."""
    config = getattr(module, "config", None)
    size = getattr(config, "attention_chunk_size", None)
    if size is None:
        return None
    types = getattr(config, "layer_types", None)
    if types is None:  # transformers' masks chunk every layer then
        return int(size)
    layer = getattr(module, "layer_idx", None)
    if layer is None or not 0 <= layer < len(types):
        raise ValueError(
            f"xcp attention ({type(module).__name__}): config.attention_chunk_size={size} with layer_types, but "
            f"the module's layer_idx ({layer!r}) does not name one of its {len(types)} layers, so xcp cannot tell "
            "whether the layer is chunked"
        )
    return int(size) if types[layer] == "chunked_attention" else None


def variants(module: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :func:`xcp.attention` for this layer's variants: ``softcap`` (the call's
    ``softcap=``) and ``chunk`` (:func:`layer_chunk`), each only where the layer has it."""
    out: dict[str, Any] = {}
    softcap = kwargs.get("softcap")
    if softcap is not None:
        out["softcap"] = softcap
    chunk = layer_chunk(module)
    if chunk is not None:
        out["chunk"] = chunk
    return out


def check_chunk_part(part: Any, config: Any, who: str) -> None:
    """Accept the chunked overlay ``part`` of a mask function where the attention function serves it: its
    chunk is ``config.attention_chunk_size`` (which the attention reads) and it shifts no row by left
    padding; else raise a ValueError saying which."""
    cells = dict(zip(part.__code__.co_freevars, (c.cell_contents for c in part.__closure__ or ())))
    size, padding = cells.get("chunk_size"), cells.get("left_padding")
    want = getattr(config, "attention_chunk_size", None)
    if size is None or size != want:
        raise ValueError(
            f"{who}: a chunked mask of chunk_size={size!r}; xcp serves attention chunks from "
            f"config.attention_chunk_size (got {want!r}), which its attention function reads"
        )
    if isinstance(padding, torch.Tensor) and bool(padding.ne(0).any()):
        raise ValueError(
            f"{who}: a chunked mask shifted by left padding ({padding.tolist()}); padding inside a "
            "context-parallel sequence is not supported: pack the documents into one sequence instead"
        )


def _local_positions(module: torch.nn.Module) -> bool:
    """A Llama-4 attention layer that scales its queries by positions counted over its own tokens."""
    return (
        type(module).__name__ == "Llama4TextAttention"
        and bool(getattr(module, "attn_temperature_tuning", False))
        and not getattr(module, "use_rope", True)
    )


refuse_layer(
    _local_positions,
    "attention temperature tuning (config.attn_temperature_tuning on a layer without RoPE) scales each query by "
    "its position, which the layer counts with torch.arange over the tokens it holds: on a rank's shard those "
    "are not the global positions, so every rank but the first would scale its queries wrongly",
    name="llama4 temperature tuning",
)
