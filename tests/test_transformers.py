"""xcp.context and the transformers drop-in (xcp.integrations.transformers).

Tiny models built from configs (no download), random weights, 4 virtual ranks (a LocalWorld, one model copy
per rank, the ranks' gradients summed) against the same model on one device with transformers' eager
attention: logits, loss and every parameter's gradient.

transformers computes three things in float32 even in a float64 model: the softmax of its eager attention,
RMSNorm, and the causal-LM loss. The float64 comparisons (to 1e-10) patch these three to float64 in both
models alike (:func:`float64_faithful`), so that they see xcp and nothing else; ``test_stock_model`` runs
the models as shipped, where the float32 steps bound the agreement near 1e-7.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from helpers import float64_transformers

import xcp
from xcp.context import Context, current
from xcp.integrations.transformers import prepare

try:
    import transformers  # noqa: F401 - importable, not merely installed

    HAVE_TRANSFORMERS = True
except Exception:  # not installed, or broken
    HAVE_TRANSFORMERS = False
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs transformers")

P = 4
S = 32
VOCAB = 96


# --------------------------------------------------------------------------------------------------------
# xcp.context (no transformers needed)


def test_context_holds_group_and_balance_and_is_current_per_thread():
    x = torch.randn(2, 16, 3)

    def rank(group):
        assert current().world_size == 1  # nothing entered in this thread yet
        with xcp.context(group, balance="stripe") as ctx:
            assert current() is ctx and xcp.context.current() is ctx
            assert (ctx.rank, ctx.world_size, ctx.balance) == (group.rank(), 4, "stripe")
            with xcp.context(None) as inner:
                assert current() is inner
            assert current() is ctx
            return ctx.shard(x)

    shards = xcp.LocalWorld(4).run(rank)
    assert torch.equal(shards[1], xcp.shard(x, 4, 1, balance="stripe"))
    assert torch.equal(Context(None, "stripe").unshard(shards), x)
    assert current().group is None and current().balance == "zigzag"


def test_context_attention_passes_group_and_balance():
    q, k, v = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 1, 8), torch.randn(1, 16, 1, 8)

    def rank(group):
        with xcp.context(group, balance="contiguous") as ctx:
            return ctx.attention(*(ctx.shard(t) for t in (q, k, v)), causal=True)

    out = xcp.unshard(xcp.LocalWorld(2).run(rank), balance="contiguous")
    torch.testing.assert_close(out, xcp.attention(q, k, v, causal=True), atol=1e-6, rtol=1e-6)


def test_context_refuses_a_disagreeing_balance_or_group():
    ctx = xcp.context(None, balance="zigzag")
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(ValueError, match="balance 'zigzag'.*balance='stripe'"):
        ctx.attention(q, q, q, causal=True, balance="stripe")
    with pytest.raises(ValueError, match="group"):
        ctx.attention(q, q, q, causal=True, group=xcp.LocalWorld(1).group(0))
    with pytest.raises(ValueError, match="balance"):
        xcp.context(balance="diagonal")
    with pytest.raises(TypeError, match="group"):
        xcp.context(group="world")


def test_context_passes_ulysses_to_shard_unshard_and_attention():
    """xcp.context(group, ulysses=U): shard and unshard place the sequence as xcp.shard/unshard(ulysses=U) do,
    and attention runs the hybrid, equal to the whole sequence; a disagreeing ulysses and a bad one are named."""
    q, k, v = torch.randn(1, 16, 4, 8), torch.randn(1, 16, 1, 8), torch.randn(1, 16, 1, 8)

    def rank(group):
        with xcp.context(group, "stripe", 2) as ctx:
            assert ctx.ulysses == 2 and current() is ctx and "ulysses=2: rank" in repr(ctx)
            local = [ctx.shard(t) for t in (q, k, v)]
            assert torch.equal(local[0], xcp.shard(q, 4, group.rank(), balance="stripe", ulysses=2))
            with pytest.raises(ValueError, match=r"ulysses: this xcp.context places the sequence with ulysses=2; "
                               r"attention\(ulysses=1\) disagrees"):  # fmt: skip
                ctx.attention(*local, causal=True, ulysses=1)
            return ctx.attention(*local, causal=True, ulysses=2)  # the context's own value is accepted

    outs = xcp.LocalWorld(4).run(rank)
    out = Context(None, "stripe", 2).unshard(outs)
    assert torch.equal(out, xcp.unshard(outs, balance="stripe", ulysses=2))
    torch.testing.assert_close(out, xcp.attention(q, k, v, causal=True), atol=1e-6, rtol=1e-6)
    assert xcp.context(None).ulysses == 1 and "ulysses" not in repr(xcp.context(None))
    with pytest.raises(ValueError, match="ulysses: expected a positive integer"):
        xcp.context(None, ulysses=0)
    with pytest.raises(TypeError, match="ulysses: expected a positive integer"):
        xcp.context(None, ulysses="2")

    def uneven(group):
        with xcp.context(group, ulysses=3) as ctx:
            return ctx.shard(q)

    with pytest.raises(RuntimeError, match="ulysses: expected a divisor of world_size 4"):
        xcp.LocalWorld(4).run(uneven)


def test_context_is_callable_whichever_way_xcp_context_was_imported():
    import subprocess

    code = (
        "import xcp.context, xcp\n"  # the submodule first: xcp.context is the (callable) module
        "c = xcp.context(None, 'stripe'); assert c.balance == 'stripe' and xcp.context.current().world_size == 1\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------------------
# Models


def _config(kind: str, **over):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=8)
    elif kind == "gpt_oss":
        del common["max_position_embeddings"]  # its YaRN defaults fit the default
        common.update(intermediate_size=32, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=8)
        cfg = transformers.GptOssConfig(**common, layer_types=["sliding_attention", "full_attention"])
    elif kind == "gemma2":  # logit soft-capping (a cap the tiny model's scores reach), a window on layer 0
        cfg = transformers.Gemma2Config(**common, head_dim=8, sliding_window=8, attn_logit_softcapping=0.5)
    elif kind == "llama4":  # layer 0 chunked (chunks of 8 positions), layer 1 full (no RoPE, no temperature)
        common.update(head_dim=8, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1)
        cfg = transformers.Llama4TextConfig(**common, attention_chunk_size=8, no_rope_layers=[1, 0],
                                            attn_temperature_tuning=False)  # fmt: skip
    else:
        raise AssertionError(kind)
    for key, value in over.items():
        setattr(cfg, key, value)
    return cfg


def make_model(kind: str, dtype=torch.float64, seed: int = 0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    import transformers

    five = int(transformers.__version__.split(".")[0]) >= 5  # grouped_mm experts: no float64 on the CPU
    extra = {"experts_implementation": "eager"} if kind in ("gpt_oss", "llama4") and five else {}
    model = AutoModelForCausalLM.from_config(_config(kind, **over), attn_implementation="eager", dtype=dtype, **extra)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_()  # nonzero sinks, so that they matter
            if kind == "gemma2" and hasattr(m, "q_proj"):  # scores of a few units, which the cap of 0.5 bends
                m.q_proj.weight.mul_(10)
                m.k_proj.weight.mul_(10)
    return model.train()


def float64_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw):
    """transformers' ForCausalLMLoss without its cast of the logits to float32."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )
    return loss if num_items_in_batch is None else loss / num_items_in_batch


