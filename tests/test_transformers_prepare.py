"""``xcp.integrations.transformers.prepare``: every layer context-parallel or refused by name, its registry of
adapters and refusals, and the refusal of a model that skipped it (tiny models built from configs)."""

from __future__ import annotations

import copy

import pytest
import torch

import xcp

transformers = pytest.importorskip("transformers", reason="needs transformers")

from xcp.integrations import transformers as xt  # noqa: E402 - after the skip
from xcp.integrations import transformers_prepare as tp  # noqa: E402

VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def registered():
    return xt.register()


def build(config, impl="xcp"):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def llama():
    return build(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )
    )  # fmt: skip


def run_on_ranks(model, ids, world=2):
    def rank(group):
        with xcp.context(group), torch.no_grad():
            batch = xt.shard_batch(ids)
            return model(**batch.model_kwargs()).logits

    return xcp.LocalWorld(world).run(rank)


def test_a_model_used_without_prepare_is_refused_at_its_first_forward():
    model = llama()
    ids = torch.randint(0, VOCAB, (1, 16))
    with pytest.raises(RuntimeError, match=r"LlamaConfig model.*not prepared.*prepare\(model\)"):  # LocalWorld's
        run_on_ranks(model, ids)
    with pytest.raises(ValueError, match=r"model: the model was not prepared"):
        xt.generate(model, ids, max_new_tokens=2)
    assert xt.prepare(model) is model and xt.is_prepared(model)
    assert xt.prepare(model) is model  # idempotent
    out = xcp.unshard(run_on_ranks(model, ids))
    reference = build(copy.deepcopy(model.config), "eager")
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(out, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    build(model.config, "eager")  # from_config sets "eager" on the config object the model shares
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM: attn_implementation 'eager' under an xcp.context of 2"):
        run_on_ranks(model, ids)


def test_the_attention_function_alone_refuses_an_unprepared_module():
    model = xt.prepare(llama())
    attention = model.model.layers[0].self_attn
    fresh = llama().model.layers[0].self_attn  # same class, never prepared
    q = torch.randn(1, 4, 8, 8)
    k = v = torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match=r"xcp attention \(LlamaAttention of a LlamaConfig model\): .*not prepared"):
        xt.attention_forward(fresh, q, k, v, None)
    out, _ = xt.attention_forward(attention, q, k, v, None, scaling=8**-0.5)
    assert out.shape == (1, 8, 4, 8)


def test_attention_outside_the_interface_is_refused_by_name():
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    model = build(config)
    with pytest.raises(ValueError, match=r"BloomAttention: computes attention itself, outside transformers' attention"):
        xt.prepare(model)
    assert not xt.is_prepared(model)
    with pytest.raises(RuntimeError, match=r"attention mask of a BloomConfig model: the model was not prepared"):
        run_on_ranks(model, torch.randint(0, VOCAB, (1, 16)))  # xcp never sees its attention, but sees its mask


@pytest.mark.parametrize(
    "kind, config",
    [
        ("Falcon", lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4)),
        ("GPT-Neo", lambda: transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                                                      attention_types=[[["global", "local"], 1]])),
    ],
)  # fmt: skip
def test_models_with_attention_tables_of_their_own_say_so_while_being_built(kind, config):
    with pytest.raises(ValueError, match=rf"attn_implementation='xcp': {kind} .*own table .*not supported"):
        build(config())
    build(config(), "eager")  # their own names are untouched


def test_positions_the_model_makes_itself_and_unseen_attention_are_refused():
    bart = build(
        transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
            encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64,
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"BartForCausalLM: its forward takes no position_ids: it numbers the tokens"):
        xt.prepare(bart)
    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    with pytest.raises(ValueError, match=r"RobertaEmbeddings: given no position_ids it numbers the tokens from pad"):
        xt.prepare(build(transformers.RobertaConfig(**small, is_decoder=True)))
    megatron = build(transformers.MegatronBertConfig(**small, is_decoder=True))  # attention of its own, unlisted
    with pytest.raises(ValueError, match=r"MegatronBertSelfAttention: computes attention itself, outside"):
        xt.prepare(megatron)
    xt.prepare(build(transformers.BertConfig(**small, is_decoder=True)))  # BERT's goes through the interface


def test_doge_dynamic_mask_and_recurrent_layers_are_refused_saying_what_they_are():
    doge = build(
        transformers.DogeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"DogeAttention: adds a learned dynamic mask"):
        xt.prepare(doge)

    class ToyShortConv(torch.nn.Module):  # named like a recurrent mixer, of a family no adapter serves
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(8, 8, 4, groups=8, padding=3)

    # transformers' recurrent families (RWKV, refused here before) are adapted now (test_recurrent_transformers.py)
    with pytest.raises(ValueError, match=r"ToyShortConv: mixes the sequence outside attention \(a recurrence or conv"):
        xt.prepare(torch.nn.Sequential(ToyShortConv()))
    depthwise = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Conv1d(8, 8, 4, groups=8))
    with pytest.raises(ValueError, match=r"Conv1d \(1\): mixes the sequence outside attention \(a convolution over"):
        xt.prepare(depthwise)


def test_an_adapter_overrides_a_refusal_and_replaces_or_changes_modules():
    model = llama()
    seen = []

    class Replaced(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    def adapt(module):
        seen.append(module)
        return Replaced(module) if len(seen) == 1 else None

    tp.refuse_layer("LlamaMLP", "a refusal the adapter overrides", name="test refusal")
    tp.register_layer("LlamaMLP", adapt, name="test adapter")
    try:
        with pytest.raises(ValueError, match=r"name: expected a name not registered yet; got 'test adapter'"):
            tp.register_layer("LlamaMLP", adapt, name="test adapter")
        xt.prepare(model)
        assert len(seen) == 2 and isinstance(model.model.layers[0].mlp, Replaced)
        assert model.model.layers[1].mlp is seen[1] and xt.is_prepared(model.model.layers[0].mlp.inner)
        xt.prepare(model)
        assert len(seen) == 2  # idempotent: a prepared module is not adapted again
    finally:
        tp.unregister_layer("test adapter")
        tp.unregister_layer("test refusal")
    with pytest.raises(ValueError, match="LlamaMLP: a refusal the adapter overrides"):
        tp.refuse_layer("LlamaMLP", "a refusal the adapter overrides", name="test refusal")
        try:
            xt.prepare(llama())
        finally:
            tp.unregister_layer("test refusal")
    assert all(r.name != "test refusal" for r in tp.refusals())


def test_the_registry_names_bad_arguments():
    with pytest.raises(TypeError, match=r"model: expected a torch.nn.Module .*got str"):
        xt.prepare("llama")
    with pytest.raises(ValueError, match=r"name: expected a non-empty string; got ''"):
        tp.register_layer("X", lambda m: None, name="")
    with pytest.raises(TypeError, match=r"adapt: expected a callable"):
        tp.register_layer("X", None, name="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"match: expected a class, a class name or a predicate"):
        tp.refuse_layer(3, "why", name="x")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"no adapter or refusal registered as 'nothing'"):
        tp.unregister_layer("nothing")
