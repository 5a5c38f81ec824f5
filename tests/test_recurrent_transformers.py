"""transformers' recurrent families under ``prepare(model)`` over LocalWorld(P), float64, against the same model
on one device: logits, loss and every parameter gradient.

The families' torch kernels compute in float32 whatever the model's dtype (``.to(torch.float32)``,
``.float()``); the test makes those casts keep float64 in both models (:func:`full_precision`), so the only
difference left is the state passing's, and the tolerance is float64's (1e-9 relative to the largest of each).
Families: Qwen3-Next (gated delta), Mamba2, Mamba and Jamba (selective scan), Kimi Linear (KDA), Falcon-H1
and Zamba2 (Mamba2 mixers beside attention), Zamba (a selective scan per Mamba head), LFM2-MoE and LFM3 (short
convolutions), MiniMax (lightning attention), RecurrentGemma (RG-LRU), RWKV (WKV, token shift), Zaya (CCA's
convolution and delayed values) and xLSTM (mLSTM), inline in their mixers (xcp/integrations/transformers_inline.py).
Generation (xt.generate) against the model's own: Qwen3-Next, Mamba2, Mamba, LFM2-MoE, Zaya, RecurrentGemma, MiniMax,
RWKV and xLSTM.
Packed documents (against each document alone, or the packed one-device model where the family never hands its
layers the boundaries), a hybrid all-to-all + ring context (P 4, ulysses 2) and two gloo processes.
"""

from __future__ import annotations

import copy
import importlib
import types
from pathlib import Path

import pytest
import torch

import xcp

transformers = pytest.importorskip("transformers", reason="needs transformers")

from xcp.integrations import transformers as xt  # noqa: E402 - after the skip

VOCAB, TOL = 96, 1e-9
t = transformers


def _configs():
    return {
        "qwen3_next": lambda: t.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"],
        ),
        "kimi_linear": lambda: t.KimiLinearConfig(
            vocab_size=VOCAB, pad_token_id=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, head_dim=8, linear_head_dim=8, linear_num_heads=4,
            moe_intermediate_size=16, num_experts=4, num_experts_per_token=2, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        ),
        "falcon_h1": lambda: t.FalconH1Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8,
            mamba_n_groups=1, mamba_chunk_size=8,
        ),
        "zamba2": lambda: t.Zamba2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, attention_head_dim=16, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8,
            mamba_ngroups=1, chunk_size=8, layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1],
        ),
        "zamba": lambda: t.ZambaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
            layers_block_type=["mamba", "hybrid", "hybrid"],  # two hybrid layers: they share one block
        ),
        "lfm2_moe": lambda: t.Lfm2MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
            layer_types=["conv", "full_attention"],
        ),
        "lfm3": lambda: t.Lfm3Config(
            vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
            layer_types=["conv", "full_attention"],
        ),
        "minimax": lambda: t.MiniMaxConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=3,
            layer_types=["linear_attention", "full_attention"],
        ),  # blocks of 3: every piece has a partial block
        "recurrent_gemma": lambda: t.RecurrentGemmaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, lru_width=32, attention_window_size=8, conv1d_width=4,
            block_types=["recurrent", "attention"],
        ),
        "rwkv": lambda: t.RwkvConfig(
            vocab_size=VOCAB, context_length=64, hidden_size=32, attention_hidden_size=32, intermediate_size=64,
            num_hidden_layers=2,
        ),
        "zaya": lambda: t.ZayaConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=1, router_hidden_size=16,
            attention_bias=True, cca_time0=3, cca_time1=2, sliding_window=8, layer_types=["hybrid", "hybrid_sliding"],
        ),  # biases (PERTURBED): the delayed value before the sequence is v_proj_delayed(0); a halo of 3 = 2 + 1
        "xlstm": lambda: t.xLSTMConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, chunk_size=4, ffn_proj_factor=2.0,
            ffn_round_up_to_multiple_of=16, autocast_kernel_dtype="float32", inference_state_dtype="float32",
            qk_dim_factor=2.0, v_dim_factor=2.0,
        ),  # float32: float64 under full_precision; chunks of 4 within zigzag's pieces (a remainder: step by step);
        # q/k and v dims of 64 (xLSTMCache sizes its states by the dims rounded up to 64, the layers do not round)
        "mamba": lambda: t.MambaConfig(
            vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4
        ),
        "jamba": lambda: t.JambaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2, use_mamba_kernels=False,
        ),
        "mamba2": lambda: t.Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, state_size=8, num_heads=8, head_dim=8, n_groups=2, expand=2,
            num_hidden_layers=2, chunk_size=8,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def registered():
    return xt.register()