@pytest.fixture
def float64_faithful(monkeypatch):
    """Patch transformers' float32 steps (eager softmax, RMSNorm, loss) to float64, for both models alike."""
    patch = float64_transformers(monkeypatch)

    def apply(model):
        model = patch(model)
        model.loss_function = float64_loss
        return model

    return apply


@pytest.fixture(scope="module")
def registered():
    if not HAVE_TRANSFORMERS:
        pytest.skip("needs transformers")
    from xcp.integrations.transformers import register

    return register()


def single_device(model, ids, labels=None, position_ids=None):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, position_ids=position_ids, use_cache=False)
    if labels is not None:
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), None if out.loss is None else out.loss.detach(), grads


def context_parallel(model, ids, labels=None, world=P, balance="zigzag", shard_kw=None, call_kw=None, name="xcp",
                     ulysses=1):  # fmt: skip
    """The model on ``world`` virtual ranks (a copy each): unsharded logits, summed loss, summed gradients."""
    models = [copy.deepcopy(model) for _ in range(world)]
    for m in models:
        prepare(m).set_attn_implementation(name)
        m.zero_grad()

    def rank(group):
        from xcp.integrations.transformers import shard_batch

        with xcp.context(group, balance=balance, ulysses=ulysses):
            batch = shard_batch(ids, labels=labels, **(shard_kw or {}))
            out = models[group.rank()](**batch.model_kwargs(), **(call_kw or {}))
            if labels is not None:
                out.loss.backward()
            return out.logits.detach(), None if out.loss is None else out.loss.detach()

    results = xcp.LocalWorld(world).run(rank)
    logits = xcp.unshard([r[0] for r in results], balance=balance, ulysses=ulysses)
    loss = None if labels is None else sum(r[1] for r in results)
    grads = {}
    for n, _ in model.named_parameters():
        per_rank = [dict(m.named_parameters())[n].grad for m in models]
        if all(g is not None for g in per_rank):
            grads[n] = sum(per_rank)
    return logits, loss, grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def assert_same(cp, ref, tol, what=""):
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = cp, ref
    assert rel(logits, ref_logits) <= tol, f"{what} logits: {rel(logits, ref_logits):.3g}"
    if ref_loss is not None:
        assert rel(loss, ref_loss) <= tol, f"{what} loss: {float(loss)} vs {float(ref_loss)}"
        assert set(grads) == set(ref_grads) and ref_grads
        worst = max(((rel(grads[n], g), n) for n, g in ref_grads.items()))
        assert worst[0] <= tol, f"{what} gradient of {worst[1]}: {worst[0]:.3g}"


