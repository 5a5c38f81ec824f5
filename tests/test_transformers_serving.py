"""xcp.integrations.transformers.generate_batch: transformers' continuous batching with every layer's keys and
values in an xcp.PagedKVCache over virtual ranks, against the model's own generate_batch on one device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import finish_ranks, gloo_worker, start_ranks

import xcp

transformers = pytest.importorskip("transformers")
from xcp.integrations import transformers as xt  # noqa: E402 - after the skip


def _model(kind: str = "llama"):
    """A tiny float64 model: Llama; Mistral (every layer a sliding window of 4); GPT-OSS (a sliding layer, a full
    one, nonzero sinks; eager attention, which continuous batching runs as paged|eager)."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    extra, impl = {}, "sdpa"
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, max_position_embeddings=128)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=4, max_position_embeddings=128)
    else:
        common.update(intermediate_size=32, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4)
        cfg = transformers.GptOssConfig(**common, layer_types=["sliding_attention", "full_attention"])
        extra, impl = {"experts_implementation": "eager"}, "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float64, **extra)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_()  # nonzero sinks, so that they matter
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    gen = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    return inputs, gen, transformers.ContinuousBatchingConfig(num_blocks=32, block_size=8, max_batch_tokens=24)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt_oss"])
def test_generate_batch_equals_the_models_own_over_two_ranks(monkeypatch, kind):
    """Four prompts of 5 to 30 tokens, at most 24 tokens a step: the long prompts prefill in chunks beside the
    others' decode steps; greedy tokens equal the model's own generate_batch on every rank, and every step's
    attention went through the paged caches (chunks and decode steps both); sliding windows and sinks too."""
    from xcp.inference.paged import PagedKVCache

    model = _model(kind)
    inputs, gen, cb = _inputs()
    want = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb)
    impl = model.config._attn_implementation

    seen: list[int] = []
    original = PagedKVCache.attention
    monkeypatch.setattr(
        PagedKVCache, "attention", lambda self, q, *a, **kw: seen.append(q.shape[0]) or original(self, q, *a, **kw)
    )
    with xcp.LocalWorld(2) as world:
        results = world.run(lambda group: xt.generate_batch(model, inputs, group, gen, continuous_batching_config=cb))
    for got in results:
        assert list(got) == list(want)
        assert {k: v.generated_tokens for k, v in got.items()} == {k: v.generated_tokens for k, v in want.items()}
    assert max(seen) > 4 and min(seen) < 4  # chunks of prompts and steps of decode tokens
    assert model.config._attn_implementation == impl  # put back after the last rank
    mapping = transformers.AttentionInterface._global_mapping
    assert not [name for name, fn in mapping.items() if hasattr(fn, "xcp_original")]  # transformers' own functions


def test_generate_batch_refuses_sampling():
    model = type("M", (), {"generation_config": transformers.GenerationConfig(do_sample=True)})()
    with pytest.raises(NotImplementedError, match="generation_config.do_sample: expected False"):
        xt.generate_batch(model, [[1, 2]])


WORKER = gloo_worker(
    """
    import json
    import test_transformers_serving as t
    import xcp
    from xcp.integrations import transformers as xt

    inputs, gen, cb = t._inputs()
    got = xt.generate_batch(t._model(), inputs, None, gen, continuous_batching_config=cb)
    json.dump({k: v.generated_tokens for k, v in got.items()}, open(f"{workdir}/rank{rank}.json", "w"))
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_generate_batch_over_gloo_processes(tmp_path: Path):
    """The same over two processes of the default group (gloo): each rank's tokens are the model's own."""
    model = _model()
    inputs, gen, cb = _inputs()
    want = {k: v.generated_tokens for k, v in model.generate_batch(inputs, generation_config=gen,
                                                                  continuous_batching_config=cb).items()}  # fmt: skip
    tests = str(Path(__file__).resolve().parent)
    finish_ranks(start_ranks(WORKER, 2, tmp_path, PYTHONPATH=tests))
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == want
