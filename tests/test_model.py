"""The Llama model on one device: shapes of the real presets, causality, remat, MoE routing."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import PRESETS, Llama, Routing
from spmd.parallel.skeleton import model_skeleton

# Published parameter counts of the real models.
KNOWN_PARAMS = {
    "llama3.2-1b": 1_235_814_400,
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    # Qwen3's model cards: 0.6B (0.44B without the embedding), 8.2B (6.95B), 32.8B (31.2B);
    # these are the counts of their published shapes (config.json), which round to those.
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    # The safetensors index's total_size / 2 (bfloat16) of each published checkpoint.
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_241_732_096,
    "mistral-7b-v0.3": 7_248_023_552,
    # Gemma 3 1B: the API's safetensors total. 27B: the text model; the checkpoint's
    # 27,432,406,640 adds its vision tower (416,866,032) and projector (6,194,304).
    "gemma3-1b": 999_885_952,
    "gemma3-27b": 27_009_346_304,
    # OLMo 2's model cards: 7.3B and 13.7B; these are the counts of the published shapes.
    "olmo2-7b": 7_298_617_344,
    "olmo2-13b": 13_716_198_400,
}


@pytest.mark.parametrize("name", KNOWN_PARAMS)
def test_real_presets_build_abstractly_with_published_sizes(name):
    skeleton = model_skeleton(name)  # shapes only: nothing is allocated
    assert skeleton.num_params == KNOWN_PARAMS[name] == PRESETS[name].num_params()
    block = skeleton.names["blocks"]
    wkv = block["moe"]["attn"]["wkv"] if PRESETS[name].moe else block["attn"]["wkv"]
    assert wkv == ("layers", "embed", "kv_heads", None, "head_dim")


# Families whose presets' counts are checked elsewhere (DeepSeek-V3's: 671B and V2-Lite's,
# active and total, beside its own model).
COUNTED_ELSEWHERE = {"deepseek_v3": "tests/test_deepseek.py"}


def test_every_family_keeps_the_contract_and_has_a_counted_preset():
    """models.family's interfaces, for every registered family: its config, model class,
    block, attention and Hugging Face layout module have every member, each method taking
    the contract's parameters; and a published preset whose count is checked, where
    `num_params` (from `LlamaConfig.block_norms`, the description the model is built from)
    meets the built model."""
    from models import FAMILIES, HF_LAYOUTS, family

    for cfg_cls, model_cls in FAMILIES.items():
        parts = {"config": (cfg_cls, family.Config), "model": (model_cls, family.Model),
                 "block": (model_cls.BLOCK, family.Block), "attention": (model_cls.BLOCK.ATTENTION, family.Attention),
                 "hf layout": (HF_LAYOUTS[cfg_cls], family.HFLayout)}
        assert {part: family.breaches(obj, protocol) for part, (obj, protocol) in parts.items()} == dict.fromkeys(
            parts, []), cfg_cls.family
    counted = {PRESETS[name].family for name in KNOWN_PARAMS} | set(COUNTED_ELSEWHERE)
    assert counted == {cls.family for cls in FAMILIES}


def test_the_contract_check_finds_a_missing_member_and_a_wrong_signature():
    """`breaches` is what the test above trusts: it must fail a layout that lacks a member
    or takes other parameters."""
    import types

    from models import family
    from models.llama import hf

    broken = types.SimpleNamespace(**{n: getattr(hf, n) for n in ("ARCHITECTURES", "config_values", "config_from_hf",
                                                                 "config_to_hf", "supported", "tensors", "copies")})
    broken.supported = lambda config, extra: None
    assert family.breaches(broken, family.HFLayout) == [
        "supported: takes ['config', 'extra'], the contract ['cfg']", "tensor_count: missing"]


# Every place in the docs that lists the families, and each family's name as they write it
# (a new family adds its name here, and the test says where the docs lack it).
FAMILY_NAMES = {"llama": "Llama", "qwen3": "Qwen3", "qwen2": "Qwen2", "mistral": "Mistral", "gemma3": "Gemma 3",
                "deepseek_v3": "DeepSeek-V3", "olmo2": "OLMo 2"}
DOCS_LISTS = {"README.md": "| Hugging Face Llama", "docs/README.md": "Hugging Face Llama/",
              "docs/huggingface.md": "Start from a published Llama"}


def test_the_docs_name_every_family_where_they_list_them():
    from models import FAMILIES, HF_LAYOUTS

    root = pathlib.Path(__file__).parents[1]
    assert set(FAMILY_NAMES) == {cls.family for cls in FAMILIES}
    missing = []
    for path, anchor in DOCS_LISTS.items():
        (line,) = [line for line in (root / path).read_text().splitlines() if anchor in line]
        missing += [f"{path}: {name}" for name in FAMILY_NAMES.values() if name not in line]
    architecture, hf = (root / "docs" / "architecture.md").read_text(), (root / "docs" / "huggingface.md").read_text()
    folders = {cls.__module__.split(".")[1] for cls in FAMILIES}
    missing += [f"docs/architecture.md: {f}" for f in folders
                if not re.search(rf"^  {f}/ ", architecture, re.M) or f"| `models/{f}` |" not in architecture]
    missing += [f"docs/huggingface.md: {f}" for f in folders if f"`models/{f}/`" not in hf]
    missing += [f"docs/huggingface.md: {a}" for layout in HF_LAYOUTS.values() for a in layout.ARCHITECTURES
                if f"`{a}`" not in hf]
    assert missing == []


def _built(cfg, **kwargs) -> Llama:
    """The model with parameters drawn by one unoptimized compiled program: drawn op by op
    (eagerly), or optimized by LLVM, they take seconds."""
    make = lambda: Llama(cfg, rngs=nnx.Rngs(params=jax.random.key(0)), **kwargs)  # noqa: E731
    params = jax.jit(lambda: nnx.state(make()), compiler_options={"xla_backend_optimization_level": 0})()
    return nnx.merge(nnx.graphdef(nnx.eval_shape(make)), params)


def _tiny(remat="none"):
    return _built(PRESETS["tiny"], remat=remat)


def test_a_token_never_sees_the_future():
    model = _tiny()
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 7) % 256)
    forward = nnx.jit(lambda m, t: m(t))  # one compiled program instead of op-by-op dispatch
    a, b = forward(model, tokens), forward(model, changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("policy", ["full", pytest.param("dots", marks=pytest.mark.slow)])  # the gate keeps one policy
def test_remat_changes_memory_not_gradients(policy):
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)

    def grads(model):
        graphdef, params = nnx.split(model)
        return jax.jit(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)))(params)

    for got, want in zip(jax.tree.leaves(grads(_tiny(policy))), jax.tree.leaves(grads(_tiny()))):
        # Recomputing the forward pass repeats the same float32 operations: equal up to
        # XLA fusing them differently (a few ulps).
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tied", [False, True])
def test_the_pad_tokens_row_gets_no_gradient_from_the_lookup(tied):
    """As transformers' nn.Embedding(padding_idx=pad_token_id): the lookup sends the pad
    row no gradient (config.json's pad_token_id, read by every family). Tied to the head,
    the row still trains as an output."""
    tokens = jnp.array([[3, 5, 3, 7, 9, 3, 11, 12]])

    def embedding_gradient(pad_token):  # per row: the sum of its gradient's magnitudes
        cfg = dataclasses.replace(PRESETS["tiny"], pad_token=pad_token, tie_embeddings=tied)
        graphdef, params = nnx.split(_built(cfg))
        grads = jax.jit(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)))(params)
        return np.abs(np.asarray(grads["embedding"][...])).sum(axis=1)

    padded, plain = embedding_gradient(3), embedding_gradient(None)
    assert plain[3] > 0 and padded[5] > 0  # without a pad token, row 3 trains like any row read
    if tied:  # the lookup's share is gone, the head's stays
        assert 0 < padded[3] < plain[3]
    else:
        assert padded[3] == 0
    np.testing.assert_array_equal(np.delete(padded, 3), np.delete(plain, 3))  # the forward pass is the same


def test_models_name_logical_axes_only():
    mesh_axis = re.compile(r"""["'](pp|dp|fsdp|ep|sp|tp)["']|jax\.devices\(|device_count\(""")
    for path in pathlib.Path(__file__).parents[1].joinpath("models").glob("*.py"):
        assert not mesh_axis.search(path.read_text()), path


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-moe-16b-like"])
def test_moe_presets_build_abstractly(name):
    skeleton = model_skeleton(name)
    assert skeleton.num_params == PRESETS[name].num_params()
    moe = skeleton.names["blocks"]["moe"]["mlp"]
    assert moe["gate_up"] == ("layers", "experts", "embed", None, "mlp")
    assert moe["down"] == ("layers", "experts", "mlp", "embed")
    if name == "mixtral-8x7b":  # published: 46.7B parameters, 12.9B used per token
        assert skeleton.num_params == 46_702_792_704
        assert round(PRESETS[name].num_params(active=True) / 1e9, 1) == 12.9


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_moe_layer_capacity_without_drops_equals_dropless(scoring):
    cfg = dataclasses.replace(PRESETS["moe-tiny"], moe=dataclasses.replace(PRESETS["moe-tiny"].moe, scoring=scoring))
    tokens = jax.random.randint(jax.random.key(3), (4, 16), 0, 256)

    params = nnx.state(_built(cfg))

    def forward(dispatch, factor):  # the same parameters under another routing
        shape = nnx.eval_shape(lambda: Llama(cfg, routing=Routing(dispatch, factor), rngs=nnx.Rngs(0)))
        graphdef = nnx.graphdef(shape)
        return jax.jit(lambda p: nnx.merge(graphdef, p).forward(tokens))(params)

    dropless, stats = forward("dropless", 1.0)
    roomy, roomy_stats = forward("capacity", cfg.moe.experts / cfg.moe.top_k)  # room for every token
    tight, tight_stats = forward("capacity", 0.5)
    # float32 sums in another order: a few roundings of logits of size ~10.
    np.testing.assert_allclose(roomy, dropless, atol=1e-5)
    assert float(stats["dropped"][0]) == float(roomy_stats["dropped"][0]) == 0.0
    # 0.5 x 16 x 2 / 8 = 2 slots per expert: at most 16 of each sequence's 32 choices fit.
    assert float(tight_stats["dropped"][0]) >= 0.5
    assert not np.allclose(tight, dropless, atol=1e-3)
    assert 1.0 <= float(stats["balance_loss"][0]) <= cfg.moe.experts  # 1 when perfectly balanced
    np.testing.assert_allclose(np.sum(stats["expert_load"], axis=-1), 1.0, rtol=1e-6)