def tokens(batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100  # some tokens out of the loss: the count must be global
    return ids, labels


# --------------------------------------------------------------------------------------------------------
# Agreement with one device


@needs_transformers
@pytest.mark.parametrize(
    ("kind", "balance"),
    [("llama", "zigzag"), ("qwen2", "stripe"), ("mistral", "contiguous"), ("mistral", "zigzag"), ("gpt_oss", "zigzag")],
)
def test_float64_matches_one_device(registered, float64_faithful, kind, balance):
    model = float64_faithful(make_model(kind))
    if kind == "qwen2":  # a scale other than 1/sqrt(head_dim): the module's scaling must reach xcp
        for m in model.modules():
            if hasattr(m, "scaling"):
                m.scaling = 0.25
    ids, labels = tokens()
    ref = single_device(model, ids, labels)
    assert_same(context_parallel(model, ids, labels, balance=balance), ref, 1e-10, kind)
    if kind in ("mistral", "gpt_oss"):  # the window (8 < S) changes the result: the test sees it
        wide = single_device(make_model(kind, sliding_window=S), ids, labels)
        assert rel(wide[0], ref[0]) > 1e-3


@needs_transformers
@pytest.mark.parametrize(("kind", "ulysses"), [("llama", 2), ("gpt_oss", 4)])
def test_the_hybrid_through_the_context_matches_one_device(registered, float64_faithful, kind, ulysses):
    """xcp.context(group, ulysses=U) runs the model's attention as the hybrid (GPT-OSS: sinks, a window, K/V
    heads replicated for U = 4) with shard_batch's positions placed alike: logits, loss and gradients equal
    one device's."""
    model = float64_faithful(make_model(kind))
    ids, labels = tokens()
    ref = single_device(model, ids, labels)
    assert_same(context_parallel(model, ids, labels, ulysses=ulysses), ref, 1e-10, f"{kind} ulysses={ulysses}")


@needs_transformers
def test_packed_documents(registered, float64_faithful):
    # One device: position_ids restarting at 0, from which transformers builds its block-diagonal mask.
    # Context parallel: shard_batch(cu_seqlens=...) gives the positions and the global boundaries.
    model = float64_faithful(make_model("llama"))
    ids, labels = tokens(batch=1)
    cu = [0, 5, 6, 20, S]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])]).unsqueeze(0)
    ref = single_device(model, ids, labels, position_ids=positions)
    assert_same(context_parallel(model, ids, labels, shard_kw={"cu_seqlens": cu}), ref, 1e-10, "cu_seqlens")
    assert_same(context_parallel(model, ids, labels, shard_kw={"position_ids": positions}), ref, 1e-10, "positions")
    one = single_device(model, ids, labels)  # the documents change the result: the test sees them
    assert rel(one[0], ref[0]) > 1e-3
    # Outside any context (one rank), restarting position_ids alone are the documents, as in transformers
    alone = copy.deepcopy(model)
    prepare(alone).set_attn_implementation("xcp")
    assert_same(single_device(alone, ids, labels, position_ids=positions), ref, 1e-10, "one rank")