class _Float64Torch(types.ModuleType):
    """``torch`` as a modeling module sees it, with ``float32`` meaning float64."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def keep_float64(monkeypatch, kind):
    """Make the float32 casts of family ``kind``'s kernels keep float64 (in both the model and its reference)."""
    to_float = torch.Tensor.float
    keep64 = lambda x, *a, **k: x if x.dtype == torch.float64 else to_float(x, *a, **k)  # noqa: E731
    monkeypatch.setattr(torch.Tensor, "float", keep64)
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    monkeypatch.setattr(module, "torch", _Float64Torch("torch"))
    for cls in [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]:
        for method in vars(cls).values():  # float32 as a default argument (RG-LRU's acc_dtype)
            defaults = getattr(method, "__defaults__", None) or ()
            if any(d is torch.float32 for d in defaults):
                kept = tuple(torch.float64 if d is torch.float32 else d for d in defaults)
                monkeypatch.setattr(method, "__defaults__", kept)


@pytest.fixture
def full_precision(monkeypatch):
    """``patch(kind)``: :func:`keep_float64` for the test."""
    return lambda kind: keep_float64(monkeypatch, kind)


PERTURBED = {"zaya"}
"""Families whose zero-initialised parameters are made random: ZAYA's qk_norm temperature 0 makes attention
uniform whatever its queries and keys (its convolution's halo would go unchecked), its biases 0 hide the
delayed value before the sequence (v_proj_delayed(0))."""


def build(config, impl="xcp"):
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=impl, dtype=torch.float64, experts_implementation="eager"
    )
    if config.model_type in PERTURBED:
        with torch.no_grad():
            for p in model.parameters():
                if not p.any():
                    p.normal_(0, 0.5)
    return model


def twins(full_precision, kind, prepared=True, evaluating=False):
    """The model of ``kind`` in float64 (through ``xt.prepare`` where ``prepared``) and transformers' eager
    reference holding its weights, both in eval mode where ``evaluating``."""
    full_precision(kind)
    config = _configs()[kind]()
    model, reference = build(config), build(config, "eager")
    if prepared:
        model = xt.prepare(model)
    reference.load_state_dict(model.state_dict())
    if evaluating:
        model.eval()
        reference.eval()
    return model, reference


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


CASES = [
    ("qwen3_next", 2, "zigzag"),
    ("qwen3_next", 3, "contiguous"),
    ("mamba2", 4, "zigzag"),
    ("mamba2", 3, "contiguous"),
    ("kimi_linear", 2, "zigzag"),
    ("falcon_h1", 3, "contiguous"),
    ("zamba2", 2, "zigzag"),
    ("zamba", 3, "zigzag"),
    ("lfm2_moe", 4, "zigzag"),
    ("lfm3", 2, "contiguous"),
    ("minimax", 3, "zigzag"),
    ("recurrent_gemma", 2, "zigzag"),
    ("rwkv", 4, "contiguous"),
    ("zaya", 3, "zigzag"),
    ("xlstm", 3, "zigzag"),
    ("mamba", 3, "contiguous"),
    ("jamba", 2, "zigzag"),
]


