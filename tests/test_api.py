"""The public API: pytrees, meshes, pins, limits, errors, report and explain."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_equivalent, assert_hlo_matches
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardsat

ROOT = Path(__file__).resolve().parents[1]


def mesh24(kind=AxisType.Explicit):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_import_leaves_the_environment_alone():
    """Importing shardsat sizes egglog's thread pool without setting RAYON_NUM_THREADS for the user,
    and keeps a value the user set."""
    script = "import os, shardsat; print('RAYON=' + repr(os.environ.get('RAYON_NUM_THREADS')))"
    env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    for value, expected in ((None, "None"), ("3", "'3'")):
        if value is not None:
            env["RAYON_NUM_THREADS"] = value
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"RAYON={expected}" in out.stdout.splitlines()


# examples/multihost.py starts two processes that each plan a GPT step (about a minute here);
# tests/test_multihost.py runs its launcher, worker and comparison with a smaller model instead
NOT_RUN_HERE = {"multihost.py"}


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name not in NOT_RUN_HERE))
def test_examples_run(name, capsys):
    """One test per example, so that the workers share them."""
    runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    if name == "mlp.py":
        assert "Predicted step time" in capsys.readouterr().out


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_pytrees_literals_constants_unused(kind):
    const = jnp.arange(4.0)

    def f(params, batch, scale):
        h = batch["x"] @ params["w"] + const
        return {"y": jnp.tanh(h) * scale, "n": 3.0, "same": batch["x"], "sum": h.sum()}

    k = jax.random.key(1)
    params = {"w": jax.random.normal(k, (4, 4)), "unused": jnp.ones((3,))}
    batch = {"x": jax.random.normal(k, (16, 4))}
    plan = shardsat.saturate_and_extract(f, mesh24(kind), params, batch, 2.0)
    assert_equivalent(plan, f, params, batch, 2.0)
    assert_hlo_matches(plan, params, batch, 2.0)
    assert set(plan.in_shardings[0]) == {"w", "unused"}
    assert isinstance(plan.in_shardings[0]["w"], NamedSharding)
    assert set(plan.out_shardings) == {"y", "n", "same", "sum"}


def test_arrays_committed_to_explicit_mesh_run():
    mesh = mesh24(AxisType.Explicit)
    w = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data", None)))
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(None, "model")))

    def f(w, x):
        return jnp.sin(x @ w)

    plan = shardsat.saturate_and_extract(f, mesh, w, x)
    np.testing.assert_allclose(plan.jit()(w, x), f(jnp.ones((8, 8)), jnp.ones((16, 8))), rtol=1e-6)


def test_plan_shardings_are_on_the_users_mesh():
    """Regression: plan.in_shardings / out_shardings were on the plan's Auto copy of an Explicit
    mesh, so an array placed with them (as examples/multihost.py places state) failed in the
    user's own jax.jit under jax.set_mesh (context mesh Explicit, aval mesh Auto)."""
    mesh = mesh24(AxisType.Explicit)

    def f(x, w):
        return jnp.tanh(x @ w)

    x, w = jnp.ones((16, 32)), jnp.ones((32, 32)) / 32
    plan = shardsat.saturate_and_extract(f, mesh, x, w)
    assert all(s.mesh == mesh for s in jax.tree.leaves((plan.in_shardings, plan.out_shardings)))
    placed = [jax.device_put(a, s) for a, s in zip((x, w), plan.in_shardings, strict=True)]
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(jax.jit(f)(*placed), f(x, w), rtol=1e-6)
    np.testing.assert_allclose(plan.jit()(*placed), f(x, w), rtol=1e-6)


def _unknown_primitive():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("test_unknown_op")

    def impl(x):
        return jnp.tanh(x) * 2.0

    prim.def_impl(impl)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
    return prim


def test_warnings_point_at_the_callers_line():
    """Each warning names the user's line, from saturate_and_extract and from load_plan alike,
    however deep in shardsat it is raised (fixed stacklevels broke when a call gained a frame)."""
    def f(x):  # axes out of the mesh's order: jit runs it, no layout of the plan is it
        return jax.lax.with_sharding_constraint(jnp.sin(x), P(("model", "data")))

    with pytest.warns(shardsat.ConstraintWarning) as rec:
        shardsat.saturate_and_extract(f, mesh24(), jnp.ones((8, 8)))
    assert [r.filename for r in rec] == [__file__]
    key = jax.random.split(jax.random.key(0), 8)
    with pytest.warns(shardsat.ConstraintWarning, match="PRNG key") as rec:
        shardsat.saturate_and_extract(lambda k, x: x + jax.random.normal(k[0], x.shape), mesh24(), key,
                                      jnp.ones((8, 8)), in_shardings=(P("data"), None))
    assert {r.filename for r in rec} == {__file__}