@needs_transformers
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(registered, float64_faithful, reentrant):
    # The checkpointed layers run their forward again in the backward, attention and its ring included.
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    from xcp.integrations.transformers import attention_forward, mask_forward

    calls = []

    def counted(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return attention_forward(*args, **kwargs)

    transformers.AttentionInterface.register("xcp-counted", counted)
    AttentionMaskInterface.register("xcp-counted", mask_forward)
    model = float64_faithful(make_model("qwen2"))
    ids, labels = tokens()
    ref = single_device(model, ids, labels)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": reentrant})
    assert_same(context_parallel(model, ids, labels, name="xcp-counted"), ref, 1e-10, "checkpointed")
    assert len(calls) == 2 * 2 * P  # 2 layers, forward and recompute, on each rank


@needs_transformers
def test_stock_model(registered):
    # As shipped: float32 softmax (eager), RMSNorm and loss in both; they bound the agreement.
    model = make_model("llama")
    ids, labels = tokens()
    assert_same(context_parallel(model, ids, labels), single_device(model, ids, labels), 1e-5, "stock")


@needs_transformers
def test_bfloat16_within_the_error_of_one_device(registered, float64_faithful):
    # The bf16 model as shipped, on one device and on 4 ranks, each against the same weights in float64.
    ids, labels = tokens()
    low = make_model("llama", dtype=torch.bfloat16)
    one = single_device(low, ids, labels)
    cp = context_parallel(low, ids, labels)
    exact = single_device(float64_faithful(copy.deepcopy(low).to(torch.float64)), ids, labels)
    for i, what, slack in ((0, "logits", 0.0), (1, "loss", 1e-4)):  # the loss: one number, a little slack
        own, ours = rel(one[i], exact[i]), rel(cp[i], exact[i])
        assert ours <= 1.5 * own + slack, f"{what}: context parallel {ours:.3g}, one device {own:.3g}"
    own = max(rel(one[2][n], g) for n, g in exact[2].items())
    ours = max(rel(cp[2][n], g) for n, g in exact[2].items())
    assert ours <= 1.5 * own, f"gradients: context parallel {ours:.3g}, one device {own:.3g}"


# --------------------------------------------------------------------------------------------------------
# Any length: shard_batch(..., pad=True)


def _short(seq_len, batch=1):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    labels = ids.clone()
    labels[:, 1] = -100
    return ids, labels


def _padded(model, ids, labels, world, ulysses=1, **shard_kw):
    """:func:`context_parallel` with ``pad=True``, the logits cut back to the unpadded length."""
    logits, loss, grads = context_parallel(model, ids, labels, world=world, ulysses=ulysses,
                                           shard_kw={"pad": True, **shard_kw})  # fmt: skip
    return logits[:, : ids.shape[1]], loss, grads


@needs_transformers
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("seq_len", [7, 13])
def test_any_length_padded_matches_one_device_unpadded(registered, float64_faithful, world, seq_len):
    """Loss, every gradient and the logits (cut back) equal one device's on the unpadded batch: the padding a
    document of its own (after one or after packed documents), whatever its token id; batch 2 padded at the
    end of each row (the model is causal)."""
    model = float64_faithful(make_model("llama"))
    ids, labels = _short(seq_len)
    ref = single_device(model, ids, labels)
    for pad_token_id in (0, VOCAB - 1):
        assert_same(_padded(model, ids, labels, world, pad_token_id=pad_token_id), ref, 1e-10, f"id {pad_token_id}")
    if world == 4:
        assert_same(_padded(model, ids, labels, world, ulysses=2), ref, 1e-10, "ulysses=2")
    cu = [0, 3, seq_len]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])]).unsqueeze(0)
    packed = single_device(model, ids, labels, position_ids=positions)
    assert_same(_padded(model, ids, labels, world, cu_seqlens=cu), packed, 1e-10, "cu_seqlens")
    rows, row_labels = _short(seq_len, batch=2)
    assert_same(_padded(model, rows, row_labels, world), single_device(model, rows, row_labels), 1e-10, "batch 2")


