"""Narrowing by a prior (priors=): fewer layouts per value, the same program computed."""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_equivalent
from jax.sharding import PartitionSpec as P

import shardsat
import shardsat.api as api
from shardsat.egraph.layout import Layout, MeshAxes, SpaceTable
from shardsat.egraph.narrow import fewer_axes, narrow_spaces
from shardsat.prepare import prepare


@pytest.fixture(scope="module")
def mesh222():
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"))


def mlp_step():
    """A 3-layer MLP AdamW step: (params, opt_state), batch -> (params, opt_state), loss."""
    opt = optax.adamw(1e-2)

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x * x)

    def step(state, x):
        ws, st = state
        val, g = jax.value_and_grad(loss)(ws, x)
        upd, st = opt.update(g, st, ws)
        return (optax.apply_updates(ws, upd), st), val

    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (64, 64)) * 0.2 for i in range(3)]
    x = jax.random.normal(key, (32, 64))
    return step, (ws, opt.init(ws)), x


@pytest.fixture(scope="module")
def narrowed_step(mesh222):
    """The MLP step's arguments and its plan with priors="families" (planned once for the tests
    that read it)."""
    step, state, x = mlp_step()
    plan = shardsat.saturate_and_extract(step, mesh222, state, x, state_argnums=(0,), priors="families")
    return step, state, x, plan


def test_fewer_axes_is_every_subset_in_mesh_order():
    lay = Layout(((0, 2), (), (1,)), (3,))
    got = fewer_axes(lay)
    assert len(got) == 2 ** 4
    assert Layout(((), (), ()), ()) in got
    assert Layout(((2,), (), ()), (3,)) in got
    assert all(tuple(sorted(d)) == d for g in got for d in g.dims)


def test_narrowed_values_keep_replicated_first_and_tied_values_share(mesh222):
    prog = prepare(lambda a, b: (a + 1.0, b * 2.0), mesh222, (jnp.ones((8, 8)), jnp.ones((8, 8))), (), False).program
    spaces = SpaceTable(MeshAxes.from_mesh(mesh222))
    a, b = prog.args
    out_b = prog.outputs[1]
    f32 = prog.values[a].dtype
    split = spaces.layouts.intern(Layout(((0, 1), ()), ()))
    other = spaces.layouts.intern(Layout(((), (2,)), ()))
    removed = narrow_spaces(prog, spaces, {a: {split}, out_b: {other}}, together=[(b, out_b)])
    whole = spaces.space((8, 8), f32)
    sa, sb, so = (spaces.of_value(v, (8, 8), f32) for v in (a, b, out_b))
    assert sa.layouts[0] == whole.layouts[0] and sa.layouts[0] != split
    assert set(sa.layouts) == {spaces.layouts.intern(x) for x in fewer_axes(spaces.layouts[split])}
    assert sb is so and other in sb.layouts and split not in sb.layouts
    assert removed == 3 * len(whole.layouts) - len(sa.layouts) - 2 * len(sb.layouts)


def test_families_prior_plans_a_training_step_that_computes_the_same(mesh222, narrowed_step):
    step, state, x, plan = narrowed_step
    whole = shardsat.saturate_and_extract(step, mesh222, state, x, state_argnums=(0,), priors=None)
    assert whole.report.narrowed == 0 and plan.report.narrowed > 0
    assert "left out by the prior" in str(plan.report)
    assert plan.report.e_nodes < whole.report.e_nodes
    assert plan.cost.total_s >= whole.report.lower_bound_s * (1 - 1e-9)
    assert_equivalent(plan, step, state, x, rtol=1e-4)
    # the state keeps one layout in and out, as with every layout
    for (a, o) in plan.ties:
        assert plan.costed.assignment.arg_layouts[a] == plan.extraction.root_layouts[o]


def test_auto_leaves_small_programs_whole(mesh222):
    step, state, x = mlp_step()
    plan = shardsat.saturate_and_extract(step, mesh222, state, x, state_argnums=(0,))
    assert plan.report.narrowed == 0


def test_pins_stay_in_the_narrowed_spaces(mesh222):
    def f(w, x):
        return jnp.tanh(x @ w) @ w.T

    w, x = jnp.ones((64, 64)) * 0.01, jnp.ones((32, 64))
    pin = (P(("data", "model"), None), P())  # a layout no family gives w
    plan = shardsat.saturate_and_extract(f, mesh222, w, x, in_shardings=pin, priors="families")
    assert plan.report.narrowed > 0
    assert plan.in_shardings[0].spec == P(("data", "model"))
    assert_equivalent(plan, f, w, x)


