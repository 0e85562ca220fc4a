"""Regression tests for programs that crashed the planner (issue 12): each was a program jax.jit
runs; each must get a plan that computes what the unsharded program does."""

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_equivalent
from jax import lax
from jax.sharding import PartitionSpec as P

import shardsat
from shardsat.testing import check_plan


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def strict_plan(fn, mesh, *args, **kw):
    return shardsat.saturate_and_extract(fn, mesh, *args, strict=True, **kw)


def cross_entropy(logits, labels):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1)[..., 0])


@pytest.mark.parametrize("name,fn,args", [
    ("index a size-1 dim", lambda x, i: x[:, i], (jnp.arange(8.0).reshape(8, 1), jnp.zeros(4, jnp.int32))),
    ("one-row table", lambda t, i: t[i], (jnp.arange(16.0).reshape(1, 16), jnp.zeros(8, jnp.int32))),
    ("trailing size-1 under grad", jax.value_and_grad(cross_entropy),
     (jnp.linspace(-1, 1, 8 * 16).reshape(8, 16), jnp.arange(8, dtype=jnp.int32))),
    ("one-hot of one class", lambda y: jax.nn.one_hot(y, 1) * 2.0, (jnp.zeros(8, jnp.int32),)),
])
def test_gather_over_size_one_dims(mesh, name, fn, args):
    plan = strict_plan(fn, mesh, *args)
    assert_equivalent(plan, fn, *args)


def test_scan_whose_per_step_outputs_are_dropped(mesh):
    def f(h0, xs):
        def body(c, x):
            c = jnp.tanh(c + x)
            return c, jnp.mean(c, -1)

        h, _ = lax.scan(body, h0, xs)
        return h

    args = (jnp.ones((8, 16)), jnp.linspace(0, 1, 5 * 8 * 16).reshape(5, 8, 16))
    assert_equivalent(strict_plan(f, mesh, *args), f, *args)


@pytest.mark.parametrize("fn,x", [
    (lambda x: x.reshape(0, 4, 2), jnp.ones((0, 8))),
    (lambda x: jnp.pad(x, ((0, 0), (2, 2)), mode="edge"), jnp.ones((0, 16))),
    (lambda x: jnp.pad(x, ((1, 1), (2, 3)), mode="edge").sum(0), jnp.ones((8, 16))),
    (lambda x: (jnp.tanh(x @ jnp.ones((16, 8)))).sum(0), jnp.ones((0, 16))),
])
def test_zero_size_arrays_plan_without_fallback(mesh, fn, x):
    plan = strict_plan(fn, mesh, x)
    assert not plan.report.fallbacks
    assert_equivalent(plan, fn, x)


def test_empty_pieces_do_not_gather_a_concatenation(mesh):
    """lax.associative_scan's last level concatenates an empty piece to a level. An equation
    touching an array with no elements was replicated with all its operands, so a batch-split
    scan all-gathered its levels (a linear recurrence in a training step on 2x4: four
    all-gathers, 1.8x a data-parallel jax.jit's compiled step)."""
    def scan(x):
        return lax.associative_scan(lambda a, b: a + b, jnp.tanh(x), axis=1) * 2

    def pieces(x):
        y = jnp.tanh(x)
        empty = jnp.zeros((16, 0, 32))
        return jnp.concatenate([empty, y[:, 3:5], empty], axis=1) * 2, jnp.concatenate([empty, empty], axis=1)

    x = jnp.linspace(-1, 1, 16 * 64 * 32).reshape(16, 64, 32)
    for fn in (scan, pieces):
        plan = strict_plan(fn, mesh, x, in_shardings=(P(("data", "model")),))
        assert not plan.cost.collectives, plan.cost.collectives
        assert sum(plan.hlo_collectives(x).values()) == 0
        assert_equivalent(plan, fn, x)