def test_unknown_primitive_falls_back_with_a_warning_or_errors_when_strict():
    prim = _unknown_primitive()

    def f(x, w):
        return jnp.exp(prim.bind(x @ w))

    x, w = jnp.ones((8, 4)), jnp.ones((4, 16)) * 0.1
    with pytest.warns(shardsat.FallbackWarning) as rec:
        plan = shardsat.saturate_and_extract(f, mesh24(), x, w)
    msg = str(rec[0].message)
    assert "`test_unknown_op`" in msg and "test_api.py" in msg and "strict=True" in msg
    assert rec[0].filename == __file__  # points at the caller's line
    assert any("test_unknown_op" in s for s in plan.report.fallbacks)
    assert "Replicated by fallback" in plan.explain()
    assert_equivalent(plan, f, x, w)
    for kw in ({"strict": True}, {"fallback": "error"}):
        with pytest.raises(shardsat.UnsupportedPrimitiveError) as info:
            shardsat.saturate_and_extract(f, mesh24(), x, w, **kw)
        assert "`test_unknown_op`" in str(info.value) and "test_api.py" in str(info.value)


def test_a_rule_that_fails_on_its_operands_falls_back():
    """A signature builder that raises (any exception) is a missing rule, not a crash."""
    prim = _unknown_primitive()

    def broken(t):
        raise RuntimeError("this rule cannot handle rank " + str(len(t.in_shapes[0])))

    from shardsat.rules import registry

    registry.register(prim.name, broken)
    try:
        x = jnp.ones((8, 4))
        with pytest.warns(shardsat.FallbackWarning, match="cannot handle rank 2"):
            plan = shardsat.saturate_and_extract(prim.bind, mesh24(), x)
        assert_equivalent(plan, prim.bind, x)
    finally:
        registry.SIGNATURES.pop(prim.name, None)


def test_pins_are_hard_and_conflicts_listed():
    def f(w, x):
        return jnp.tanh(x @ w)

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    plan = shardsat.saturate_and_extract(f, mesh24(), w, x, in_shardings=(P(None, "model"), P("data")),
                                         out_shardings=P("data", "model"))
    assert plan.in_shardings[0].spec == P(None, "model")
    assert plan.in_shardings[1].spec == P("data")
    assert plan.out_shardings.spec == P("data", "model")
    assert_equivalent(plan, f, w, x)
    with pytest.raises(shardsat.ShardsatError) as info:
        shardsat.saturate_and_extract(f, mesh24(), w, x, in_shardings=(P("nope"), P(None, None, "data")),
                                      out_shardings=P(("model", "data")))
    msg = str(info.value)
    assert "args[0]" in msg and "args[1]" in msg and "out" in msg and "data=2, model=4" in msg
    # a state's in pin and its output's pin with no layout in common: named, not a bare NoPlanError
    step = lambda w, x: (w * 2, jnp.sum(x @ w))  # noqa: E731
    with pytest.raises(shardsat.InvalidArgumentError, match=r"args\[0\] is pinned to P\('data',\).*out\[0\]"):
        shardsat.saturate_and_extract(step, mesh24(), w, x, state_argnums=(0,), in_shardings=(P("data"), None),
                                      out_shardings=(P("model"), None))


