"""Every causal-LM architecture of the installed transformers, tiny, through xcp: pass, refused (why) or FAIL.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that builds tiny from its default config
(float64, random weights, no download):

- **training**: the recipe of docs/integrations.md (``register()``, ``attn_implementation="xcp"``,
  ``prepare``, ``shard_batch``, ``model_kwargs()``) on 4 virtual ranks (zigzag; ``--world``, ``--balance``)
  against a model built anew
  with eager attention and the same weights on one device: logits, loss and every parameter gradient,
  each relative to its largest entry, within ``--tol``;
- **generate**: ``xt.generate`` on the same ranks against the reference's own greedy ``generate``: the
  same tokens, and every step's logits within ``--tol``.

With ``--documents``, instead: packed documents (``shard_batch(..., cu_seqlens=)``) through the ranks' forward,
whose logits are compared with each document run alone on one device and with the packed sequence on one
device (restarting positions); the family passes where one of them is within ``--tol``, and says which
(docs/hybrid.md, "Packed documents").

A refusal (``prepare``, the build, or a ValueError of xcp at run time) is printed with its reason; anything
else that differs or raises is a FAIL. Not part of CI (minutes on 2 cores): run it in batches::

    python benchmarks/architectures.py --only llama,qwen2,bloom
    python benchmarks/architectures.py --start 0 --stop 50
"""

from __future__ import annotations

import argparse
import copy
import math
import resource
import sys
import time
import traceback
import types
import warnings
from typing import Any

import torch

import xcp

S = 8  # training tokens per rank
PROMPT, NEW = 13, 4

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,
    "rotary_dim": 8,
    "state_size": 8,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
    "d_state": 8,
    "mamba_d_state": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "d_model": 64,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "d_ff": 128,
}
"""Small values for the config attributes a model has (only those it has are set)."""

FEATURES = frozenset({"sliding_window", "q_lora_rank", "hidden_size_per_layer_input", "vocab_size_per_layer_input"})
"""Attributes whose None or 0 turns a feature off: made small only where the model has the feature."""


def _hrm(kw: dict[str, Any]) -> None:  # one cache slot per layer of a stack and per cycle (2 x (3 + 1))
    kw.update(num_layers_per_stack=2, num_hidden_layers=2 * 4 * 2, H_cycles=2, L_cycles=3)


def _dory(kw: dict[str, Any]) -> None:  # input, recurrent and output sections of two layers each
    kw.update(n_input_layers=2, n_recurrent_layers=2, n_output_layers=2, num_hidden_layers=6)
    kw["layer_types"] = ["sliding_attention", "full_attention"] * 3


def _gemma3n(kw: dict[str, Any]) -> None:  # two layers of each kind, the last two reading the first two's KV
    kw.update(num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=128)
    kw.update(hidden_size_per_layer_input=16, intermediate_size=[128] * 4, activation_sparsity_pattern=[0.0] * 4)
    kw["layer_types"] = ["sliding_attention", "full_attention"] * 2


def _mla(kw: dict[str, Any]) -> None:  # every query head has its own latent key and value head
    kw["num_key_value_heads"] = kw["num_attention_heads"]


def _qwen4_exp(kw: dict[str, Any]) -> None:  # its indexer's sizes (None by default)
    kw.update(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)


def _lfm2(kw: dict[str, Any]) -> None:  # its default is all attention: one short-convolution layer too
    kw.update(layer_types=["conv", "full_attention"], full_attn_idxs=[1], num_hidden_layers=2)


def _zamba(kw: dict[str, Any]) -> None:  # its hybrid layers share one block: two of them, and a Mamba layer
    kw.update(layers_block_type=["mamba", "hybrid", "hybrid"], num_hidden_layers=3)
    kw.pop("layer_types", None)


def _bamba(kw: dict[str, Any]) -> None:  # its default is Mamba layers alone (transformers' own generate fails)
    kw.update(attn_layer_indices=[1], num_hidden_layers=2)