def test_a_callback_on_an_empty_array_still_runs(mesh):
    """A callback reading an array with no elements still runs."""
    seen = []

    def f(x):
        jax.debug.callback(lambda e: seen.append(e.shape), x[:0] * 2)
        return x * 2

    x = jnp.ones((8, 16))
    plan = strict_plan(f, mesh, x)
    jax.block_until_ready(plan.jit()(x))
    assert (0, 16) in seen
    assert_equivalent(plan, f, x)


@pytest.mark.parametrize("fn", [lambda x: None, lambda x: {}, lambda x: 3.0, lambda x: (x, 2, None)])
def test_functions_returning_no_arrays(mesh, fn):
    x = jnp.ones((8, 16))
    for extraction in ("auto", "greedy", "exact"):
        plan = strict_plan(fn, mesh, x, extraction=extraction)
        got = plan.jit()(x)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(fn(x))


def test_with_sharding_constraint_with_a_bare_partition_spec(mesh):
    def f(x):
        return lax.with_sharding_constraint(x * 2 + 1, P("data"))

    plan = strict_plan(f, mesh, jnp.ones((8, 16)))
    pinned = next(e for e in plan.program.equations if e.name == "sharding_constraint")
    assert plan.layout_of(pinned.outputs[0]).spec(plan.axes) == P("data")
    out = plan.jit()(jnp.ones((8, 16)))
    assert float(out.sum()) == 8 * 16 * 3
    # check_plan's unsharded run needs the mesh in context as much as the tracing did (it
    # raised jax's "requires a non-empty mesh in context")
    check_plan(plan, jnp.arange(128.0).reshape(8, 16))


def test_equations_traced_inside_jax_name_the_users_line(mesh):
    """jnp.pad(mode="edge") builds its equations inside jax's own functions: their source is
    the user's call, not an empty location."""
    def f(x):
        return jnp.pad(x, ((1, 1), (2, 2)), mode="edge")

    plan = strict_plan(f, mesh, jnp.ones((8, 16)))
    sources = {e.source for e in plan.program.equations}
    assert all("test_robustness.py" in s for s in sources), sources


def test_exact_extraction_of_a_small_program_takes_seconds():
    """The integer program of a small conv + batch-norm program on 2x2x2 never proves its
    optimum: it used every remaining second of Limits.seconds (~120 s). It now gets
    Limits.exact_seconds, and the report says how it ended."""
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))

    def f(x, w, g, b):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = (y - y.mean((0, 1, 2))) / jnp.sqrt(y.var((0, 1, 2)) + 1e-5) * g + b
        return jax.nn.relu(y).mean()

    args = (jnp.ones((8, 8, 8, 4)), jnp.ones((3, 3, 4, 8)), jnp.ones(8), jnp.ones(8))
    t0 = time.perf_counter()
    plan = strict_plan(f, mesh, *args, extraction="exact", memory_limit=40_000,
                       limits=shardsat.Limits(exact_seconds=0.5))
    assert time.perf_counter() - t0 < 60  # not a benchmark: only that the 120 s are not spent
    assert plan.report.exact_status is not None and "exact ILP" in str(plan.report)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no memory warning: the explicit limit is met
        assert_equivalent(plan, f, *args)