# --------------------------------------------------------------------------------------------------------
# The batch helper


def test_shard_batch_shifts_on_the_whole_sequence_and_counts_globally():
    from xcp.integrations.transformers import shard_batch

    ids = torch.arange(16).reshape(1, 16) + 100
    labels = ids.clone()
    labels[0, 4] = -100

    def rank(group):
        with xcp.context(group):
            b = shard_batch(ids, labels=labels)
            return b.input_ids, b.position_ids, b.shift_labels, b.num_items_in_batch, b.model_kwargs()

    res = xcp.LocalWorld(2).run(rank)
    assert torch.equal(xcp.unshard([r[0] for r in res]), ids)
    assert torch.equal(xcp.unshard([r[1] for r in res]), torch.arange(16).unsqueeze(0))
    expect = torch.cat([labels[:, 1:], torch.tensor([[-100]])], dim=1)
    assert torch.equal(xcp.unshard([r[2] for r in res]), expect)
    assert [r[3] for r in res] == [14, 14]  # 16 tokens, the last and the one before label 4 out
    kw = res[0][4]
    assert kw["shift_labels"] is kw["labels"] and kw["use_cache"] is False and "cu_seq_lens_q" not in kw


def test_shard_batch_refuses_padding_and_bad_documents():
    from xcp.integrations.transformers import shard_batch

    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    shard_batch(ids, attention_mask=mask)  # no padding: accepted
    mask[1, 6:] = 0
    with pytest.raises(ValueError, match="padding inside a context-parallel sequence is not supported"):
        shard_batch(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="batch 1"):
        shard_batch(ids, cu_seqlens=[0, 3, 8])
    with pytest.raises(ValueError, match="from 0 to 8"):
        shard_batch(ids[:1], cu_seqlens=[0, 3, 7])
    with pytest.raises(ValueError, match=r"input_ids: expected 2 dims"):
        shard_batch(ids[0])