def test_limits_stop_reasons_are_reported():
    def f(w, x):
        return jnp.tanh(x @ w) @ w

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    plan = shardsat.saturate_and_extract(f, mesh24(), w, x)
    assert plan.report.stop_reason == shardsat.StopReason.SATURATED
    assert plan.report.e_nodes > plan.report.e_classes > 0
    with pytest.raises(shardsat.NoPlanError, match="iteration limit"):
        shardsat.saturate_and_extract(f, mesh24(), w, x, limits=shardsat.Limits(iterations=1))
    plan = shardsat.saturate_and_extract(f, mesh24(), w, x, limits=shardsat.Limits(iterations=4))
    assert plan.report.stop_reason == shardsat.StopReason.ITERATION_LIMIT
    assert "iteration limit" in str(plan.report)
    assert_equivalent(plan, f, w, x)
    full = plan.report.e_nodes
    for nodes in (full // 2, full - 1):
        try:
            plan = shardsat.saturate_and_extract(f, mesh24(), w, x, limits=shardsat.Limits(nodes=nodes))
        except shardsat.NoPlanError as e:
            assert "node limit" in str(e) and "Consider raising shardsat.Limits" in str(e)
            continue
        assert plan.report.stop_reason == shardsat.StopReason.NODE_LIMIT
        assert_equivalent(plan, f, w, x)
    with pytest.raises(shardsat.ShardsatError):
        shardsat.Limits(iterations=0)


def test_profiles():
    prof = shardsat.DeviceProfile(flops_per_s=1e14, hbm_bytes_per_s=1e12,
                                  link_bytes_per_s={"data": 1e10, "model": 1e11}, latency_s={"*": 1e-5})
    assert prof.link("data") == 1e10 and prof.latency("model") == 1e-5
    with pytest.raises(shardsat.ShardsatError, match="no entry for mesh axis 'other'"):
        prof.link("other")
    with pytest.raises(shardsat.ShardsatError):
        shardsat.DeviceProfile(flops_per_s=0, hbm_bytes_per_s=1, link_bytes_per_s=1, latency_s=0)
    with pytest.raises(shardsat.ShardsatError, match="Unknown device profile"):
        shardsat.saturate_and_extract(jnp.sin, mesh24(), jnp.ones(8), profile="a100x")
    for name in shardsat.PRESETS:
        plan = shardsat.saturate_and_extract(jnp.sin, mesh24(), jnp.ones(8), profile=name)
        assert plan.profile.name == name


def test_explain_and_cost_fields():
    def f(w, x):
        return (x @ w).sum(axis=0)

    w, x = jnp.ones((256, 256)), jnp.ones((512, 256))
    plan = shardsat.saturate_and_extract(f, mesh24(), w, x, profile="h100")
    text = plan.explain()
    for word in ("Inputs", "Outputs", "Intermediates", "Collectives", "Search", "args[0]", "P("):
        assert word in text
    c = plan.cost
    assert c.total_s == pytest.approx(c.compute_s + c.communication_s)
    assert c.argument_bytes == sum(c.argument_bytes_by_path.values())
    for coll in c.collectives:
        assert coll.kind in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
        assert coll.seconds > 0 and coll.bytes > 0 and coll.axes
    assert_hlo_matches(plan, w, x)


def test_bad_arguments():
    with pytest.raises(shardsat.ShardsatError, match="Mesh"):
        shardsat.saturate_and_extract(jnp.sin, "not a mesh", jnp.ones(8))
    with pytest.raises(shardsat.ShardsatError, match="fallback"):
        shardsat.saturate_and_extract(jnp.sin, mesh24(), jnp.ones(8), fallback="skip")
    with pytest.raises(shardsat.ShardsatError, match="not an array"):
        shardsat.saturate_and_extract(lambda s: s, mesh24(), "text")
    from shardsat.testing import standard_layouts

    with pytest.raises(shardsat.InvalidMeshError, match=r"needs a jax\.sharding\.Mesh, got str"):
        standard_layouts(jnp.sin, "mesh", jnp.ones(8))  # was AttributeError deep inside
    abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    for what, call in [("saturate_and_extract", lambda: shardsat.saturate_and_extract(jnp.sin, abstract, jnp.ones(8))),
                       ("load_plan", lambda: shardsat.load_plan("missing.json", jnp.sin, abstract, jnp.ones(8)))]:
        with pytest.raises(shardsat.InvalidMeshError, match=rf"{what} needs a jax\.sharding\.Mesh, got AbstractMesh"):
            call()
    # XLA aborts the process on names not ASCII or with a backslash (jax.jit too); jax's shard_map
    # reads an empty name as no axis (a pin on it gave an internal error); int names gave KeyError
    for names, words in [(("δ", "model"), "not ASCII"), (("data", "b\\"), "backslash"), (("", "model"), "empty"),
                         ((0, 1), "of type int, not a string")]:
        odd = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), names)
        with pytest.raises(shardsat.InvalidMeshError, match=words):
            shardsat.saturate_and_extract(jnp.sin, odd, jnp.ones(8))


def test_sharding_constraints_inside_the_function_are_pins():
    mesh = mesh24(AxisType.Auto)

    def f(w, x):
        h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("data", "model")))
        return jnp.tanh(h).sum(0)

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    plan = shardsat.saturate_and_extract(f, mesh, w, x)
    run = next(r for r in plan.runs if plan.program.equations[r.eqn].name == "sharding_constraint")
    assert plan.layouts[run.outputs[0][1]].spec(plan.axes) == P("data", "model")
    assert_equivalent(plan, f, w, x)



@pytest.mark.parametrize("spec,shape,why", [(P(("model", "data")), (32, 64), "out of mesh order"),
                                            (P(None, "model"), (32, 6), "does not divide")])