def test_planned_under_a_mesh_of_explicit_axes():
    """Planned inside `jax.set_mesh` of Explicit axes (their shardings went into the traced
    equations' params; the runtime's Auto mesh rejected them), run there on committed arrays."""
    from jax.sharding import AxisType, NamedSharding

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

    def f(x, ids):
        masked = jnp.where((ids > 0)[:, None], x, 0.0)
        return masked.sum(0), jnp.broadcast_to(masked.max(1), (5, 8)) * 2.0

    x = jax.device_put(jnp.linspace(-1, 1, 8 * 16).reshape(8, 16), NamedSharding(mesh, P("data")))
    ids = jax.device_put(jnp.arange(8, dtype=jnp.int32) % 3, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        plan = strict_plan(f, mesh, x, ids)
        got = plan.jit()(x, ids)
        want = jax.jit(f)(x, ids)
    for g, w in zip(got, want, strict=True):
        assert jnp.allclose(g, w)


def test_explicit_sharding_annotations_under_a_mesh_of_explicit_axes():
    """A function written for Explicit axes (einsum's out_sharding=, reshard) and its gradient,
    planned and run inside `jax.set_mesh`: its traced equations carry sharding types on the
    Explicit mesh (broadcast_in_dim's `sharding` in the gradient), which the plan's Auto mesh
    refused at run time ("context mesh ... should match the aval mesh")."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def f(x, w):
        h = jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model"))
        return jnp.sum(jax.sharding.reshard(jnp.tanh(h), P("data", None)), axis=1)

    def g(x, w):
        return jax.grad(lambda w: jnp.sum(f(x, w) ** 2))(w)

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(256.0).reshape(16, 16) / 256, P("data", None))
        w = jax.device_put(jnp.ones((16, 32)) / 16, P(None, "model"))
        for fn in (f, g):
            plan = shardsat.saturate_and_extract(fn, mesh, x, w)
            assert np.allclose(np.asarray(plan.jit()(x, w)), np.asarray(jax.jit(fn)(x, w)), rtol=1e-5)
            check_plan(plan, x, w)


def test_python_scalar_arguments_stay_weakly_typed(mesh):
    """A Python float is weakly typed under jax.jit: bf16 * 0.5 stays bf16. Planned as a strong
    float32 it promoted the program to float32, and plan.jit() refused the same call."""
    def f(x, s):
        return x * s + 1

    x = jnp.linspace(-1, 1, 8 * 16, dtype=jnp.bfloat16).reshape(8, 16)
    plan = strict_plan(f, mesh, x, 0.5)
    got = plan.jit()(x, 0.5)
    assert got.dtype == jnp.bfloat16
    assert jnp.array_equal(got, jax.jit(f)(x, 0.5))


def test_state_ties_when_a_params_tree_looks_like_adams_moments(mesh):
    """The step returns {"opt_state": ..., "params": ...}: Adam's first moment has the params
    tree's structure and types and comes first, so tying the params to the first match left the
    optimizer state with nothing to tie to (InvalidArgumentError)."""
    import optax

    tx = optax.adam(1e-2)

    def step(p, s, x):
        g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(p)
        u, s = tx.update(g, s, p)
        return {"opt_state": s, "params": optax.apply_updates(p, u), "loss": jnp.float32(0)}

    p = {"w": jnp.linspace(-1, 1, 16 * 32).reshape(16, 32)}
    s, x = tx.init(p), jnp.ones((8, 16))
    plan = strict_plan(step, mesh, p, s, x, state_argnums=(0, 1))
    n = len(jax.tree_util.tree_leaves(p)) + len(jax.tree_util.tree_leaves(s))
    assert len(plan.ties) == n
    out_paths = [plan.program.out_paths[k] for _, k in plan.ties]
    assert any("params" in q for q in out_paths) and any("opt_state" in q for q in out_paths)
    assert_equivalent(plan, step, p, s, x)


def test_zero_size_values_stay_replicated():
    """A zero-size result split by the plan came back from XLA as whole shards that could not be
    read (np.asarray: could not broadcast (0,4) into (0,1)); pins on such values are vacuous."""
    mesh = jax.make_mesh((4, 2), ("x", "y"))

    def f(y, w):
        return y @ w

    y, w = jnp.ones((0, 8)), jnp.ones((8, 4))
    for pins in ({}, {"out_shardings": P(None, "x"), "in_shardings": (P(None, "x"), None)}):
        plan = strict_plan(f, mesh, y, w, **pins)
        out = plan.jit()(y, w)
        assert np_shape(out) == (0, 4)


def np_shape(x):
    import numpy as np

    return np.asarray(x).shape


def test_scan_over_an_input_its_body_never_reads(mesh):
    """A scanned input whose slice the body ignores (an unused per-layer parameter) was looked up
    for its layout though nothing computes it (KeyError in runtime/lower.py; fuzz seed 150)."""
    def f(h0, ws, unused):
        def body(h, xs):
            w, _ = xs
            return jnp.tanh(h @ w), None
        return lax.scan(body, h0, (ws, unused))[0]

    args = (jnp.ones((8, 16)), jnp.linspace(-0.1, 0.1, 3 * 16 * 16).reshape(3, 16, 16), jnp.ones((3, 5)))
    assert_equivalent(strict_plan(f, mesh, *args), f, *args)


def test_exact_extraction_is_skipped_on_huge_e_graphs(monkeypatch, mesh):
    """Beyond EXACT_MAX_NODES the integer program is not built (a 900k-node 2x2x2 step spent
    minutes building and solving it, past the 60 s of the fuzz campaign); the report says so."""
    from shardsat.extract import policy

    monkeypatch.setattr(policy, "EXACT_MAX_NODES", 100)
    f = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
    args = (jnp.ones((16, 32)), jnp.ones((32, 64)) * 0.1)
    plan = strict_plan(f, mesh, *args, extraction="exact")
    assert plan.report.exact_status.startswith("not run") and "exact ILP: not run" in str(plan.report)
    assert_equivalent(plan, f, *args)


def test_embedding_gradient_on_shards_drops_the_global_result_sharding():
    """The gradient of `jnp.take` makes its zeros with a `broadcast_in_dim` whose `sharding`
    parameter names the traced (Auto) mesh; run inside shard_map (the table FSDP-split, the
    gradient a pending sum) it raised "context mesh ... Manual ... should match the aval mesh ...
    Auto". Found by the memory benchmark (tied embedding, FSDP pins, 2x4)."""
    def loss(p, tokens):
        x = jnp.take(p["embed"], tokens, axis=0)
        x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
        x = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        lp = jax.nn.log_softmax(jnp.einsum("bsd,vd->bsv", x, p["embed"]), -1)
        return -(lp * jax.nn.one_hot(tokens, 64)).sum(-1).mean()

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    fn = jax.grad(loss)
    k = jax.random.split(jax.random.key(0), 4)
    params = {"embed": jax.random.normal(k[0], (64, 16)), "w1": jax.random.normal(k[1], (16, 32)) * 0.2,
              "w2": jax.random.normal(k[2], (32, 16)) * 0.2}
    tokens = jax.random.randint(k[3], (8, 4), 0, 64)
    every = ("data", "model")
    pins = ({"embed": P(every, None), "w1": P(None, every), "w2": P(every, None)}, P(every))
    plan = shardsat.saturate_and_extract(fn, mesh, params, tokens, in_shardings=pins)
    assert_equivalent(plan, fn, params, tokens)


def test_equations_run_on_shards_lose_their_global_result_sharding():
    """The unit behind the test above: at the memory benchmark's size (tied embedding V32768 d512,
    FSDP pins on 2x4) the plan runs that `broadcast_in_dim` inside shard_map, where a sharding
    over the Auto mesh is refused; smaller sizes choose other plans."""
    from jax.sharding import NamedSharding

    from shardsat.runtime.local import local_params

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params = {"shape": (64, 16), "broadcast_dimensions": (), "sharding": NamedSharding(mesh, P())}
    got = local_params("broadcast_in_dim", params, [((), ())], [((64, 16), (8, 16))])
    assert got["sharding"] is None and got["shape"] == (8, 16)
    assert local_params("dot_general", {"out_sharding": NamedSharding(mesh, P())}, [], [])["out_sharding"] is None


def test_check_plan_with_arguments_placed_on_an_explicit_mesh(mesh):
    """check_plan's reference runs under the arguments' Explicit mesh where it needs a mesh and they
    carry one: jax requires the context mesh to match the mesh in their types (it raised "context
    mesh ... should match the aval mesh" under the plan's Auto mesh)."""
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

    def f(x, y):  # the bare spec makes the reference need a mesh, and it must be the Explicit one
        return jnp.sum(lax.with_sharding_constraint(x * 2, P("data")), axis=(0, 1), keepdims=True) + y

    x = jax.device_put(jnp.arange(128.0).reshape(8, 16), jax.sharding.NamedSharding(explicit, P("data")))
    y = jnp.ones((1, 16))
    plan = strict_plan(f, explicit, x, y)
    check_plan(plan, x, y)


def test_weakly_typed_call_of_a_plan_with_a_bare_partition_spec(mesh):
    """A Python scalar where the plan took an array: the weak-type check traces the function
    again, under the plan's mesh as the plan was traced (it raised "with_sharding_constraint
    requires a non-empty mesh in context")."""
    def f(x, s):
        return lax.with_sharding_constraint(x * s, P("data"))

    x = jnp.arange(128.0).reshape(8, 16)
    plan = strict_plan(f, mesh, x, jnp.float32(2.0))
    assert float(plan.jit()(x, 2.0).sum()) == float((x * 2).sum())
    check_plan(plan, x, jnp.float32(3.0))


def test_a_users_shard_map_runs_replicated_and_says_so():
    """A shard_map in the user's function stays as the user wrote it (replicated around it, with
    the fallback named); the runtime binds it as jax's evaluator does (its body is a bind argument,
    not the jaxpr param: it raised KeyError 'subfuns')."""
    auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def f(x, w):
        g = jax.shard_map(lambda a: lax.psum(a, "data"), mesh=auto, in_specs=P("data"), out_specs=P())
        return g(jnp.tanh(x @ w)) * 2

    args = (jnp.arange(128.0).reshape(8, 16) / 100, jnp.ones((16, 16)))
    with pytest.warns(UserWarning, match="shard_map"):
        plan = shardsat.saturate_and_extract(f, auto, *args)
    assert any(f.startswith("shard_map") for f in plan.report.fallbacks)
    check_plan(plan, *args)


def test_a_shard_map_over_another_mesh_than_the_plans_is_planned():
    """A shard_map over a mesh of other axes than the plan's: jax.jit runs it, and tracing under
    the plan's mesh raised jax's "context mesh ... should match the mesh passed to shard_map".
    The function is traced as jax.jit traces it, and a Python scalar's weak type is checked the
    same way."""
    auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    flat = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def f(x, s):
        return jax.shard_map(lambda a: a * 2, mesh=flat, in_specs=P("x"), out_specs=P("x"))(x) + s

    x = jnp.arange(64.0).reshape(16, 4)
    with pytest.warns(UserWarning, match="shard_map"):
        plan = shardsat.saturate_and_extract(f, auto, x, jnp.float32(1.0))
    check_plan(plan, x, jnp.float32(3.0))
    assert float(plan.jit()(x, 2.0).sum()) == float((x * 2 + 2).sum())


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_a_mesh_of_one_device(shape):
    """A mesh whose axes all have size 1 (a user's single-device debug run) gets the replicated
    plan. Where no argument is a batch (here, elementwise only), the tensor-parallel family's
    axis was a max over no axes (ValueError)."""
    axes = ("data", "model")[: len(shape)]
    one = jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=jax.devices()[:1])
    for f in (lambda x, w: (x * 2, w), lambda x, w: (jnp.tanh(x @ w).sum(0), x * 2)):
        args = (jnp.arange(64.0).reshape(8, 8) / 64, jnp.ones((8, 8)))
        plan = shardsat.saturate_and_extract(f, one, *args)
        check_plan(plan, *args)


