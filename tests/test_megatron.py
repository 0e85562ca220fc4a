"""Tensor parallelism's dimension per weight, read from the program's factors
(shardsat/extract/megatron.py): the standard families split what Megatron splits."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from shardsat.testing import standard_layouts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

S = jax.ShapeDtypeStruct
MESH = ((2, 4), ("data", "model"))


def _gpt_params_of(family: str, layers: int):
    cfg = GPTConfig(layers=layers, d_model=32, heads=4, mlp=64, vocab=96, seq=16, batch=8)
    _, step = make_gpt_step(cfg)
    params = gpt_params(cfg, abstract=True)
    args = ((params, jax.eval_shape(optax.adamw(1e-3).init, params)), gpt_batch(cfg, abstract=True))
    fams = standard_layouts(step, jax.make_mesh(*MESH), *args, state_argnums=(0,))
    return fams[family][0][0]


def test_attention_weights_split_on_heads_not_on_the_residual_width():
    """Regression (benchmarks/priors.py, 4x4x4): the families split each weight's largest
    dimension, which for attention projections shaped (d_model, heads, head_dim) is d_model, so
    "FSDP + TP" was not Megatron's, and a 4-layer GPT step's free plan cost 806 us against the
    hand-written FSDP + TP layout's 582. Now: heads for wq/wk/wv/wo, the hidden width of the MLP
    pair, the vocabulary; norm scales and biases of the residual stream stay whole over TP."""
    p = _gpt_params_of("fsdp(data)+tp(model)", 2)
    for layer in p["layers"]:
        assert layer["wq"] == layer["wk"] == layer["wv"] == P("data", "model")
        assert layer["wo"] == P("model", None, "data")
        assert layer["w1"] == P("data", "model") and layer["b1"] == P("model")
        assert layer["w2"] == P("model", "data")
        assert layer["ln1"]["scale"] == layer["b2"] == P("data")
    assert p["embed"] == P("model", "data") and p["unembed"] == P("data", "model")
    tp = _gpt_params_of("tp(model)+dp(data)", 2)
    assert tp["layers"][0]["wq"] == P(None, "model") and tp["layers"][0]["ln1"]["scale"] == P()


def test_the_same_dimensions_for_every_layer_of_a_folded_step():
    """Regression: with a deep step's layers folded (egraph/fold.py), each layer's weights are
    aliases of the body's, and were ranked by their own (value, dimension) classes, which no
    equation joins: layer 0 got heads, the others head_dim, and every tensor-parallel family,
    asking two layouts of one folded group, was dropped (a 4-layer GPT step on 4x4x4)."""
    from shardsat.egraph.layout import MeshAxes, SpaceTable
    from shardsat.extract.families import family_layouts
    from shardsat.pins import resolve_ties
    from shardsat.prepare import prepare
    from shardsat.rules.apply import build_tables

    cfg = GPTConfig(layers=4, d_model=32, heads=4, mlp=64, vocab=96, seq=16, batch=8)
    _, step = make_gpt_step(cfg)
    params = gpt_params(cfg, abstract=True)
    args = ((params, jax.eval_shape(optax.adamw(1e-3).init, params)), gpt_batch(cfg, abstract=True))
    mesh = jax.make_mesh(*MESH)
    program = prepare(step, mesh, args, [], fold_loops=True).program
    assert program.aliases
    spaces = SpaceTable(MeshAxes.from_mesh(mesh))
    ties = resolve_ties(program, (0,), program.name)
    layouts = dict(family_layouts(program, spaces, ties, build_tables(program, spaces, "replicate", edges=False)))
    tp = layouts["fsdp(data)+tp(model)"]
    by_body: dict[int, set] = {}
    for pos, vid in enumerate(program.args):
        by_body.setdefault(program.alias(vid), set()).add(tp[pos])
    assert all(len(lays) == 1 for lays in by_body.values())
    assert any(len([v for v in program.args if program.alias(v) == body]) > 1 for body in by_body)


def test_a_dimension_activations_slice_or_contract_is_not_split():
    """Rotary embeddings slice head_dim in halves, and q.k contracts it between activations:
    splitting it would gather or all-reduce activations. The heads stay the choice, although
    head_dim is larger and no other weight shares its class."""
    d, h, k = 32, 4, 16

    def rope(x):
        half = x.shape[-1] // 2
        return jnp.concatenate([x[..., half:], -x[..., :half]], -1)

    def loss(w, x):
        q = rope(jnp.einsum("bsd,dhk->bhsk", x, w["wq"]))
        kk = rope(jnp.einsum("bsd,dhk->bhsk", x, w["wk"]))
        v = jnp.einsum("bsd,dhk->bhsk", x, w["wv"])
        a = jax.nn.softmax(jnp.einsum("bhqk,bhsk->bhqs", q, kk), -1)
        y = x + jnp.einsum("bhqs,bhsk,hkd->bqd", a, v, w["wo"])
        y = y * w["scale"]
        return jnp.mean((y + jnp.tanh(y @ w["w1"]) @ w["w2"]) ** 2)

    def step(w, x):
        g = jax.grad(loss)(w, x)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, w, g)

    w = {"wq": S((d, h, k), jnp.float32), "wk": S((d, h, k), jnp.float32), "wv": S((d, h, k), jnp.float32),
         "wo": S((h, k, d), jnp.float32), "scale": S((d,), jnp.float32), "w1": S((d, 64), jnp.float32),
         "w2": S((64, d), jnp.float32)}
    fams = standard_layouts(step, jax.make_mesh(*MESH), w, S((8, 16, d), jnp.float32), state_argnums=(0,))
    tp = fams["fsdp(data)+tp(model)"][0]
    assert tp["wq"] == tp["wk"] == tp["wv"] == P("data", "model")
    assert tp["wo"] == P("model", None, "data")
    assert tp["w1"] == P("data", "model") and tp["w2"] == P("model", "data") and tp["scale"] == P("data")