@pytest.mark.parametrize(("kind", "world", "balance"), CASES, ids=[f"{k}-P{w}-{b}" for k, w, b in CASES])
def test_training_matches_one_device(kind, world, balance, full_precision):
    model, reference = twins(full_precision, kind)  # the reference's softmax's float32 is float64 too
    ids = torch.randint(3, VOCAB, (1, 8 * world), generator=torch.Generator().manual_seed(world))
    expected = reference(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()

    def rank(group):
        with xcp.context(group, balance=balance):
            out = model(**xt.shard_batch(ids, labels=ids).model_kwargs())
            out.loss.backward()
            return out.logits.detach(), out.loss.detach()

    results = xcp.LocalWorld(world).run(rank)
    assert rel(xcp.unshard([r[0] for r in results], balance=balance), expected.logits.detach()) <= TOL
    assert rel(sum(r[1] for r in results), expected.loss.detach()) <= TOL
    _same_gradients(model, reference)


def _same_gradients(model, reference):
    """Every parameter's gradient (summed over the ranks) within TOL of the reference's, relative to the largest
    of each (floored at 1e-6 of the largest of all)."""
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in grads.values())
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if name in grads:
            err = float((p.grad - grads[name]).abs().max())
            assert err <= TOL * max(float(grads[name].abs().max()), 1e-6 * scale), name


def test_a_deep_copy_of_a_prepared_model_runs_its_own_layers(full_precision):
    full_precision("mamba2")
    model = xt.prepare(build(_configs()["mamba2"]()))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    ids = torch.randint(3, VOCAB, (1, 8))
    with torch.no_grad():
        want = twin(input_ids=ids).logits

    def rank(group):
        with xcp.context(group), torch.no_grad():
            return twin(**xt.shard_batch(ids).model_kwargs()).logits

    assert rel(xcp.unshard(xcp.LocalWorld(2).run(rank)), want) <= TOL


def test_stripe_is_refused_by_the_layer():
    model = xt.prepare(build(_configs()["mamba2"]()))
    ids = torch.randint(3, VOCAB, (1, 8))

    def rank(group):
        with xcp.context(group, balance="stripe"), torch.no_grad():
            model(**xt.shard_batch(ids).model_kwargs())

    with pytest.raises(RuntimeError, match="balance: expected one of zigzag, contiguous, document_zigzag.*'stripe'"):
        xcp.LocalWorld(2).run(rank)


ULYSSES = [
    ("qwen3_next", "zigzag"), ("falcon_h1", "contiguous"), ("mamba2", "zigzag"), ("jamba", "contiguous"),
    ("minimax", "zigzag"), ("recurrent_gemma", "contiguous"), ("rwkv", "zigzag"), ("zaya", "contiguous"),
    ("xlstm", "zigzag"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "balance"), ULYSSES, ids=[f"{k}-P4-U2-{b}" for k, b in ULYSSES])
def test_training_under_ulysses_matches_one_device(kind, balance, full_precision):
    """A hybrid all-to-all + ring context (P 4, ulysses 2): the recurrent layers pass the state along the
    tokens as xcp.shard(..., ulysses=2) places them, over the whole group; logits, loss and every parameter
    gradient equal one device's."""
    model, reference = twins(full_precision, kind)
    ids = torch.randint(3, VOCAB, (1, 32), generator=torch.Generator().manual_seed(4))
    expected = reference(input_ids=ids, labels=ids, use_cache=False)
    expected.loss.backward()

    def rank(group):
        with xcp.context(group, balance=balance, ulysses=2):
            out = model(**xt.shard_batch(ids, labels=ids).model_kwargs())
            out.loss.backward()
            return out.logits.detach(), out.loss.detach()

    results = xcp.LocalWorld(4).run(rank)
    assert rel(xcp.unshard([r[0] for r in results], balance=balance, ulysses=2), expected.logits.detach()) <= TOL
    assert rel(sum(r[1] for r in results), expected.loss.detach()) <= TOL
    _same_gradients(model, reference)