def test_approx_max_k_random_gamma_composite_and_platform_dependent_need_no_fallback(mesh):
    """lax.approx_max_k is planned as top_k and jax.random.gamma as the other key consumers,
    lax.composite's body is inlined, lax.platform_dependent's index replicated by rule and
    igamma's gradient elementwise: no fallback warning for any (all were fallbacks)."""

    def f(x, key):
        y = lax.composite(lambda a: jnp.tanh(a) * 2, name="my.tanh2")(x)
        z = lax.platform_dependent(x, cpu=lambda a: a * 2, default=lambda a: a * 3)
        da = jax.grad(lambda a: jnp.sum(lax.igamma(a, jnp.abs(x) + 0.5)))(jnp.abs(x) + 1.0)  # igamma_grad_a
        return lax.approx_max_k(x, 4), jax.random.gamma(key, jnp.abs(x) + 0.5), y, z, da

    args = (jnp.arange(128.0).reshape(8, 16) / 7, jax.random.PRNGKey(1))
    plan = strict_plan(f, mesh, *args)
    assert plan.report.fallbacks == []
    check_plan(plan, *args)


def _constrained(sharding):
    def f(x):
        return jax.lax.with_sharding_constraint(jnp.sin(x) * 2, sharding) + 1
    return f


def test_constraint_on_other_devices_is_dropped_and_said(mesh):
    """A with_sharding_constraint over a mesh of 4 of the 8 devices: jax.jit runs the function
    (on those devices); no plan on the 8 can keep it, so the plan drops it, warns and says so
    (it used to refuse the function: "mesh has no axis 'y'")."""
    from jax.sharding import Mesh, NamedSharding
    f = _constrained(NamedSharding(Mesh(np.array(jax.devices()[:4]), ("y",)), P("y")))
    x = jnp.arange(64.0).reshape(8, 8)
    jax.jit(f)(x)
    with pytest.warns(shardsat.ConstraintWarning, match="test_robustness.py"):
        plan = shardsat.saturate_and_extract(f, mesh, x)
    assert len(plan.report.unkept) == 1 and "devices [0, 1, 2, 3]" in plan.report.unkept[0]
    assert "Sharding constraints and pins not kept" in plan.explain()
    assert_equivalent(plan, f, x)


