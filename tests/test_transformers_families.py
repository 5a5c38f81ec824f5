"""Representative transformers families through ``prepare`` on 4 virtual ranks, against the same weights on one
device with eager attention (a model built anew): training (logits, loss, every gradient) and ``xt.generate``
against the model's own greedy ``generate`` (tokens and every step's logits). Each family stands for a way a
model hands attention something other than a plain layer's own keys and values:

- a sliding window only in the mask (Qwen2-MoE with ``use_sliding_window``; PhiMoE): the mask function
  carries it to attention;
- values transformed after the cache update, attention called twice per update (DiffLlama), keys and
  values repeated after it (JetMoE): the sharded cache keeps what attention is handed;
- another layer's cache slot (HRM: ``layer_idx + offset``), another layer's keys and values (Gemma-3n's
  shared KV layers), cache layers deep-copied while generating (Dory).

benchmarks/architectures.py runs the same over every architecture (not in CI). Float64; transformers' eager
softmax is kept in float64 on both sides (its cast to float32 would bound the agreement near 1e-7).
"""

from __future__ import annotations

import copy

import pytest
import torch

import xcp

transformers = pytest.importorskip("transformers", reason="needs transformers")

from xcp.integrations import transformers as xt  # noqa: E402 - after the skip

P = 4
S = 32
VOCAB = 128
TOL = 1e-9
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, attention_dropout=0.0)  # fmt: skip


def _configs():
    t = transformers
    return {
        "qwen2_moe_window": lambda: t.Qwen2MoeConfig(
            **COMMON, num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=2,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "phimoe": lambda: t.PhimoeConfig(
            **COMMON, num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
            router_jitter_noise=0.0, input_jitter_noise=0.0,
        ),
        "diffllama": lambda: t.DiffLlamaConfig(**COMMON, num_hidden_layers=2),
        "jetmoe": lambda: t.JetMoeConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
            intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        ),
        "hrm_text": lambda: t.HrmTextConfig(**COMMON, num_layers_per_stack=2, num_hidden_layers=16, H_cycles=2,
                                            L_cycles=3),
        "gemma3n_text": lambda: t.Gemma3nTextConfig(
            **{**COMMON, "intermediate_size": [128] * 4}, num_hidden_layers=4, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, activation_sparsity_pattern=[0.0] * 4,
        ),
        "dory": lambda: t.DoryConfig(
            **COMMON, num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 3, sliding_window=8,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def registered():
    return xt.register()


@pytest.fixture
def float64_softmax(monkeypatch):
    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax64)


def build(config, impl):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=impl, dtype=torch.float64, experts_implementation="eager"
    )


def pair(kind):
    config = _configs()[kind]()
    model = xt.prepare(build(config, "xcp"))
    reference = build(config, "eager")
    reference.load_state_dict(model.state_dict())
    return model, reference


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def float64_loss(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kw):  # fmt: skip
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shift_labels.reshape(-1), reduction="sum")
    return loss / (num_items_in_batch or int((shift_labels != ignore_index).sum()))


@pytest.mark.parametrize("kind", ["qwen2_moe_window", "phimoe"])
def test_training_matches_one_device(kind, float64_softmax):
    model, reference = pair(kind)
    for m in (model, reference):
        m.train()
        m.loss_function = float64_loss
    ids = torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(2))
    expected = reference(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()

    def rank(group):
        with xcp.context(group):
            out = model(**xt.shard_batch(ids, labels=ids).model_kwargs())
            out.loss.backward()
            return out.logits.detach(), out.loss.detach()

    results = xcp.LocalWorld(P).run(rank)
    assert rel(xcp.unshard([r[0] for r in results]), expected.logits.detach()) <= TOL
    assert rel(sum(r[1] for r in results), expected.loss.detach()) <= TOL
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in grads.values())
    for name, p in model.named_parameters():
        if name in grads:  # a gradient that is 0 in exact math (a key bias) compares to the largest one
            err = float((p.grad - grads[name]).abs().max())
            assert err <= TOL * max(float(grads[name].abs().max()), 1e-6 * scale), name


@pytest.mark.parametrize("kind", ["qwen2_moe_window", "diffllama", "jetmoe", "hrm_text", "gemma3n_text", "dory"])
def test_generate_matches_the_models_own(kind, float64_softmax):
    model, reference = pair(kind)
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(1))  # 8 through the ring + 5
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        expected = reference.eval().generate(ids, **kw)
    model.eval()
    got = xcp.LocalWorld(P).run(lambda group: xt.generate(model, ids, group=group, **kw))
    for out in got:
        assert torch.equal(out.sequences, expected.sequences)
        for step, want in zip(out.logits, expected.logits, strict=True):
            assert rel(step, want) <= 1e-9


def test_attention_over_keys_the_cache_never_saw_is_refused():
    from xcp.integrations.transformers_generate import ShardedCache

    model, _ = pair("diffllama")
    cache = ShardedCache(model.config, None, "zigzag", capacity=8)
    q = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    k = v = torch.randn(1, 2, 1, 16, dtype=torch.float64)
    module = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"who: the keys and values handed to attention come from no update"):
        cache.attention(module, q, k, v, True, None, None, None, "who")
    cache.update(k, v, 0)
    wider = torch.randn(1, 2, 3, 16, dtype=torch.float64)  # 3 tokens where the update had 1
    with pytest.raises(ValueError, match=r"come from no update of xcp's sharded cache"):
        cache.attention(module, q, wider, wider, True, None, None, None, "who")
    out = cache.attention(module, q, k, v, True, None, None, None, "who")  # what the update returned
    torch.testing.assert_close(out, v.transpose(1, 2).repeat_interleave(2, dim=2))  # one key: its value


def test_cross_attention_layers_are_refused_by_generate():
    config = transformers.MllamaTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "xcp"
    torch.manual_seed(0)
    model = xt.prepare(transformers.MllamaForCausalLM(config)).eval()
    ids = torch.randint(3, VOCAB, (1, 13))
    refused = r"model: cross-attention layers \(MllamaTextCrossAttention, config.cross_attention_layers=\[1\]\) cache"
    with pytest.raises(RuntimeError, match=refused):
        xcp.LocalWorld(2).run(lambda group: xt.generate(model, ids, group=group, max_new_tokens=2))