def test_generate_refuses_a_batch_for_rwkv():
    """transformers' RWKV mixes a batch's rows in its one-token step (its own generate too): one prompt only."""
    model = xt.prepare(build(_configs()["rwkv"]())).eval()
    ids = torch.randint(3, VOCAB, (2, 8))
    with pytest.raises(RuntimeError, match="input_ids: expected one prompt for RwkvModel under xcp's generate; got a"):
        xcp.LocalWorld(2).run(lambda group: xt.generate(model, ids, group=group, max_new_tokens=2, do_sample=False))


NEW = 5
GENERATE = [
    ("qwen3_next", 2, "zigzag", 13),
    ("qwen3_next", 3, "contiguous", 17),
    ("mamba2", 4, "zigzag", 21),
    ("mamba", 3, "contiguous", 14),
    ("lfm2_moe", 2, "zigzag", 11),
    ("mamba2", 1, "zigzag", 9),  # a world of one: the cache counts the prompt's tokens (no attention layer does)
    ("zaya", 3, "zigzag", 14),
    ("recurrent_gemma", 2, "zigzag", 11),
    ("minimax", 2, "zigzag", 11),
    ("rwkv", 2, "zigzag", 11),
    ("xlstm", 2, "zigzag", 11),
    ("minimax", 1, "zigzag", 9),  # a world of one: its ring prefix fills xcp's cache too
]
ONE_PROMPT = {"rwkv"}  # test_generate_refuses_a_batch_for_rwkv


def _recording(model):
    """``model`` and the list its LM head appends each forward's last float64 logits to."""
    steps = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: steps.append(out[:, -1].detach().clone()))
    return model, steps