def test_constraint_on_the_same_devices_otherwise_named_is_kept(mesh):
    """The plan's 8 devices as one axis "y": P("y") puts the shards where P(("data", "model"))
    does, so the plan keeps it as that layout, without a warning."""
    from jax.sharding import Mesh, NamedSharding
    ids = np.vectorize(lambda d: d.id)(mesh.devices).ravel()
    f = _constrained(NamedSharding(Mesh(np.array([jax.devices()[i] for i in ids]), ("y",)), P("y")))
    x = jnp.arange(64.0).reshape(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardsat.ConstraintWarning)
        plan = shardsat.saturate_and_extract(f, mesh, x)
    assert plan.report.unkept == []
    sin = next(e for e in plan.program.equations if e.name == "sharding_constraint")
    assert plan.layout_of(sin.outputs[0]).spec(plan.axes) == P(("data", "model"))
    assert_equivalent(plan, f, x)


def test_constraint_on_the_same_devices_in_no_layout_of_the_mesh_is_dropped(mesh):
    """The plan's devices in reverse order, split over "data": no layout of the plan's mesh puts
    the first rows on the last devices, so the constraint is dropped and said."""
    from jax.sharding import Mesh, NamedSharding
    f = _constrained(NamedSharding(Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model")), P("data")))
    x = jnp.arange(64.0).reshape(8, 8)
    with pytest.warns(shardsat.ConstraintWarning):
        plan = shardsat.saturate_and_extract(f, mesh, x)
    assert plan.report.unkept
    assert_equivalent(plan, f, x)


def test_pins_after_a_none_argument_or_output_land_on_their_own_value(mesh):
    """A None argument, output or dict entry has no leaves. Broadcasting pins counted one for
    it, so every later pin landed on the value after its own (silently), or past the end
    (IndexError)."""
    def g(n, a, x, y):
        return None, x @ a + y, x * 2

    args = (None, jnp.ones((16, 8)), jnp.arange(64.0).reshape(4, 16), jnp.ones((4, 8)))
    plan = shardsat.saturate_and_extract(g, mesh, *args, in_shardings=(None, P(None, "model"), None, None),
                                         out_shardings=(None, P(None, "model"), None))
    assert plan.in_shardings[1].spec == P(None, "model")
    assert plan.jit()(*args)[1].sharding.spec == P(None, "model")
    assert_equivalent(plan, g, *args)
    last = shardsat.saturate_and_extract(g, mesh, *args, in_shardings=(None, None, None, P("data")),
                                         out_shardings=(None, None, P("data")))
    assert last.in_shardings[3].spec == P("data")
    assert last.jit()(*args)[2].sharding.spec == P("data")

    def step(p, batch):
        return jax.grad(lambda p: jnp.mean(jnp.tanh(batch["x"] @ p["w"]) ** 2 + batch["y"].sum()))(p)

    params, batch = {"w": jnp.ones((32, 64))}, {"x": jnp.ones((16, 32)), "mask": None, "y": jnp.ones((16, 16))}
    plan = shardsat.saturate_and_extract(step, mesh, params, batch,
                                         in_shardings=(None, {"x": P("data"), "mask": None, "y": None}))
    assert plan.in_shardings[1]["x"].spec == P("data")
    assert_equivalent(plan, step, params, batch)


def test_pins_and_constraints_that_split_prng_keys_leave_them_whole(mesh):
    """Plans keep PRNG key arrays replicated. A pin or a with_sharding_constraint that splits
    one (jax.jit runs both) made every layout of the keys disallowed: NoPlanError. Now the
    keys stay whole and the plan says so (ConstraintWarning; in_shardings shows P())."""
    from jax.sharding import NamedSharding
    keys, x = jax.random.split(jax.random.key(0), 8), jnp.ones((8, 4))

    def f(ks, x):
        return jax.vmap(lambda k: jax.random.normal(k, (4,)))(ks) + x

    want = jax.jit(f)(keys, x)
    with pytest.warns(shardsat.ConstraintWarning, match="PRNG key"):
        plan = shardsat.saturate_and_extract(f, mesh, keys, x, in_shardings=(P("data"), P("data")))
    assert plan.in_shardings[0].spec == P()
    # the report lists the dropped pin, as it lists dropped constraints (it listed nothing)
    assert [u for u in plan.report.unkept if "PRNG key" in u and u.startswith("args[0]")], plan.report.unkept
    assert "args[0]" in plan.explain()
    np.testing.assert_array_equal(plan.jit()(jax.device_put(keys, NamedSharding(mesh, P("data"))), x), want)
    split = jax.jit(lambda ks: jax.vmap(lambda k: jax.random.split(k)[0])(ks))
    with pytest.warns(shardsat.ConstraintWarning, match="PRNG key"):
        plan = shardsat.saturate_and_extract(lambda ks: jax.vmap(lambda k: jax.random.split(k)[0])(ks), mesh, keys,
                                             out_shardings=P("data"))
    assert jax.random.key_data(plan.jit()(keys)).tolist() == jax.random.key_data(split(keys)).tolist()
    auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def g(ks, x):
        return f(jax.lax.with_sharding_constraint(ks, NamedSharding(auto, P("data"))), x)

    with pytest.warns(shardsat.ConstraintWarning, match="PRNG key"):
        plan = shardsat.saturate_and_extract(g, auto, keys, x)
    assert any("PRNG key" in u for u in plan.report.unkept)
    np.testing.assert_array_equal(plan.jit()(keys, x), jax.jit(g)(keys, x))


def test_device_put_of_values_of_other_shapes_has_a_rule(mesh):
    """jax.device_put of a tuple (jax.scipy.sparse.linalg.cg puts its state so): one identity
    per value. Values of other shapes fell back to replicated with an internal rule error."""
    import jax.scipy.sparse.linalg as spl

    def f(x, y):
        a, b = jax.device_put((x * 2, y + 1))
        return a.sum(0), b

    def cg(a, b):
        return jax.vmap(lambda r: spl.cg(lambda v: a @ v, r, tol=1e-6)[0])(b)

    for fn, args in ((f, (jnp.ones((8, 8)), jnp.ones((16, 4)))), (cg, (jnp.eye(16) * 2.0, jnp.ones((8, 16))))):
        with warnings.catch_warnings():
            warnings.simplefilter("error", shardsat.FallbackWarning)
            plan = shardsat.saturate_and_extract(fn, mesh, *args)
        assert not plan.report.fallbacks
        assert_equivalent(plan, fn, *args, rtol=1e-5)


def test_unusable_cache_dir_priors_file_and_jitted_static_arguments_are_named(mesh, tmp_path):
    """Errors in shardsat's family, naming the option, before planning: a cache_dir that cannot
    be made (was a raw FileNotFoundError after the search), a priors file that is not there,
    and a jax.jit function whose static argument is among the example arguments (was jax's
    ValueError about a non-hashable tracer)."""
    f = lambda a, x: jnp.tanh(x @ a)  # noqa: E731
    args = (jnp.ones((16, 8)), jnp.ones((4, 16)))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(shardsat.InvalidArgumentError, match=r"cache_dir .* cannot hold saved plans"):
        shardsat.saturate_and_extract(f, mesh, *args, cache_dir=blocker / "plans")
    with pytest.raises(shardsat.InvalidArgumentError, match="no such file"):
        shardsat.saturate_and_extract(f, mesh, *args, priors=str(tmp_path / "missing.npz"))
    jitted = jax.jit(lambda w, x, n: jnp.tanh(x @ w) * n, static_argnums=2)
    with pytest.raises(shardsat.InvalidArgumentError, match=r"functools\.partial"):
        shardsat.saturate_and_extract(jitted, mesh, jnp.ones((16, 8)), jnp.ones((8, 16)), 3)


def test_state_the_program_never_reads_is_passed_as_it_is_returned(mesh):
    """state_argnums on an argument the function does not read, its output made from others:
    the pressure search followed the input's production and raised KeyError; the plan then
    passed the state replicated while returning it split."""
    s, x = jnp.arange(8.0), jnp.ones(8)
    for fn in (lambda s, x: x * 2, lambda s, x: (jnp.arange(8.0), x.sum())):
        for extraction in ("auto", "greedy"):
            plan = shardsat.saturate_and_extract(fn, mesh, s, x, state_argnums=(0,), extraction=extraction)
            (a, o), = plan.ties
            assert plan.costed.assignment.arg_layouts[a] == plan.extraction.root_layouts[o]
            assert_equivalent(plan, fn, s, x)


def test_planned_function_takes_arguments_by_name_as_jax_jit_does(mesh):
    def f(w, x):
        return jnp.tanh(x @ w).sum(0)

    w, x = jnp.ones((16, 8)), jnp.arange(128.0).reshape(8, 16) / 100
    run = shardsat.saturate_and_extract(f, mesh, w, x).jit()
    want = jax.jit(f)(w, x)
    for got in (run(w=w, x=x), run(w, x=x), run.lower(w=w, x=x).compile()(w, x)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(shardsat.InvalidArgumentError, match="positionally"):
        run(w, y=x)


def test_pins_in_host_memory_are_listed_as_not_kept(mesh):
    """Regression (a helper's API hunt): a pin or a struct with memory_kind="pinned_host" was
    dropped silently; the plan runs in device memory. The plan now warns and lists it."""
    from jax.sharding import NamedSharding

    host = NamedSharding(mesh, P("data"), memory_kind="pinned_host")
    x = jnp.ones((16, 32))
    with pytest.warns(shardsat.ConstraintWarning, match="memory_kind='pinned_host'"):
        plan = shardsat.saturate_and_extract(lambda x: x * 2, mesh, x, in_shardings=(host,), out_shardings=host)
    assert sorted(u.split(":")[0] for u in plan.report.unkept) == ["args[0]", "out"], plan.report.unkept
    assert plan.in_shardings[0].spec == P("data") and plan.in_shardings[0].memory_kind == "device"
    np.testing.assert_array_equal(plan.jit()(x), x * 2)
    struct = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host)
    with pytest.warns(shardsat.ConstraintWarning, match="memory_kind"):
        plan = shardsat.saturate_and_extract(lambda x: x * 2, mesh, struct)
    assert [u.split(":")[0] for u in plan.report.unkept] == ["args[0]"]