def _jamba(kw: dict[str, Any]) -> None:  # a Mamba layer, then an attention layer (its default: one in 8)
    kw.update(attn_layer_period=2, attn_layer_offset=1, num_hidden_layers=2)


def _mamba2(kw: dict[str, Any]) -> None:  # heads x head_dim = 2 x hidden_size
    kw.update(num_heads=8, chunk_size=8)


def _falcon_h1(kw: dict[str, Any]) -> None:  # the Mamba heads fill the intermediate size
    kw.update(mamba_d_ssm=128, mamba_chunk_size=8)


def _zamba2(kw: dict[str, Any]) -> None:  # a Mamba layer, then a hybrid one (Mamba beside the shared attention)
    kw.update(layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], num_hidden_layers=2)
    kw.update(n_mamba_heads=8, mamba_headdim=16, chunk_size=8, attention_head_dim=16)
    kw.pop("layer_types", None)


def _lfm2_moe(kw: dict[str, Any]) -> None:  # a short-convolution layer, then attention (the first one dense)
    kw.update(layer_types=["conv", "full_attention"], num_hidden_layers=2, num_dense_layers=1)


def _kimi_linear(kw: dict[str, Any]) -> None:  # its default 32 KDA heads of 128 outgrow a small machine
    kw.update(linear_num_heads=4, linear_head_dim=16)


def _granitemoehybrid(kw: dict[str, Any]) -> None:  # its default's first layers are Mamba layers alone
    kw.update(layer_types=["mamba", "attention"], num_hidden_layers=2)


def _zaya(kw: dict[str, Any]) -> None:  # ZAYA routes each token to one expert only
    kw.update(num_experts_per_tok=1)


def _recurrent_gemma(kw: dict[str, Any]) -> None:  # a recurrent block, then attention (its own generate needs one)
    kw.update(block_types=["recurrent", "attention"], num_hidden_layers=2)


def _xlstm(kw: dict[str, Any]) -> None:
    """xLSTMCache sizes its states by the q/k and v dims rounded up to 64, the layers by the unrounded: equal
    here (else its own generate fails); its kernels in float32 (float64 under --full-precision), not bfloat16."""
    kw.update(qk_dim_factor=1.0, v_dim_factor=1.0, autocast_kernel_dtype="float32")


def _reformer(kw: dict[str, Any]) -> None:  # a causal LM only as a decoder
    kw.update(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[4, 8])


def _gpt_neo(kw: dict[str, Any]) -> None:  # one global and one local layer
    kw.update(attention_types=[[["global", "local"], 1]], num_layers=2)


FIXUPS = {
    "reformer": _reformer,
    "gpt_neo": _gpt_neo,
    "lfm2": _lfm2,
    "zamba": _zamba,
    "zaya": _zaya,
    "xlstm": _xlstm,
    "recurrent_gemma": _recurrent_gemma,
    "bamba": _bamba,
    "mamba2": _mamba2,
    "falcon_h1": _falcon_h1,
    "zamba2": _zamba2,
    "lfm2_moe": _lfm2_moe,
    "kimi_linear": _kimi_linear,
    "granitemoehybrid": _granitemoehybrid,
    "jamba": _jamba,
    "hrm_text": _hrm,
    "dory": _dory,
    "gemma3n_text": _gemma3n,
    "qwen4_exp": _qwen4_exp,
    "qwen4_exp_text": _qwen4_exp,
}
"""Models whose layers must agree with attributes of their own: changes to :func:`_small`'s arguments."""


