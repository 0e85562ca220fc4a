"""Control flow and side effects: lax.cond / lax.switch branches and lax.while_loop bodies are
planned (not replicated by fallback), and every side effect runs as often as under jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_equivalent, assert_hlo_matches
from jax import lax
from jax.experimental import io_callback

import shardsat
from shardsat.testing import check_plan


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def plan_of(fn, mesh, *args, **kw):
    """Plan with no fallback allowed: control flow must have real rules."""
    return shardsat.saturate_and_extract(fn, mesh, *args, strict=True, **kw)


def test_cond_branches_are_planned_and_shard_their_work(mesh):
    def f(p, x, w):
        return lax.cond(p > 0, lambda x: jnp.tanh(x @ w), lambda x: (x @ w) * 2.0, x)

    p, x, w = jnp.float32(1.0), jnp.ones((64, 256)) * 0.01, jnp.ones((256, 1024)) * 0.01
    plan = plan_of(f, mesh, p, x, w, profile="h100")
    assert [r.kind for r in plan.program.scans] == ["branch", "branch"]
    assert plan.in_shardings[2].spec != jax.sharding.PartitionSpec()  # the weight is not replicated
    for pv in (1.0, -1.0):
        assert_equivalent(plan, f, jnp.float32(pv), x, w)
    assert_hlo_matches(plan, p, x, w)


def test_switch_with_passthrough_literal_and_unequal_branches(mesh):
    def f(i, x, w):
        return lax.switch(i, [
            lambda x: (x @ w, jnp.float32(0.0)),
            lambda x: (jnp.tanh(x) @ w, x.sum()),
            lambda x: (x[:, :16], jnp.float32(3.0)),
        ], x)

    x, w = jnp.arange(8 * 32, dtype=jnp.float32).reshape(8, 32) / 256, jnp.ones((32, 16))
    plan = plan_of(f, mesh, jnp.int32(0), x, w)
    for i in (0, 1, 2, 7, -3):  # out of range clamps, as lax.switch does
        assert_equivalent(plan, f, jnp.int32(i), x, w)


def test_while_loop_with_a_dynamic_trip_count(mesh):
    def f(x, w, n):
        return lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w) + i, x)

    x, w = jnp.ones((16, 64)) * 0.1, jnp.eye(64) * 0.5
    plan = plan_of(f, mesh, x, w, jnp.int32(3))
    kinds = sorted(r.kind for r in plan.program.scans)
    assert kinds == ["while", "while_cond"]
    for n in (0, 1, 5):
        assert_equivalent(plan, f, x, w, jnp.int32(n))


def test_while_trip_count_is_estimated_from_a_literal_bound(mesh):
    def f(x):
        return lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[1]

    x = jnp.ones((8, 16))
    plan = plan_of(f, mesh, x)
    loop = next(r for r in plan.program.scans if r.kind == "while")
    assert loop.length == 7 and loop.multiplicity == 7
    assert_equivalent(plan, f, x)


def test_greedy_decoding_while_loop(mesh):
    """A decoder: embed the last token, project to the vocabulary, take the argmax, until an
    end token or the length limit."""
    vocab, d, steps = 64, 32, 12

    def decode(emb, w_out, start):
        def cond(c):
            i, _tok, _, done = c
            return (i < steps) & ~done

        def body(c):
            i, tok, out, _done = c
            h = jnp.tanh(emb[tok])
            nxt = jnp.argmax(h @ w_out, axis=-1).astype(jnp.int32)
            out = out.at[:, i].set(nxt)
            return i + 1, nxt, out, jnp.all(nxt == 0)

        init = (jnp.int32(0), start, jnp.zeros((start.shape[0], steps), jnp.int32), jnp.bool_(False))
        return lax.while_loop(cond, body, init)[2]

    k = jax.random.split(jax.random.key(0), 2)
    emb = jax.random.normal(k[0], (vocab, d))
    w_out = jax.random.normal(k[1], (d, vocab))
    start = jnp.arange(8, dtype=jnp.int32) + 1
    plan = plan_of(decode, mesh, emb, w_out, start)
    assert_equivalent(plan, decode, emb, w_out, start)


def test_nested_control_flow(mesh):
    """A scan whose body holds a cond, inside a while loop."""
    def f(ws, x, n):
        def layer(h, w):
            h = lax.cond(w.sum() > 0, lambda h: jnp.tanh(h @ w), lambda h: h, h)
            return h, h.mean()

        def body(c):
            i, h = c
            h, _ = lax.scan(layer, h, ws)
            return i + 1, h

        return lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    ws = jax.random.normal(jax.random.key(1), (3, 32, 32)) * 0.2
    ws = ws.at[1].set(-jnp.abs(ws[1]))
    x = jnp.ones((8, 32))
    plan = plan_of(f, mesh, ws, x, jnp.int32(2))
    assert_equivalent(plan, f, ws, x, jnp.int32(2))


@pytest.mark.parametrize("opt", ["apply_if_finite", "multi_steps"])
def test_optax_conditional_optimizers(mesh, opt):
    inner = optax.adam(1e-2)
    tx = optax.apply_if_finite(inner, 3) if opt == "apply_if_finite" else optax.MultiSteps(inner, 2)

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    k = jax.random.split(jax.random.key(2), 4)
    p = {"w1": jax.random.normal(k[0], (32, 128)) * 0.1, "w2": jax.random.normal(k[1], (128, 16)) * 0.1}
    x, y = jax.random.normal(k[2], (64, 32)), jax.random.normal(k[3], (64, 16))
    s = tx.init(p)
    plan = plan_of(step, mesh, p, s, x, y, state_argnums=(0, 1))
    assert any(r.kind == "branch" for r in plan.program.scans)
    assert_equivalent(plan, step, p, s, x, y)
    run = plan.jit(donate_argnums=())
    p1, s1 = run(p, s, x, y)
    p2, _s2 = run(p1, s1, x, y)  # the returned state feeds the next step in the same layout
    want = step(*step(p, s, x, y), x, y)
    np.testing.assert_allclose(p2["w1"], want[0]["w1"], rtol=1e-5, atol=1e-6)


class Calls:
    def __init__(self):
        self.seen = []

    def __call__(self, *xs):
        self.seen.append([np.asarray(x).copy() for x in xs])


def count_effects(fn, mesh, *args):
    """(calls under jax.jit, calls under the plan), each a list of the values the callback saw."""
    calls = Calls()
    f = fn(calls)
    jax.block_until_ready(jax.jit(f)(*args))
    ref = list(calls.seen)
    calls.seen.clear()
    plan = plan_of(f, mesh, *args)
    jax.block_until_ready(plan.jit()(*args))
    jax.effects_barrier()
    return ref, list(calls.seen), plan


def _debug_callback_twice(calls):
    def f(x):
        jax.debug.callback(calls, x.sum())
        jax.debug.callback(calls, x.sum())  # the same equation twice: two calls, not one
        return x * 2
    return f


def _callback_on_unused_value(calls):
    def f(x, w):
        h = jnp.tanh(x @ w)
        jax.debug.callback(calls, h)  # h is read by nothing else
        return x.sum()
    return f


def _io_callback_ordered(calls):
    def f(x):
        def host(v):
            calls(v)
            return np.asarray(v * 3, dtype=np.float32)

        y = io_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=True)
        io_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x + 1, ordered=True)  # result unused
        return y + 1
    return f


def _callback_in_scan(calls):
    def f(x):
        def body(c, _):
            jax.debug.callback(calls, c.sum())
            return c * 0.5, None
        return lax.scan(body, x, None, length=4)[0]
    return f


def _callback_in_cond_and_while(calls):
    def f(x, n):
        def br(v):
            jax.debug.callback(calls, v.sum())
            return v + 1

        y = lax.cond(x.sum() > 0, br, lambda v: v, x)

        def body(c):
            jax.debug.callback(calls, c[0])
            return c[0] + 1, c[1] * 2

        return lax.while_loop(lambda c: c[0] < n, body, (0, y))[1]
    return f


@pytest.mark.parametrize("make,args", [
    (_debug_callback_twice, (jnp.ones((8, 16)),)),
    (_callback_on_unused_value, (jnp.ones((8, 16)), jnp.ones((16, 32)))),
    (_io_callback_ordered, (jnp.arange(16.0),)),
    (_callback_in_scan, (jnp.ones((8, 16)),)),
    (_callback_in_cond_and_while, (jnp.ones((8, 16)), jnp.int32(3))),
])
def test_side_effects_run_as_under_jit(mesh, make, args):
    ref, got, plan = count_effects(make, mesh, *args)
    assert len(got) == len(ref) > 0
    for a, b in zip(sorted(ref, key=lambda v: [x.sum() for x in v]), sorted(got, key=lambda v: [x.sum() for x in v]),
                    strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-6)
    assert_equivalent(plan, make(Calls()), *args)


def test_debug_print_is_kept(mesh, capfd):
    def f(x):
        jax.debug.print("total {t}", t=x.sum())
        return x + 1

    plan = plan_of(f, mesh, jnp.ones((8, 4)))
    jax.block_until_ready(plan.jit()(jnp.ones((8, 4))))
    jax.effects_barrier()
    assert capfd.readouterr().out.count("total 32.0") == 1


def test_ordered_debug_callbacks_run_once_in_order(mesh, capfd):
    """jax.debug.callback / print with ordered=True: jax refuses ordered debug effects on more
    than one device (a raw ValueError when the plan ran); the plan calls them through an
    ordered io_callback, once each, in program order, also inside a scan."""
    seen = []

    def f(w, x):
        h = x @ w
        jax.debug.callback(lambda v: seen.append(("sum", float(v))), h.sum(), ordered=True)
        jax.debug.print("max {m}", m=h.max(), ordered=True)

        def body(c, _):
            jax.debug.callback(lambda v: seen.append(("step", float(v))), c.sum(), ordered=True)
            return jnp.tanh(c), None

        h, _ = lax.scan(body, h, None, length=3)
        return h

    args = (jnp.ones((16, 8)), jnp.ones((4, 16)))
    want = jax.jit(f)(*args)
    jax.effects_barrier()
    expected, _ = list(seen), capfd.readouterr()
    seen.clear()
    plan = plan_of(f, mesh, *args)
    np.testing.assert_allclose(plan.jit()(*args), want, rtol=1e-6)
    jax.effects_barrier()
    assert seen == expected and len(seen) == 4
    assert capfd.readouterr().out.count("max 16.0") == 1


def test_partitioned_debug_callback_runs_as_often_as_under_jit(mesh):
    """partitioned=True asks for a call per device's shard; jax.jit of the function (one device)
    calls it once with the whole value, and so does the plan (it called it 8 times)."""
    calls = []

    def f(w, x):
        h = x @ w
        jax.debug.callback(lambda v: calls.append(v.shape), h, partitioned=True)
        return h

    args = (jnp.ones((32, 16)), jnp.ones((16, 32)))
    jax.block_until_ready(jax.jit(f)(*args))
    jax.effects_barrier()
    want, _ = list(calls), calls.clear()
    jax.block_until_ready(plan_of(f, mesh, *args).jit()(*args))
    jax.effects_barrier()
    assert calls == want == [(16, 16)]


def _per_element_while(x):
    return jax.vmap(lambda v: lax.while_loop(lambda c: c[0] < 3.0 * jnp.abs(c[1]).sum(),
                                             lambda c: (c[0] + 1.0, c[1] * 0.9), (0.0, v)))(x)


def _per_element_trip_count(x, n):
    return jax.vmap(lambda v, k: lax.fori_loop(0, k, lambda i, c: c * 0.9 + 1, v))(x, n)


def _per_key_poisson(keys):
    return jax.vmap(lambda k: jax.random.poisson(k, 3.0, (4,)))(keys)


@pytest.mark.parametrize("fn,args", [
    (_per_element_while, (jax.random.normal(jax.random.key(0), (8, 4)),)),
    (_per_element_trip_count, (jax.random.normal(jax.random.key(1), (8, 4)), jnp.arange(8, dtype=jnp.int32))),
    (_per_key_poisson, (jax.random.split(jax.random.key(2), 8),)),
], ids=["while", "fori", "poisson"])
def test_while_loop_under_vmap_has_a_predicate_per_element(mesh, fn, args):
    """vmap of a while loop whose predicate depends on the element: the primitive's predicate
    is a vector (it runs while any holds, and an element whose predicate fails keeps its
    carry); the plan ran it through lax.while_loop, which wants a scalar (TypeError)."""
    plan = shardsat.saturate_and_extract(fn, mesh, *args)
    if fn is _per_key_poisson:
        np.testing.assert_array_equal(plan.jit()(*args), jax.jit(fn)(*args))
    else:
        assert_equivalent(plan, fn, *args)


@pytest.mark.parametrize("case", ["scan", "while", "cond", "nested_jit"])
def test_outputs_made_from_python_scalars_stay_weakly_typed(case):
    """Regression: a scan carry started from 0.0, a while counter from 0, a branch returning a
    Python scalar came back strongly typed, so `out * bf16` gave float32 where jax.jit's gives
    bfloat16. check_plan now compares weak types too."""
    fns = {
        "scan": lambda x: lax.scan(lambda c, y: (c + 1.0, y), 0.0, x)[0],
        "while": lambda x: lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 2), (0, x))[0],
        "cond": lambda x: lax.cond(x[0, 0] > 0, lambda: 1.0, lambda: 2.0),
        "nested_jit": lambda x: jax.jit(lambda: 1.0)(),
    }
    x = jnp.ones((16, 8))
    plan = shardsat.saturate_and_extract(fns[case], jax.make_mesh((2, 4), ("data", "model")), x)
    out = plan.jit()(x)
    assert out.weak_type and (out * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
    check_plan(plan, x)
