"""xt.generate: transformers generate() over a KV cache sharded across ranks, against one device's generate.

Tiny models built from configs (no download), float64, with transformers' float32 steps (RMSNorm, the eager
softmax) patched to float64 in both runs alike, so that per-step logits compare to 1e-9: each step's
float64 logits are taken from the LM head (generate itself hands out float32 logits). Prompt lengths are
odd: shorter than what the balance splits (the whole prompt one chunk), and a ring prefix plus a chunk.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import finish_ranks, float64_transformers, gloo_worker, start_ranks

import xcp

transformers = pytest.importorskip("transformers")
from xcp.integrations import transformers as xt  # noqa: E402 - after the skip

VOCAB = 96
NEW = 6


def _config(kind: str, **over):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=4)
    elif kind == "gemma2":  # logit soft-capping (q/k scaled in make_model so that the cap bends the scores)
        cfg = transformers.Gemma2Config(
            **common, head_dim=8, sliding_window=4, attn_logit_softcapping=0.5, pad_token_id=None
        )  # random prompts hold token 0: no padding mask
    elif kind == "llama4":  # layer 0 chunked (chunks of 4 positions), layer 1 full
        common.update(head_dim=8, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1)
        cfg = transformers.Llama4TextConfig(**common, attention_chunk_size=4, no_rope_layers=[1, 0],
                                            attn_temperature_tuning=False)  # fmt: skip
    else:
        del common["max_position_embeddings"]
        common.update(intermediate_size=32, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4)
        cfg = transformers.GptOssConfig(**common, layer_types=["sliding_attention", "full_attention"])
    for key, value in over.items():
        setattr(cfg, key, value)
    return cfg


def make_model(kind: str, **over):
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if kind in ("gpt_oss", "llama4") else {}
    model = transformers.AutoModelForCausalLM.from_config(
        _config(kind, **over), attn_implementation="eager", dtype=torch.float64, **extra
    )
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_()  # nonzero sinks, so that they matter
            if kind == "gemma2" and hasattr(m, "q_proj"):
                m.q_proj.weight.mul_(10)
                m.k_proj.weight.mul_(10)
    return model.eval()


@pytest.fixture
def faithful(monkeypatch):
    """transformers' float32 softmax (eager attention) and RMSNorm in float64, for both runs alike."""
    return float64_transformers(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def registered():
    return xt.register()


def recording(model):
    """``model`` and the list its LM head appends each forward's last float64 logits to."""
    steps: list[torch.Tensor] = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: steps.append(out[:, -1].detach().clone()))
    return model, steps


def one_device(model, ids, **kw):
    model, steps = recording(copy.deepcopy(model))
    out = model.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True, **kw)
    return out, steps


def on_ranks(model, ids, world=4, balance="zigzag", **kw):
    """xt.generate on ``world`` virtual ranks, a model copy each: (output, float64 logits per step) per rank."""
    copies = [recording(copy.deepcopy(model)) for _ in range(world)]
    for m, _ in copies:
        xt.prepare(m).set_attn_implementation("xcp")

    def rank(group):
        m, steps = copies[group.rank()]
        out = xt.generate(m, ids, group=group, max_new_tokens=NEW, balance=balance, return_dict_in_generate=True,
                          output_logits=True, **kw)  # fmt: skip
        return out, steps

    return xcp.LocalWorld(world).run(rank)


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) == NEW
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("kind", "prompt", "balance", "world"),
    [("llama", 1, "zigzag", 4), ("llama", 9, "zigzag", 1), ("qwen2", 7, "stripe", 4),
     ("mistral", 11, "contiguous", 4), ("gpt_oss", 21, "zigzag", 4), ("gemma2", 11, "contiguous", 4),
     ("llama4", 21, "zigzag", 4), ("llama4", 7, "stripe", 2)],
)  # fmt: skip
def test_greedy_equals_one_device(faithful, kind, prompt, balance, world):
    """Tokens equal, logits of every step to 1e-9, on 4 virtual ranks (and on one): a ring prefix and a chunk
    (7 = 4 + 3 for stripe, 11 = 8 + 3 for contiguous, 21 = 16 + 5 for zigzag; 9 = 8 + 1 on one rank), or a
    prompt of one token (a chunk alone)."""
    model = faithful(make_model(kind))
    if kind == "qwen2":  # a scale other than 1/sqrt(head_dim): the module's scaling must reach the cache
        for m in model.modules():
            if hasattr(m, "scaling"):
                m.scaling = 0.25
    ids = torch.randint(0, VOCAB, (2, prompt), generator=torch.Generator().manual_seed(1))
    ref, ref_steps = one_device(model, ids, do_sample=False)
    results = on_ranks(model, ids, world=world, balance=balance, do_sample=False)
    for out, steps in results:
        assert torch.equal(out.sequences, ref.sequences)
        assert worst(steps, ref_steps) <= 1e-9, kind
        assert len(out.logits) == NEW and all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(out.logits, ref.logits))
    cached = prompt + NEW - 1  # the last token is never run through the model
    for layer in range(2):  # every token on one rank, no rank more than its share
        held = [out.cache.sharded[layer].kv.local_len for out, _ in results]
        assert sum(held) == cached and max(held) <= (prompt + NEW) // world + 1, held
    if kind in ("mistral", "gpt_oss"):  # the window (4) changes the result: the test sees it
        _, wide = one_device(faithful(make_model(kind, sliding_window=64)), ids, do_sample=False)
        assert worst(wide, ref_steps) > 1e-3
    variant = {"gemma2": {"attn_logit_softcapping": None}, "llama4": {"attention_chunk_size": 64}}.get(kind)
    if variant is not None:  # soft-capping, the chunks: the test sees them
        _, without = one_device(faithful(make_model(kind, **variant)), ids, do_sample=False)
        assert worst(without, ref_steps) > 1e-3