def _small(cfg: Any, model_type: str) -> dict[str, Any]:
    """The keyword arguments that make a config of ``cfg``'s class tiny (those of its attributes it has)."""
    present = cfg.to_dict()
    names = getattr(cfg, "attribute_map", {})
    kw: dict[str, Any] = {}
    for key, value in SMALL.items():
        target = names.get(key, key)  # the config's own name (BART: d_model for hidden_size)
        if target in present and (target not in FEATURES or present[target] not in (None, 0)):
            kw[target] = value
    if "qk_rope_head_dim" in kw:
        _mla(kw)
        if "head_dim" in kw:  # MLA: the rotary dim is head_dim
            kw["head_dim"] = kw["qk_rope_head_dim"]
    for key, value in present.items():
        if any(w in key for w in ("drop", "jitter")) and isinstance(value, float):
            kw[key] = 0.0
        if key.endswith("_token_id") and isinstance(value, int) and value >= SMALL["vocab_size"]:
            kw[key] = 2  # a special token inside the small vocabulary
    kinds = present.get("layer_types")
    if isinstance(kinds, list) and kinds:
        chosen = list(dict.fromkeys(kinds))  # one layer of each kind, in order
        kw["layer_types"] = chosen * 2 if len(chosen) == 1 else chosen
        kw[names.get("num_hidden_layers", "num_hidden_layers")] = len(kw["layer_types"])
    if model_type in FIXUPS:
        FIXUPS[model_type](kw)
    return kw