def test_shard_batch_pads_with_a_document_of_its_own():
    from xcp.integrations.transformers import shard_batch

    ids = torch.arange(7).reshape(1, 7) + 10

    def rank(group):
        with xcp.context(group):
            return shard_batch(ids, labels=ids, pad=True, pad_token_id=1), shard_batch(ids.expand(2, 7), pad=True)

    res = xcp.LocalWorld(2).run(rank)
    one, rows = [b for b, _ in res], [b for _, b in res]
    whole = xcp.unshard([b.input_ids for b in one])
    assert torch.equal(whole, torch.tensor([[10, 11, 12, 13, 14, 15, 16, 1]]))
    assert torch.equal(one[0].unpad(whole), ids)
    assert xcp.unshard([b.position_ids for b in one]).tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]  # restarting
    assert xcp.unshard([b.shift_labels for b in one]).tolist() == [[11, 12, 13, 14, 15, 16, -100, -100]]
    assert one[0].padded == 1 and one[0].num_items_in_batch == 6 and one[0].cu_seqlens.tolist() == [0, 7, 8]
    assert one[0].model_kwargs()["cu_seq_lens_q"].tolist() == [0, 7, 8]  # the model runs the documents' path
    assert xcp.unshard([b.position_ids for b in rows]).tolist() == [list(range(8))] * 2  # continuing
    assert rows[0].padded == 1 and rows[0].cu_seqlens is None
    assert torch.equal(xcp.unshard([b.input_ids for b in rows]), torch.cat([ids, torch.tensor([[0]])], 1).expand(2, 8))
    assert shard_batch(ids, pad=True).padded == 0  # a world of one splits any length (its shard: the whole)
    assert torch.equal(shard_batch(ids).input_ids, ids)
    with pytest.raises(ValueError, match=r"^x.shape\[1\]: expected the whole padded sequence"):
        one[0].unpad(whole[:, :1])
    with pytest.raises(RuntimeError, match=r"ValueError: input_ids: expected a length that balance 'zigzag' splits "
                       r"over 2 ranks \(the next is 8\); got 7: pass pad=True"):  # fmt: skip
        xcp.LocalWorld(2).run(lambda group: shard_batch(ids, ctx=xcp.context(group)))
    with pytest.raises(TypeError, match=r"^pad: expected True or False; got 'yes'"):
        shard_batch(ids, pad="yes")
    with pytest.raises(ValueError, match=r"^pad_token_id: expected a token id \(an integer >= 0\); got -1"):
        shard_batch(ids, pad=True, pad_token_id=-1)


def test_missing_transformers_says_how_to_install(monkeypatch):
    from xcp.integrations import transformers as integration

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"needs transformers, which is not importable: .*xcp\[transformers\]"):
        integration.register()


def test_reduce_gradients():
    from xcp.integrations.transformers import reduce_gradients

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    reduce_gradients([p])  # a world of one: nothing to add
    assert torch.equal(p.grad, torch.full((3,), 2.0))

    def rank(group):
        with xcp.context(group):
            reduce_gradients([p])

    with pytest.raises(RuntimeError, match="already sum into .grad"):
        xcp.LocalWorld(2).run(rank)


# --------------------------------------------------------------------------------------------------------
# What xcp cannot do: named errors


def _on_ranks(model, fn, world=2):
    models = [copy.deepcopy(model) for _ in range(world)]
    for m in models:
        prepare(m).set_attn_implementation("xcp")

    def rank(group):
        with xcp.context(group):
            return fn(models[group.rank()])

    return xcp.LocalWorld(world).run(rank)