@pytest.mark.parametrize("priors", ["families", "builtin"])
def test_a_narrowed_graph_without_a_plan_is_planned_again_whole(mesh222, monkeypatch, priors):
    """Where the prior leaves out what a pin needs (here: a prior that keeps nothing and pins
    it cannot see), the plan comes from every layout instead of an error."""
    def nothing(program, spaces, keep, together=()):
        return narrow_spaces(program, spaces, dict.fromkeys(range(len(program.values)), ()), together)

    monkeypatch.setattr(api, "narrow_spaces", nothing)

    def f(w, x):
        return x @ w

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    plan = shardsat.saturate_and_extract(f, mesh222, w, x, in_shardings=(P(None, "model"), P()),
                                         priors=priors)
    assert plan.report.narrowed == 0  # planned whole
    assert plan.in_shardings[0].spec == P(None, "model")
    assert_equivalent(plan, f, w, x)


def test_a_whole_graph_stopped_at_a_limit_is_planned_again_narrowed(mesh222, monkeypatch):
    """Regression (benchmarks/priors.py): a folded 4-layer GPT step on 2x2x2x2 has 392k (value,
    layout) pairs, under the threshold then (400k), so priors="auto" planned it whole, and
    saturation stopped at the node limit (6.9 M e-nodes) with no plan: NoPlanError. Now a whole
    e-graph that stops at a limit without a plan is planned again narrowed (here the first
    attempt is made to stop so)."""
    real, tried = api._plan_in, []

    def stopped(req, *args, **kwargs):
        tried.append(req.priors)
        if req.priors != "families":
            raise shardsat.errors.StoppedEarlyError("stopped early at the node limit")
        return real(req, *args, **kwargs)

    monkeypatch.setattr(api, "_plan_in", stopped)
    step, state, x = mlp_step()
    plan = shardsat.saturate_and_extract(step, mesh222, state, x, state_argnums=(0,))
    assert tried == ["auto", "families"]
    assert plan.report.narrowed > 0
    assert_equivalent(plan, step, state, x)
    with pytest.raises(shardsat.errors.StoppedEarlyError):  # priors=None: the user asked for every layout
        shardsat.saturate_and_extract(step, mesh222, state, x, state_argnums=(0,), priors=None)
    assert tried[2:] == [None]


def test_priors_must_be_known(mesh222):
    with pytest.raises(shardsat.InvalidArgumentError, match="priors"):
        shardsat.saturate_and_extract(lambda x: x * 2, mesh222, jnp.ones(8), priors="learned")


def test_a_narrowed_plan_saves_and_loads(mesh222, narrowed_step, tmp_path):
    """A saved plan names strategies as the whole spaces' tables do: loading rebuilds those."""
    step, state, x, plan = narrowed_step
    assert plan.report.narrowed > 0
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = shardsat.load_plan(path, step, mesh222, state, x)
    assert loaded.report.loaded_from is not None
    assert loaded.cost.total_s == pytest.approx(plan.cost.total_s)
    assert [s.spec for s in jax.tree.leaves(loaded.in_shardings)] == [s.spec for s in jax.tree.leaves(plan.in_shardings)]
    assert_equivalent(loaded, step, state, x, rtol=1e-4)


def test_auto_narrows_mid_sized_programs_on_four_axes_by_the_learned_prior(mesh222):
    """On meshes of four or more axes a value has hundreds of layouts and the e-graph grows with
    their square: priors="auto" narrows a program of more than NARROW_PAIRS_MANY_AXES pairs
    there (dot_product_attention on 2x2x2x2 planned whole in 15.5 s, narrowed by the learned
    prior in 10.9 s, the same plan) by the learned prior, which kept the whole plan where the
    families lost 2.3x; on three axes the same program is planned whole."""
    from types import SimpleNamespace

    from shardsat.extract import policy

    q = jax.ShapeDtypeStruct((16, 8, 4, 8), jnp.float32)
    prog = prepare(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), mesh222,
                   (q, q, q), (), None).program
    four = SpaceTable(MeshAxes(("a", "b", "c", "d"), (2, 2, 2, 2)))
    three = SpaceTable(MeshAxes(("a", "b", "c"), (2, 2, 2)))
    pairs = sum(len(four.space(v.shape, v.dtype).layouts) for v in prog.values)
    assert policy.NARROW_PAIRS_MANY_AXES < pairs <= policy.NARROW_PAIRS
    auto = SimpleNamespace(priors="auto")
    assert api._prior_kind(auto, prog, four, []) == "builtin"
    assert api._prior_kind(auto, prog, three, []) is None
    assert api._prior_kind(SimpleNamespace(priors=None), prog, four, []) is None
    assert api._prior_kind(SimpleNamespace(priors="families"), prog, three, []) == "families"