def test_constraints_jit_runs_but_no_layout_is_are_dropped_with_a_warning(spec, shape, why):
    # jax.jit runs both (another device order; a padded last shard): the program gets a plan,
    # and the plan says it did not keep them (they were a refusal of the whole program)
    mesh = mesh24(AxisType.Auto)

    def g(w, x):
        return jnp.tanh(jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, spec)))

    w, x = jnp.linspace(-1, 1, 64 * shape[1]).reshape(64, shape[1]), jnp.ones((shape[0], 64))
    with pytest.warns(shardsat.ConstraintWarning, match=why):
        plan = shardsat.saturate_and_extract(g, mesh, w, x)
    assert any(why in u for u in plan.report.unkept)
    assert_equivalent(plan, g, w, x, rtol=1e-4)


def test_progress_lines_for_long_searches():
    import io

    from shardsat.progress import Progress

    stream = io.StringIO()
    p = Progress(True, after_s=0.0, stream=stream)
    p.update("saturating", "iteration 3, 1,000 e-nodes")
    p.close()
    assert "iteration 3" in stream.getvalue()
    quiet = io.StringIO()
    q = Progress(True, after_s=60.0, stream=quiet)
    q.update("saturating", "iteration 1")
    assert quiet.getvalue() == ""
    plan = shardsat.saturate_and_extract(jnp.sin, mesh24(), jnp.ones(8), progress=False)
    assert plan.report.iterations > 0


def test_pinning_a_transformer_input_forces_batch_parallelism():
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from models import GPTConfig, attention, gpt_params, layer_norm

    cfg = GPTConfig(layers=1, d_model=128, heads=4, mlp=512, vocab=64, seq=32, batch=8)
    layer = gpt_params(cfg, jax.random.key(0))["layers"][0]

    def block(p, x):
        x = x + attention(p, layer_norm(p["ln1"], x))
        return x + jax.nn.gelu(layer_norm(p["ln2"], x) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    x = jax.random.normal(jax.random.key(1), (8, 32, 128))
    mesh = mesh24(AxisType.Auto)
    plan = shardsat.saturate_and_extract(block, mesh, layer, x, in_shardings=(None, P("data", None)))
    assert plan.in_shardings[1].spec == P("data")
    free = [s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings[0])]
    assert free  # the weights were searched, not pinned
    assert_equivalent(plan, block, layer, x, rtol=1e-4)
    pins = jax.tree_util.tree_map(lambda _: None, layer)
    pins["w1"], pins["wq"] = P("data", "data"), P("nope")
    with pytest.raises(shardsat.ShardsatError) as info:
        shardsat.saturate_and_extract(block, mesh, layer, x, in_shardings=(pins, P(None, None, "model", "x")))
    msg = str(info.value)
    assert "['w1']" in msg and "['wq']" in msg and "args[1]" in msg