@needs_transformers
def test_errors_name_the_model_and_the_option(registered):
    from xcp.integrations.transformers import shard_batch

    ids, _ = tokens(batch=1)

    def call(**kw):
        return lambda m: m(**{**shard_batch(ids).model_kwargs(), **kw})

    model = make_model("llama")
    local_mask = torch.ones(1, S // 2, dtype=torch.long)
    local_mask[0, 0] = 0
    with pytest.raises(RuntimeError, match="pads 1 token.*not supported: pack the documents"):
        _on_ranks(model, call(attention_mask=local_mask))
    four_d = torch.zeros(1, 1, S // 2, S // 2)
    with pytest.raises(RuntimeError, match=r"LlamaAttention of a LlamaConfig model.*attention_mask \(\(1, 1, 16, 16\)"):
        _on_ranks(model, call(attention_mask=four_d))
    with pytest.raises(RuntimeError, match="LlamaAttention.*not the global positions"):
        _on_ranks(model, lambda m: m(input_ids=shard_batch(ids).input_ids))  # position_ids forgotten
    with pytest.raises(RuntimeError, match="LlamaAttention.*output_attentions"):
        _on_ranks(model, call(output_attentions=True))
    dropout = make_model("llama", attention_dropout=0.1)
    with pytest.raises(RuntimeError, match=r"LlamaAttention.*dropout 0.1 in training.*config.attention_dropout"):
        _on_ranks(dropout, call())
    _on_ranks(dropout.eval(), call())  # no dropout outside training: runs
    gen = make_model("llama").eval().to(torch.float32)
    prepare(gen).set_attn_implementation("xcp")
    with pytest.raises(ValueError, match="KV cache"):
        gen.generate(ids[:, :4], max_new_tokens=2, do_sample=False)


@needs_transformers
def test_rows_padded_at_their_ends_are_refused_by_a_bidirectional_layer(registered):
    from xcp.integrations.transformers import shard_batch

    model = make_model("llama")
    for m in model.modules():
        if hasattr(m, "is_causal"):
            m.is_causal = False  # bidirectional attention
    rows, _ = _short(7, batch=2)
    with pytest.raises(RuntimeError, match=r"ValueError: xcp attention \(LlamaAttention.*padded at their ends.*exact "
                       r"only under causal attention.*Pack the rows into one of batch 1"):  # fmt: skip
        _on_ranks(model, lambda m: m(**shard_batch(rows, pad=True).model_kwargs()))
    one = _on_ranks(model, lambda m: m(**shard_batch(rows[:1], pad=True).model_kwargs()).logits)  # a document
    assert one[0].shape == (1, 4, VOCAB)


@needs_transformers
def test_mask_functions_xcp_does_not_serve_are_refused(registered):
    from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay, or_masks

    from xcp.integrations.transformers import mask_forward

    assert mask_forward(1, 8, 8, mask_function=causal_mask_function) is None
    chunked = and_masks(chunked_overlay(4, torch.zeros(1, dtype=torch.long)), causal_mask_function)
    with pytest.raises(ValueError, match="chunk_size=4; xcp serves attention chunks from config.attention_chunk_size"):
        mask_forward(1, 8, 8, mask_function=chunked)  # no config, or another chunk: not what the attention reads
    config = prepare(make_model("llama4")).config  # a prepared model's: the mask function serves its chunks of 8
    chunked = and_masks(chunked_overlay(8, torch.zeros(1, dtype=torch.long)), causal_mask_function)
    assert mask_forward(1, 8, 8, mask_function=chunked, config=config) is None
    padded = and_masks(chunked_overlay(8, torch.tensor([1])), causal_mask_function)
    with pytest.raises(ValueError, match=r"chunked mask shifted by left padding \(\[1\]\)"):
        mask_forward(1, 8, 8, mask_function=padded, config=config)
    with pytest.raises(ValueError, match="or_mask"):
        mask_forward(1, 8, 8, mask_function=or_masks(causal_mask_function, lambda b, h, q, k: q == 0))


# --------------------------------------------------------------------------------------------------------
# torch.compile: a world of one (no context entered), the attention function traced without a break


def _compiled(model, fullgraph=False, backend="aot_eager"):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    return torch.compile(model, fullgraph=fullgraph, backend=counter), counter


def _step(model, **kw):
    """logits, loss and the gradients of one forward/backward (``model`` compiled or not)."""
    model.zero_grad()
    out = model(**kw)
    out.loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in params}


@needs_transformers
def test_compiled_model_has_the_frames_of_sdpa_and_equals_eager(registered):
    """The xcp model compiles into as many frames as the stock sdpa model (counted by a counting backend:
    torch._dynamo.explain under-reports here), with fullgraph=True, and computes what it computes eagerly."""
    ids, labels = tokens(batch=1)
    kw = dict(input_ids=ids, labels=labels, position_ids=torch.arange(S)[None], use_cache=False)
    sdpa = make_model("llama", dtype=torch.float32)
    sdpa.set_attn_implementation("sdpa")
    model = copy.deepcopy(sdpa)
    prepare(model).set_attn_implementation("xcp")
    want = _step(model, **kw)

    compiled_sdpa, sdpa_frames = _compiled(sdpa, backend="eager")  # frames are dynamo's, whatever the backend
    with torch.no_grad():
        compiled_sdpa(**kw)
    compiled, frames = _compiled(model, fullgraph=True)  # one graph or an error: no silent break
    got = _step(compiled, **kw)
    assert frames.frame_count == sdpa_frames.frame_count, (frames.frame_count, sdpa_frames.frame_count)
    assert_same(got, want, 1e-6, "compiled")
    _step(compiled, **kw)
    assert frames.frame_count == sdpa_frames.frame_count  # the next step reuses the graph


@needs_transformers
def test_compiled_packed_documents_and_what_compile_checks(registered):
    from xcp.integrations.transformers import shard_batch

    ids, _ = tokens(batch=1)
    cu = [0, 5, 20, S]
    batch = shard_batch(ids, cu_seqlens=cu)
    kw = batch.model_kwargs(compiled=True)
    assert kw["cu_seq_lens_q"] == cu and kw["cu_seq_lens_k"] == cu
    model = make_model("llama", dtype=torch.float32).eval()
    prepare(model).set_attn_implementation("xcp")
    compiled, frames = _compiled(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        want = model(**batch.model_kwargs()).logits  # eager: the boundaries as a tensor
        torch.testing.assert_close(compiled(**kw).logits, want, atol=1e-6, rtol=1e-6)
        assert frames.frame_count == 1
        # what compile cannot read on the host: boundaries as a tensor (refused when traced), positions that
        # restart without boundaries and padding (both checked on the device, in the graph)
        with pytest.raises(Exception, match="cu_seq_lens_q: under torch.compile pass the GLOBAL document"):
            compiled(**batch.model_kwargs())
        with pytest.raises(RuntimeError, match="LlamaAttention.*not the global positions"):
            compiled(input_ids=ids, position_ids=batch.position_ids, use_cache=False)
        padding = torch.ones_like(ids)
        padding[0, :2] = 0
        with pytest.raises(RuntimeError, match="attention_mask pads token.*pack the documents"):
            compiled(input_ids=ids, attention_mask=padding, use_cache=False)


@needs_transformers
def test_compile_refuses_a_local_world_group_with_the_reason(registered):
    from xcp.integrations.transformers import shard_batch

    ids, _ = tokens(batch=1)
    model = make_model("llama", dtype=torch.float32).eval()
    prepare(model).set_attn_implementation("xcp")
    compiled, _ = _compiled(model, fullgraph=True, backend="eager")

    def rank(group):
        with xcp.context(group), torch.no_grad():
            return compiled(**shard_batch(ids).model_kwargs())

    with pytest.raises(RuntimeError, match="LocalWorld ranks are threads of one process"):
        xcp.LocalWorld(1).run(rank)


# --------------------------------------------------------------------------------------------------------
# Attention variants: Gemma-2's logit soft-capping, Llama-4's chunked layers


@needs_transformers
@pytest.mark.parametrize(
    ("kind", "balance", "world", "off"),
    [("gemma2", "zigzag", 4, {"attn_logit_softcapping": None}),
     ("gemma2", "stripe", 2, {"attn_logit_softcapping": None}),
     ("llama4", "zigzag", 4, {"attention_chunk_size": S}),
     ("llama4", "contiguous", 2, {"attention_chunk_size": S})],
)  # fmt: skip
def test_softcapped_and_chunked_layers_match_one_device(registered, float64_faithful, kind, balance, world, off):
    """Gemma-2 passes softcap= to the attention; Llama-4's chunked layer is told by its config
    (xcp.integrations.transformers_variants): logits, loss and every gradient equal one device's eager model,
    which the variant changes (the same model without it differs)."""
    model = float64_faithful(make_model(kind))
    ids, labels = tokens()
    ref = single_device(model, ids, labels)
    assert_same(context_parallel(model, ids, labels, balance=balance, world=world), ref, 1e-10, kind)
    without = single_device(float64_faithful(make_model(kind, **off)), ids, labels)
    assert rel(without[0], ref[0]) > 1e-3, "the variant changes the model: the comparison sees it"


@needs_transformers
def test_llama4_temperature_tuning_on_a_layer_without_rope_is_refused():
    """It scales queries by positions counted over the layer's own tokens (a shard's, under xcp): refused by
    name, where the layers with RoPE (no tuning) pass."""
    with pytest.raises(ValueError, match=r"Llama4TextAttention: attention temperature tuning.*not the global"):
        prepare(make_model("llama4", attn_temperature_tuning=True))
    prepare(make_model("llama4"))