def tiny_config(model_type: str) -> Any:
    """The default config of ``model_type`` made anew with :func:`_small`'s arguments (derived attributes
    follow them); a composite config (text and vision) gets them set on its text part."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not getattr(config, "sub_configs", None):
        kw = _small(config, model_type)
        try:
            return type(config)(**kw)
        except Exception:  # noqa: BLE001 - a layout the arguments do not fit: keep the model's own
            kw.pop("layer_types", None)
            return type(config)(**kw)
    for key, value in _small(text, model_type).items():
        try:
            setattr(text, key, value)
        except Exception:  # noqa: BLE001 - a read-only or validated attribute keeps its default
            pass
    return config


def build(config: Any, impl: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"}
    try:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl, dtype=torch.float64,
                                                 **extra)  # fmt: skip
    except TypeError:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl, dtype=torch.float64)
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / max(scale, 1e-300) if b.numel() else 0.0


def float64_loss(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                 **kw):  # fmt: skip
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).double(), shift_labels.reshape(-1), ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean",
    )  # fmt: skip
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def train_check(model: Any, reference: Any, ids: torch.Tensor) -> str | None:
    """None when training over ``--world`` ranks equals one device; else what differs."""
    from xcp.integrations import transformers as xt

    for m in (model, reference):
        m.train()
        m.zero_grad()
        m.loss_function = float64_loss
    out = reference(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()

    def rank(group):
        with xcp.context(group, balance=ARGS.balance, ulysses=ARGS.ulysses):
            batch = xt.shard_batch(ids, labels=ids)
            got = model(**batch.model_kwargs())
            got.loss.backward()
            return got.logits.detach(), got.loss.detach()

    results = xcp.LocalWorld(ARGS.world).run(rank)
    logits = xcp.unshard([r[0] for r in results], balance=ARGS.balance, ulysses=ARGS.ulysses)
    errors = {"logits": rel(logits, out.logits.detach()), "loss": rel(sum(r[1] for r in results), out.loss.detach())}
    ref_params = dict(reference.named_parameters())
    grads = [r.grad for r in ref_params.values() if r.grad is not None]
    floor = 1e-6 * max(float(g.abs().max()) for g in grads if g.numel())  # a gradient that is 0 in exact math
    worst = (0.0, "")
    for name, p in model.named_parameters():
        r = ref_params.get(name)
        if r is None or r.grad is None or p.grad is None:
            if (r is not None and r.grad is not None) != (p.grad is not None):
                return f"gradient of {name}: present on one side only"
            continue
        scale = max(float(r.grad.abs().max()) if r.grad.numel() else 0.0, floor)
        worst = max(worst, (float((p.grad - r.grad).abs().max()) / scale if r.grad.numel() else 0.0, name))
    errors[f"grad {worst[1]}"] = worst[0]
    bad = {k: v for k, v in errors.items() if not v <= ARGS.tol}
    return None if not bad else "train " + ", ".join(f"{k} {v:.2g}" for k, v in bad.items())


def documents_check(model: Any, reference: Any, vocab: int) -> tuple[str | None, str]:
    """(None, which reference the ranks' logits of a packed sequence equal) or (what differs, the errors)."""
    from xcp.integrations import transformers as xt

    seq = S * ARGS.world
    cu = [0, 5, seq - 6, seq]  # a short document, a long one, and one every balance's pieces cut
    ids = torch.randint(3, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
    with torch.no_grad():
        alone = torch.cat([reference(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(cu, cu[1:])], 1)
        packed = reference(input_ids=ids, position_ids=positions, use_cache=False).logits

    def rank(group):
        with xcp.context(group, balance=ARGS.balance, ulysses=ARGS.ulysses), torch.no_grad():
            return model(**xt.shard_batch(ids, cu_seqlens=cu).model_kwargs()).logits

    got = xcp.unshard(xcp.LocalWorld(ARGS.world).run(rank), balance=ARGS.balance, ulysses=ARGS.ulysses)
    errors = {"each document alone": rel(got, alone), "packed on one device": rel(got, packed)}
    detail = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
    matched = [k for k, v in errors.items() if v <= ARGS.tol]
    return (None, f"equals {matched[0]} ({detail})") if matched else (f"documents: {detail}", detail)


def generate_check(model: Any, reference: Any, vocab: int) -> str | None:
    from xcp.integrations import transformers as xt

    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (1, PROMPT))
    model.eval()
    reference.eval()
    kw = {"max_new_tokens": NEW, "do_sample": False, "min_new_tokens": NEW}
    kw.update(return_dict_in_generate=True, output_logits=True)
    try:
        with torch.no_grad():
            expected = reference.generate(ids, **kw)
    except Exception as exc:  # noqa: BLE001 - nothing to compare with
        return f"not compared: the model's own generate fails ({type(exc).__name__}: {str(exc)[:120]})"
    got = xcp.LocalWorld(ARGS.world).run(lambda group: xt.generate(model, ids, group=group, balance=ARGS.balance, **kw))
    for out in got:
        tokens, want = out.sequences[0, PROMPT:].tolist(), expected.sequences[0, PROMPT:].tolist()
        if tokens != want:
            return f"generate tokens differ: {tokens} vs {want}"
        worst = max(rel(a, b) for a, b in zip(out.logits, expected.logits, strict=True))
        if not worst <= ARGS.tol:
            return f"generate logits differ: {worst:.2g}"
    return None


def root(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def refused(exc: BaseException) -> str | None:
    """The reason, when ``exc`` is one of xcp's refusals (a ValueError or NotImplementedError naming xcp)."""
    exc = root(exc)
    text = str(exc)
    if isinstance(exc, (ValueError, NotImplementedError)) and ("xcp" in text or "prepare" in text):
        return f"{type(exc).__name__}: {text}"
    return None


class _Float64Torch(types.ModuleType):
    """``torch`` as a modeling module sees it under ``--full-precision``: ``float32`` means float64."""

    float32 = torch.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def keep_float64(module_name: str) -> None:
    """Make the float32 casts of the modeling module ``module_name`` keep float64 (its kernels' ``.to(
    torch.float32)``; ``Tensor.float`` is patched once in :func:`main`)."""
    sys.modules[module_name].torch = _Float64Torch("torch")  # type: ignore[attr-defined]


def survey(model_type: str) -> tuple[str, str]:
    """("pass" | "refused" | "FAIL" | "unbuildable", detail)."""
    from xcp.integrations import transformers as xt

    try:
        config = tiny_config(model_type)
        reference = build(config, "eager")
        vocab = int(config.get_text_config(decoder=True).vocab_size)
        with torch.no_grad():  # the tiny config works on one device
            reference(input_ids=torch.randint(3, vocab, (1, S * ARGS.world)), use_cache=False)
    except Exception as exc:  # noqa: BLE001 - not buildable tiny: outside the survey
        return "unbuildable", f"{type(exc).__name__}: {str(exc)[:160]}"
    if ARGS.full_precision:  # the reference built again: a model binds some dtypes when built (xLSTM's kernels)
        keep_float64(type(reference).__module__)
        reference = build(config, "eager")
    stage = "build"
    try:
        model = build(config, "xcp")
        stage = "prepare"
        xt.prepare(model)
        reference.load_state_dict(model.state_dict())
        torch.manual_seed(2)
        ids = torch.randint(3, vocab, (1, S * ARGS.world))  # split by every balance over --world ranks
        if ARGS.documents:
            stage = "documents"
            problem, detail = documents_check(model, reference, vocab)
            return ("FAIL", problem) if problem is not None else ("pass", detail)
        stage = "train"
        problem = train_check(model, reference, ids)
        if problem is not None:
            return "FAIL", problem
        stage = "generate"
        if ARGS.ulysses != 1:  # xcp's generate runs the ring alone
            return "pass-train", "generate not compared (--ulysses)"
        problem = generate_check(model, reference, vocab)
        if problem is not None and problem.startswith("not compared"):
            return "pass-train", f"generate {problem}"
        if problem is not None:
            return "FAIL", problem
    except Exception as exc:  # noqa: BLE001 - classified and printed
        why = refused(exc)
        if why is not None:
            return "refused", f"{stage}: {why}"
        if ARGS.verbose:
            traceback.print_exception(exc)
        cause = root(exc)
        if isinstance(cause, MemoryError) or "can't allocate memory" in str(cause):
            return "unbuildable", f"{stage}: out of memory (--memory GiB): {str(cause)[:120]}"
        return "FAIL", f"{stage}: {type(cause).__name__}: {str(cause)[:300]}"
    return "pass", ""


def main() -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from xcp.integrations import transformers as xt

    warnings.filterwarnings("ignore")
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = ARGS.memory << 30 if hard == resource.RLIM_INFINITY else min(ARGS.memory << 30, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))  # a shared machine
    import transformers

    transformers.logging.set_verbosity_error()
    xt.register()
    softmax = torch.nn.functional.softmax  # eager attention's float32 softmax, kept in float64 for both sides
    torch.nn.functional.softmax = lambda x, dim=None, _stacklevel=3, dtype=None: softmax(
        x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype
    )
    if ARGS.full_precision:
        to_float = torch.Tensor.float
        torch.Tensor.float = lambda x, *a, **k: x if x.dtype == torch.float64 else to_float(x, *a, **k)  # type: ignore[method-assign]
    names = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if ARGS.only:
        names = [t for t in ARGS.only.split(",") if t]
    else:
        names = names[ARGS.start : ARGS.stop]
    counts: dict[str, int] = {}
    for model_type in names:
        began = time.perf_counter()
        verdict, detail = survey(model_type)
        counts[verdict] = counts.get(verdict, 0) + 1
        took = time.perf_counter() - began
        print(f"{verdict:11s} {model_type:28s} {took:5.1f}s {detail[: ARGS.width]}", flush=True)
    print("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--stop", type=int, default=math.inf)  # type: ignore[arg-type]
    parser.add_argument("--world", type=int, default=4, help="virtual ranks")
    parser.add_argument("--balance", default="zigzag", help="the context's balance (training and generate)")
    parser.add_argument("--ulysses", type=int, default=1, help="the context's ulysses (training and --documents)")
    parser.add_argument("--tol", type=float, default=1e-6, help="relative to the largest entry (float64)")
    parser.add_argument(
        "--full-precision", action="store_true",
        help="make the float32 casts of the models' own kernels keep float64 (recurrent families compute their scans "
        "in float32 whatever the model's dtype; without this their gradients differ by float32 rounding)",
    )  # fmt: skip
    parser.add_argument(
        "--documents", action="store_true",
        help="packed documents through the ranks' forward instead, against each document alone and the packed sequence",
    )  # fmt: skip
    parser.add_argument("--width", type=int, default=400, help="characters of each detail printed")
    parser.add_argument("--memory", type=int, default=8, help="GiB of address space at most (a MemoryError beyond)")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failures")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = _args()
    sys.exit(main())