def _states(cache):
    """Every recurrent layer's states in a generate cache, in order (None where the layer keeps none): the conv
    and recurrent states of transformers' cache layers; MiniMax's linear cache (no conv state); RWKV's state list
    and xLSTM's ``xLSTMCache``, which xcp's cache keeps."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    if isinstance(cache, list):
        return list(cache)
    if hasattr(cache, "rnn_state"):
        return [s for layer in cache.rnn_state.values() for s in layer]
    if hasattr(cache, "linear_cache"):
        return [s for state in cache.linear_cache if isinstance(state, torch.Tensor) for s in (None, state)]
    own = [cache.kept[kind] for kind in ("rwkv", "xlstm") if kind in getattr(cache, "kept", {})]
    if own:  # (RecurrentGemma's, kept per block, are compared through the logits)
        return _states(*own)
    return [
        s
        for layer in cache.layers
        if isinstance(layer, LinearAttentionCacheLayerMixin)
        for s in (*layer.conv_states.values(), *layer.recurrent_states.values())
    ]


@pytest.mark.parametrize(
    ("kind", "world", "balance", "prompt"), GENERATE, ids=[f"{k}-P{w}-{b}-L{n}" for k, w, b, n in GENERATE]
)
def test_generate_equals_one_device(kind, world, balance, prompt, full_precision):
    """xt.generate over ``world`` virtual ranks against the model's own generate (greedy): tokens equal, every
    step's float64 logits and every recurrent layer's conv and recurrent state (whole, on every rank) to 1e-9.
    The prompt: a ring prefix the balance splits, then tokens one at a time."""
    model, reference = twins(full_precision, kind, prepared=False, evaluating=True)
    reference, want_steps = _recording(reference)
    batch = 1 if kind in ONE_PROMPT else 2
    ids = torch.randint(3, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    kw = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = reference.generate(ids, **kw)
    copies = [_recording(xt.prepare(copy.deepcopy(model))) for _ in range(world)]

    def rank(group):
        m, steps = copies[group.rank()]
        return xt.generate(m, ids, group=group, balance=balance, **kw), steps

    expected_states = _states(want.cache)
    assert expected_states
    for out, steps in xcp.LocalWorld(world).run(rank):
        assert torch.equal(out.sequences, want.sequences)
        got_steps = steps[-len(want_steps) :]  # the prompt's ring prefix and its tokens one at a time before
        assert max(rel(a, b) for a, b in zip(got_steps, want_steps)) <= TOL
        assert all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(out.logits, want.logits))
        for got, expected in zip(_states(out.cache), expected_states, strict=True):
            assert (got is None) == (expected is None)
            if got is not None:
                assert rel(got, expected) <= TOL


def test_recurrent_gemma_generates_with_one_model_shared_by_the_ranks(full_precision):
    """Virtual ranks may share one model: RecurrentGemma's blocks keep their states in attributes of their own,
    so each rank keeps its own in its cache and hands them to a block only while it runs."""
    model, reference = twins(full_precision, "recurrent_gemma", evaluating=True)
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = reference.generate(ids, **kw)
    for out in xcp.LocalWorld(3).run(lambda group: xt.generate(model, ids, group=group, balance="contiguous", **kw)):
        assert torch.equal(out.sequences, want.sequences)
        assert max(rel(a, b) for a, b in zip(out.logits, want.logits)) <= TOL


def test_generate_refuses_an_inline_family_without_a_generate_step(monkeypatch):
    """A family whose states generate does not keep (a mixer added to FAMILIES alone) is refused, naming it."""
    from xcp.integrations import transformers_inline

    monkeypatch.delitem(transformers_inline.GENERATES, "MiniMaxLightningAttention")
    model = xt.prepare(build(_configs()["minimax"]())).eval()
    ids = torch.randint(3, VOCAB, (1, 8))
    with pytest.raises(RuntimeError, match="MiniMaxLightningAttention: xcp.integrations.transformers.generate over"):
        xcp.LocalWorld(2).run(lambda group: xt.generate(model, ids, group=group, max_new_tokens=2, do_sample=False))


def test_xlstm_generate_runs_a_shard_longer_than_its_inference_chunks_whole(full_precision):
    """xLSTM runs a sequence longer than ``max_inference_chunksize`` chunk by chunk from the state after the last,
    which state passing does not take: the prompt's ring prefix runs each shard whole. Against the model's own
    generate with chunks longer than the prompt (the same math)."""
    model, reference = twins(full_precision, "xlstm", prepared=False, evaluating=True)
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = reference.generate(ids, **kw)
    model.config.max_inference_chunksize = 3  # the ring prefix's shards: 6 tokens each
    copies = [xt.prepare(copy.deepcopy(model)) for _ in range(2)]
    for out in xcp.LocalWorld(2).run(lambda group: xt.generate(copies[group.rank()], ids, group=group, **kw)):
        assert torch.equal(out.sequences, want.sequences)
        assert max(rel(a, b) for a, b in zip(out.logits, want.logits)) <= TOL


@pytest.mark.parametrize(("kind", "layer"), [("rwkv", "RwkvSelfAttention"), ("recurrent_gemma", "RecurrentGemmaRecur")])
def test_a_carried_state_is_refused_over_ranks(kind, layer):
    model = xt.prepare(build(_configs()[kind]())).eval()  # in eval they keep a state unless use_cache=False
    ids = torch.randint(3, VOCAB, (1, 8))

    def rank(group):
        with xcp.context(group), torch.no_grad():
            model(
                input_ids=xcp.shard(ids, 2, group.rank()),
                position_ids=xcp.shard(torch.arange(8)[None], 2, group.rank()),
            )

    with pytest.raises(RuntimeError, match=rf"{layer}.*: state \(use_cache=True\) under an xcp.context of more than"):
        xcp.LocalWorld(2).run(rank)


def test_generate_of_a_left_padded_batch_equals_one_device(full_precision):
    """A ragged batch (left padding) through xt.generate (its rows one at a time) against the model's own
    generate with the mask, which keeps the padding out of the recurrent states."""
    model, reference = twins(full_precision, "qwen3_next", prepared=False, evaluating=True)
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[mask == 0] = 0
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, **kw)
    copies = [xt.prepare(copy.deepcopy(model)) for _ in range(2)]
    for got in xcp.LocalWorld(2).run(lambda group: xt.generate(copies[group.rank()], ids, group=group, **kw)):
        assert torch.equal(got, want)


def test_the_generate_cache_of_recurrent_layers_refuses_what_it_cannot_follow():
    from xcp.integrations.transformers_generate import ShardedCache

    cache = ShardedCache(_configs()["qwen3_next"](), None, "zigzag")  # layer 0 linear attention, layer 1 full
    assert [type(layer).__name__ for layer in cache.layers] == ["ShardedStates", "ShardedLayer"]
    with pytest.raises(NotImplementedError, match="crop: not supported by xcp's generate cache of a recurrent layer"):
        cache.crop(-1)  # what generate's assisted decoding would ask
    with pytest.raises(NotImplementedError, match=r"reorder_cache \(beam search\): not supported by xcp's generate"):
        cache.layers[0].reorder_cache(torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="layer_idx: expected the slot of a recurrent layer .*got 1, a ShardedLayer"):
        cache.advance(1, 4)
    with pytest.raises(ValueError, match="cache.update: expected no keys and values for a recurrent layer"):
        cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    hybrid = ShardedCache(_configs()["falcon_h1"](), None, "zigzag")  # Mamba beside attention in every layer
    assert [type(layer).__name__ for layer in hybrid.layers] == ["ShardedHybrid", "ShardedHybrid"]


DOCUMENTS = [
    ("qwen3_next", 2, "contiguous"),
    ("qwen3_next", 3, "zigzag"),
    ("mamba2", 4, "contiguous"),
    ("jamba", 3, "zigzag"),
    ("zamba", 4, "contiguous"),
    ("lfm2_moe", 2, "zigzag"),
    ("kimi_linear", 2, "contiguous"),
    ("falcon_h1", 4, "zigzag"),
    ("minimax", 3, "contiguous"),
    ("recurrent_gemma", 2, "zigzag"),
    ("zaya", 2, "contiguous"),
]
"""xcp.context places a packed sequence by zigzag or contiguous (document_zigzag is xcp.shard's and
xcp.attention's: state passing under it is tested in tests/test_recurrent.py)."""

UNSEEN = {"mamba2", "mamba", "falcon_mamba", "jamba", "zaya"}
"""Families whose recurrent layers are never handed the documents (Mamba, Mamba2, Falcon-Mamba: their
ForCausalLM.forward drops cu_seq_lens_q/k; Jamba: its decoder layer calls the Mamba mixer without them; Zaya:
its attention calls the CCA projection without them): on
one device their state runs across the boundaries (Jamba's attention does not: it reads the positions), and
so under xcp; the reference is the packed sequence on one device."""


@pytest.mark.parametrize(("kind", "world", "balance"), DOCUMENTS, ids=[f"{k}-P{w}-{b}" for k, w, b in DOCUMENTS])
def test_packed_documents_equal_each_document_alone(kind, world, balance, full_precision):
    """Packed documents (shard_batch(..., cu_seqlens=): cu_seq_lens_q/k to the model) over LocalWorld: the
    recurrent layers restart their state and convolutions at every boundary, so logits, loss and every
    parameter gradient equal those of each document run alone on one device (transformers' torch kernels
    ignore the boundaries on one device, so the packed one-device model is not the reference). A family that
    never passes the boundaries to its layers (:data:`UNSEEN`) equals the packed sequence run as one."""
    model, reference = twins(full_precision, kind)
    seq = 8 * world
    cu = [0, 5, seq - 6, seq]  # a short document, a long one, and one cut by every balance's pieces
    ids = torch.randint(3, VOCAB, (1, seq), generator=torch.Generator().manual_seed(world))
    labels = ids.clone()
    labels[0, cu[:-1]] = -100  # no label across a boundary
    if kind in UNSEEN:
        positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
        logits = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
    else:
        logits = torch.cat([reference(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(cu, cu[1:])], 1)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
    loss.backward()

    def rank(group):
        with xcp.context(group, balance=balance):
            out = model(**xt.shard_batch(ids, labels=labels, cu_seqlens=cu).model_kwargs())
            out.loss.backward()
            return out.logits.detach(), out.loss.detach()

    results = xcp.LocalWorld(world).run(rank)
    got = xcp.unshard([r[0] for r in results], balance=balance)
    assert rel(got, logits.detach()) <= TOL
    assert rel(sum(r[1] for r in results), loss.detach()) <= TOL
    _same_gradients(model, reference)


def test_seq_idx_is_refused_over_ranks():
    """mamba_ssm's per-token document index is a shard's: the layer asks for the global boundaries."""
    model = xt.prepare(build(_configs()["lfm2_moe"]()))
    ids = torch.randint(3, VOCAB, (1, 8))

    def rank(group):
        with xcp.context(group), torch.no_grad():
            model(**xt.shard_batch(ids).model_kwargs(), seq_idx=torch.zeros(1, 4, dtype=torch.int32))

    with pytest.raises(RuntimeError, match="Lfm2MoeShortConv: seq_idx under an xcp.context .*expected the documents"):
        xcp.LocalWorld(2).run(rank)


def test_documents_of_q_and_k_that_differ_are_refused_by_the_layer():
    model = xt.prepare(build(_configs()["lfm2_moe"]()))  # its first layer is a short convolution
    ids = torch.randint(3, VOCAB, (1, 8))

    def rank(group):
        with xcp.context(group), torch.no_grad():
            kw = xt.shard_batch(ids, cu_seqlens=[0, 3, 8]).model_kwargs()
            model(**{**kw, "cu_seq_lens_k": torch.tensor([0, 4, 8])})

    with pytest.raises(RuntimeError, match="Lfm2MoeShortConv: cu_seq_lens_k: expected the boundaries of cu_seq_lens_q"):
        xcp.LocalWorld(2).run(rank)


GLOO_WORKER = """
import pytest, xcp
sys.path.insert(0, {tests!r})
import test_recurrent_transformers as T
from xcp.integrations import transformers as xt

xt.register()
T.keep_float64(pytest.MonkeyPatch(), "qwen3_next")
case = torch.load(f"{{workdir}}/case.pt")
model = xt.prepare(T.build(T._configs()["qwen3_next"]()))
model.load_state_dict(case["state"])
with xcp.context(None, balance="zigzag"):  # None: the default process group, as under torchrun
    out = model(**xt.shard_batch(case["ids"], labels=case["ids"]).model_kwargs())
    out.loss.backward()
grads = {{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
torch.save({{"logits": out.logits.detach(), "loss": out.loss.detach(), "grads": grads}}, f"{{workdir}}/rank{{rank}}.pt")
dist.barrier()
dist.destroy_process_group()
"""


def test_gloo_processes_match_one_device(tmp_path):
    """Qwen3-Next (a gated delta layer and an attention layer) in two processes over gloo, the default process
    group: logits, loss and every parameter gradient (summed over the ranks) equal one device's."""
    from helpers import finish_ranks, gloo_worker, start_ranks

    with pytest.MonkeyPatch.context() as monkeypatch:
        keep_float64(monkeypatch, "qwen3_next")
        config = _configs()["qwen3_next"]()
        reference = build(config, "eager")
        ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
        expected = reference(input_ids=ids, labels=ids, use_cache=False)
        expected.loss.backward()
    torch.save({"state": reference.state_dict(), "ids": ids}, tmp_path / "case.pt")
    worker = gloo_worker(GLOO_WORKER.format(tests=str(Path(__file__).parent)))
    finish_ranks(start_ranks(worker, 2, tmp_path), timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert rel(xcp.unshard([r["logits"] for r in ranks]), expected.logits.detach()) <= TOL
    assert rel(sum(r["loss"] for r in ranks), expected.loss.detach()) <= TOL
    model = build(config)  # the ranks' gradients summed, as reduce_gradients would
    for name, p in model.named_parameters():
        found = [r["grads"][name] for r in ranks if name in r["grads"]]
        p.grad = sum(found) if found else None
    _same_gradients(model, reference)