def test_sampling_is_the_same_on_every_rank_and_seeded_as_on_one_device(faithful):
    """Rank 0 draws (its default generator) and every rank takes its token: the same sequence on every
    rank, equal to one device's with the same seed, and the scores generate records are the warped ones."""
    model = faithful(make_model("llama"))
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    kw = dict(do_sample=True, top_k=20, temperature=0.7, output_scores=True)
    torch.manual_seed(123)
    ref, _ = one_device(model, ids, **kw)
    torch.manual_seed(123)
    results = on_ranks(model, ids, **kw)
    for out, _ in results:
        assert torch.equal(out.sequences, results[0][0].sequences)
        assert torch.equal(out.sequences, ref.sequences)
        for got, want in zip(out.scores, ref.scores):  # top-k left 20 finite scores per row, as on one device
            assert torch.equal(torch.isfinite(got), torch.isfinite(want))
            torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], rtol=1e-6, atol=1e-6)


def test_a_left_padded_ragged_batch_equals_one_device(faithful):
    """Three prompts of 9, 4 and 6 tokens, left-padded to 9, over 2 virtual ranks: the token ids of the model's
    own generate with that mask, a row that meets eos early padded after it as transformers pads it."""
    model = faithful(make_model("llama"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :3] = 0
    ids[mask == 0] = 0
    first = copy.deepcopy(model).generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    eos = int(first[1, 9 + 1])  # row 1's second new token ends it there
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = copy.deepcopy(model).generate(ids, max_new_tokens=NEW, **kw)
    copies = [xt.prepare(copy.deepcopy(model)) for _ in range(2)]
    for m in copies:
        m.set_attn_implementation("xcp")
    results = xcp.LocalWorld(2).run(
        lambda group: xt.generate(copies[group.rank()], ids, group=group, max_new_tokens=NEW, **kw)
    )
    assert (want[1, 9 + 2 :] == 0).all() and want.shape[1] > 9 + 2  # row 1 ended early, the others went on
    for got in results:
        assert torch.equal(got, want)


def test_a_ragged_batch_and_what_the_sharded_cache_cannot_do_are_named():
    model = make_model("llama")
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(ValueError, match=r"model: expected attention by xcp .*got attn_implementation 'eager'"):
        xt.generate(model, ids)
    xt.prepare(model).set_attn_implementation("xcp")
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0  # padded on the right
    with pytest.raises(ValueError, match=r"attention_mask: expected left padding .*got padding after a token"):
        xt.generate(model, ids, attention_mask=mask)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"attention_mask: expected left padding .*got no token in row 1"):
        xt.generate(model, ids, attention_mask=mask)
    mask[1, 2:] = 1  # left padding: served, greedy token ids only
    with pytest.raises(NotImplementedError, match=r"do_sample: expected False with a left-padded attention_mask"):
        xt.generate(model, ids, attention_mask=mask, do_sample=True)
    with pytest.raises(ValueError, match=r"num_beams: not supported by xcp's generate \(beam search"):
        xt.generate(model, ids, num_beams=2)
    with pytest.raises(ValueError, match=r"ulysses: expected 1 under generate \(the sharded KV cache .*got 2"):
        xt.generate(model, ids, ulysses=2)
    with pytest.raises(ValueError, match="max_new_tokens: expected a positive integer; got 0"):
        xt.generate(model, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"input_ids: expected at least one prompt of at least one token"):
        xt.generate(model, ids[:, :0])
    out = xt.generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)  # no padding: served
    assert out.shape == (2, 7)
    from xcp.integrations.transformers_generate import ShardedCache

    with pytest.raises(NotImplementedError, match="crop: not supported by xcp's sharded KV cache"):
        ShardedCache(model.config, None, "zigzag").crop(-1)  # what generate's assisted decoding would ask


WORKER = gloo_worker(
    """
    import transformers
    from xcp.integrations import transformers as xt

    softmax = torch.nn.functional.softmax
    torch.nn.functional.softmax = lambda x, dim=None, _stacklevel=3, dtype=None: softmax(x, dim=dim)
    transformers.models.llama.modeling_llama.LlamaRMSNorm.forward = lambda self, x: self.weight * (
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    xt.register()
    model = xt.prepare(transformers.AutoModelForCausalLM.from_pretrained(
        f"{workdir}/model", attn_implementation="xcp", dtype=torch.float64).eval())
    steps = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: steps.append(out[:, -1].clone()))
    ids = torch.load(f"{workdir}/ids.pt")
    greedy = xt.generate(model, ids, max_new_tokens=6, do_sample=False)
    torch.manual_seed(rank)  # each process seeded differently: rank 0's draws decide
    sampled = xt.generate(model, ids, max_new_tokens=6, do_sample=True, top_k=20)
    torch.save({"greedy": greedy, "steps": steps[:6], "sampled": sampled}, f"{workdir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs gloo")  # fmt: skip
def test_two_gloo_processes_equal_one_device(tmp_path, faithful):
    model = faithful(make_model("llama"))
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))  # 9 = 8 (zigzag, P 2) + 1
    torch.save(ids, tmp_path / "ids.pt")
    finish_ranks(start_ranks(WORKER, 2, tmp_path))
    ref, ref_steps = one_device(model, ids, do_sample=False)
    results = [torch.load(Path(tmp_path) / f"rank{r}.pt") for r in range(2)]
    for res in results:
        assert torch.equal(res["greedy"], ref.sequences)
        assert worst(res["steps"], ref_steps) <= 1e-9
        assert torch.equal(res["sampled"], results[0]["sampled"])