def test_plan_runs_inside_the_callers_explicit_mesh_context():
    # jax.set_mesh is how Explicit axes are used: the plan runs under it, and its outputs come
    # back on the caller's mesh, usable by the code around the call
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def fn(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    p = {"w1": jnp.ones((128, 256)) / 64, "w2": jnp.ones((256, 64)) / 64}
    x = jnp.ones((64, 128))
    plan = shardsat.saturate_and_extract(fn, mesh, p, x, profile="h100")
    with jax.set_mesh(mesh):
        y = plan.jit()(p, x)
        assert y.sharding.mesh.axis_types == (AxisType.Explicit,) * 2
        z = y @ jnp.ones((64, 8))  # an Auto-mesh array would be a type error here
    np.testing.assert_allclose(np.asarray(y), np.asarray(fn(p, x)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(z), np.asarray(fn(p, x) @ jnp.ones((64, 8))), rtol=1e-5)
    other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(other), pytest.raises(shardsat.ShardsatError, match="not the plan's mesh"):
        plan.jit()(p, x)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_plan_runs_inside_jit_and_grad_under_the_callers_mesh(kind):
    # a training step jitted under jax.set_mesh calls the plan inside its trace, where set_mesh
    # itself is refused (it raised ValueError): the plan runs with the caller's axes made Auto
    mesh = mesh24(kind)

    def fn(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    p = {"w1": jnp.ones((128, 256)) / 64, "w2": jnp.ones((256, 64)) / 64}
    x = jnp.linspace(-1.0, 1.0, 64 * 128).reshape(64, 128)
    plan = shardsat.saturate_and_extract(fn, mesh, p, x, profile="h100")
    loss = lambda f: lambda p, x: jnp.sum(f(p, x) ** 2)  # noqa: E731
    with jax.set_mesh(mesh):
        y = jax.jit(lambda p, x: plan.jit()(p, x) * 2.0)(p, x)
        g = jax.jit(jax.grad(loss(plan.jit())))(p, x)
        # eager, the batch closed over (a concrete array in the grad's trace): jit typed it
        # replicated on the caller's mesh and refused it (a helper's ops hunt: ValueError)
        eager = jax.grad(lambda p: loss(plan.jit())(p, x))(p)
    want = jax.grad(loss(fn))(p, x)
    np.testing.assert_allclose(np.asarray(y), 2.0 * np.asarray(fn(p, x)), rtol=1e-5)
    for k in p:
        np.testing.assert_allclose(np.asarray(g[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(eager[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-6)
    other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
    if kind == AxisType.Explicit:
        with jax.set_mesh(other), pytest.raises(shardsat.ShardsatError, match="not the plan's mesh"):
            jax.jit(plan.jit())(p, x)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_planning_from_several_threads(capfd):
    """Regression (a helper's API hunt): four threads planning at once failed at random with
    KeyError on egglog's declarations, NoPlanError, and "EGraph is unsendable, but is being
    dropped on another thread" on stderr. Planning now holds one lock (threads.PLANNING)."""
    import concurrent.futures as cf

    def make(k):
        def step(w, x):
            loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** k))(w)
            return w - 0.1 * g, loss
        return step

    mesh = mesh24(AxisType.Auto)
    w, x = jnp.ones((64, 128)) / 64, jnp.ones((32, 64))
    with cf.ThreadPoolExecutor(4) as pool:
        plans = list(pool.map(lambda k: (k, shardsat.saturate_and_extract(make(k), mesh, w, x, state_argnums=(0,))),
                              range(2, 8)))
    for k, plan in plans:
        assert_equivalent(plan, make(k), w, x)
    assert "dropped on another thread" not in capfd.readouterr().err


def test_profile_rates_for_axes_the_mesh_lacks_are_warned_of():
    """Regression (a helper's API hunt): `with_axes(dta=1e8)` was ignored silently, the plan
    priced by the default rate. Every shardsat warning is a ShardsatWarning."""
    prof = shardsat.PRESETS["h100"].with_axes(dta=1e8)
    with pytest.warns(shardsat.ShardsatWarning, match=r"axes 'dta', which mesh \('data', 'model'\) lacks.*'dta' -> 'data'"):
        shardsat.saturate_and_extract(jnp.sin, mesh24(), jnp.ones((8, 16)), profile=prof)
    assert all(issubclass(w, shardsat.ShardsatWarning) for w in
               (shardsat.ConstraintWarning, shardsat.FallbackWarning, shardsat.MemoryLimitWarning))


def test_plan_deepcopy_keyword_memory_and_constant_outputs():
    """Regressions (a helper's API hunt): copy.deepcopy(plan) raised TypeError (then, past that,
    cloned jax's primitives without their lowering rules); compiled_memory took no keyword
    arguments, though plan.jit() does; explain() showed an output made from x.shape[0] as
    `literal TypedInt(8, dtype=int32)`."""
    import copy

    def f(p, x):
        return jnp.tanh(x @ p), x.shape[0]

    p, x = jnp.ones((16, 16)), jnp.ones((8, 16))
    plan = shardsat.saturate_and_extract(f, mesh24(), p, x)
    twin = copy.deepcopy(plan)
    np.testing.assert_array_equal(twin.jit()(p, x)[0], plan.jit()(p, x)[0])
    twin.report.memory_limit = 1  # its own report
    assert plan.report.memory_limit != 1
    assert plan.compiled_memory(p=p, x=x) == plan.compiled_memory(p, x) > 0
    assert "int32[] constant 8" in plan.explain() and "TypedInt" not in plan.explain()


def test_a_default_argument_given_at_call_is_named():
    """Regression (a helper's API hunt): f(x, scale=3.0) on a plan made for f(x) was refused
    with "structure PyTreeDef((*, *)), planned PyTreeDef((*,))", naming no argument."""
    def f(x, scale=2.0):
        return x * scale

    x = jnp.ones((8, 16))
    plan = shardsat.saturate_and_extract(f, mesh24(), x)
    np.testing.assert_array_equal(plan.jit()(x=x), x * 2.0)
    with pytest.raises(shardsat.InvalidArgumentError, match="got argument\\(s\\) 'scale' the plan was not made for"):
        plan.jit()(x, scale=3.0)
