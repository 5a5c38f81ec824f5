"""Multi-head latent attention (DeepSeek-V3) through ``attn_implementation="xcp"``: training over 4 virtual
ranks against one device's eager attention, and xt.generate against transformers' own greedy generate.

A tiny DeepSeek-V3 built from its config (no download), float64: q/k head dim 12 (8 nope + 4 rope), v head
dim 6, q and kv LoRA ranks, a dense layer then a mixture-of-experts layer (4 routed experts, top 2, one
shared). transformers' float32 steps (eager softmax, RMSNorm, the loss) are patched to float64 in both runs
alike; its router stays in float32 (transformers keeps ``gate.weight`` float32), so that weight's gradient
compares to float32's precision, every other one to 1e-10.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import float64_transformers

import xcp

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v3")
from xcp.integrations import transformers as xt  # noqa: E402 - after the skip

VOCAB = 96
NOPE, ROPE, V, RANK = 8, 4, 6, 16


def make_model(**over):
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=1, max_position_embeddings=128, num_mtp_layers=0, **over,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float64, experts_implementation="eager"
    )
    for m in model.modules():
        if hasattr(m, "kv_b_proj"):
            m.scaling = 0.25  # not 1/sqrt(12), xcp's default: the module's scaling must reach xcp
    return model


def float64_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw):
    """transformers' ForCausalLMLoss without its cast of the logits to float32."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return loss / (num_items_in_batch or int((shift_labels != ignore_index).sum()))


@pytest.fixture
def faithful(monkeypatch):
    return float64_transformers(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def registered():
    name = xt.register()
    shapes = []

    def recording(module, query, key, value, *args, **kwargs):
        shapes.append((query.shape[-1], key.shape[-1], value.shape[-1]))
        return xt.attention_forward(module, query, key, value, *args, **kwargs)

    transformers.AttentionInterface.register("xcp-shapes", recording)
    transformers.masking_utils.AttentionMaskInterface.register("xcp-shapes", xt.mask_forward)
    return name, shapes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_training_matches_one_device(registered, faithful):
    """Logits, loss and every gradient over 4 ranks (zigzag) equal one device's; xcp gets v unpadded."""
    model = faithful(make_model()).train()
    model.loss_function = float64_loss
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 32), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    models = [copy.deepcopy(model) for _ in range(4)]
    for m in models:
        xt.prepare(m).set_attn_implementation("xcp-shapes")
        m.zero_grad()

    def rank(group):
        with xcp.context(group):
            batch = xt.shard_batch(ids, labels=labels)
            got = models[group.rank()](**batch.model_kwargs())
            got.loss.backward()
            return got.logits.detach(), got.loss.detach()

    results = xcp.LocalWorld(4).run(rank)
    _, shapes = registered
    assert set(shapes) == {(NOPE + ROPE, NOPE + ROPE, V)}  # v as the model made it: not padded to q's dim
    assert rel(xcp.unshard([r[0] for r in results]), out.logits.detach()) <= 1e-10
    assert rel(sum(r[1] for r in results), out.loss.detach()) <= 1e-10
    for name, want in ref_grads.items():
        got = sum(dict(m.named_parameters())[name].grad for m in models)
        tol = 1e-10 if want.dtype == torch.float64 else 1e-6  # the router's float32 gate.weight
        assert rel(got, want) <= tol, name


def test_generate_equals_one_device_over_the_latents(registered, faithful):
    """Greedy tokens equal transformers' generate on one device and each step's float64 logits to 1e-9, a
    prompt of 21 = 16 through the ring (zigzag, 4 ranks) + a chunk of 5; each rank's cache holds its share
    of the latents (one head, [kv_nope, k_rot], its first channels read as the value kv_nope), not the heads'
    expanded keys and values."""
    new = 6
    model = faithful(make_model()).eval()
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(2))

    def recording(m):
        steps: list[torch.Tensor] = []
        m.get_output_embeddings().register_forward_hook(lambda mod, a, out: steps.append(out[:, -1].clone()))
        return m, steps

    ref_model, ref_steps = recording(copy.deepcopy(model))
    ref = ref_model.generate(ids, max_new_tokens=new, do_sample=False)
    copies = [recording(copy.deepcopy(model)) for _ in range(4)]
    for m, _ in copies:
        xt.prepare(m).set_attn_implementation("xcp")

    def rank(group):
        m, steps = copies[group.rank()]
        out = xt.generate(m, ids, group=group, max_new_tokens=new, return_dict_in_generate=True)
        return out, steps

    results = xcp.LocalWorld(4).run(rank)
    for out, steps in results:
        assert torch.equal(out.sequences, ref)
        assert max(rel(a, b) for a, b in zip(steps, ref_steps, strict=True)) <= 1e-9
    for layer in range(2):
        kvs = [out.cache.sharded[layer].kv for out, _ in results]
        assert sum(kv.local_len for kv in kvs) == 21 + new - 1
        assert kvs[0].keys().shape[2:] == (1, RANK + ROPE) and kvs[0].values().shape[2:] == (1, RANK)
        keys = kvs[0].keys()  # the values are the keys' first RANK channels, stored once
        assert kvs[0].values().data_ptr() == keys.data_ptr() and torch.equal(kvs[0].values(), keys[..., :RANK])
        assert kvs[0].nbytes == keys.untyped_storage().nbytes()  # the key storage alone
