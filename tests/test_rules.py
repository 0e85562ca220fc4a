"""Every built-in rule checked numerically (each strategy run on shards vs unsharded), user
rules registered and checked, golden signatures."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

import shardsat
from shardsat.testing import (
    RuleCheckError,
    check_equation_rules,
    check_plan,
    check_reshard_rules,
    check_rule,
)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("x", "y"))


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# one program per family of built-in signatures; each equation's strategies are run on shards
CATALOGUE = {
    "elementwise": (lambda a, b: (jnp.tanh(a) * b - jnp.exp(-a) / (1 + b * b), jnp.maximum(a, b), a > b,
                                  jnp.where(a > 0, a, b), a.astype(jnp.int32), jnp.abs(a) ** 3, jnp.sqrt(b * b + 1)),
                    (rnd(8, 12), rnd(8, 12, seed=1))),
    "dot_general": (lambda a, b, c: (a @ b, jnp.einsum("bik,bkj->bij", c, c)),
                    (rnd(8, 12), rnd(12, 16), rnd(4, 8, 8))),
    "reductions": (lambda a: (a.sum(0), a.max(1), a.min(), jnp.argmax(a, axis=1), jnp.cumsum(a, axis=0)),
                   (rnd(8, 12),)),
    "shapes": (lambda a: (a.T, a.reshape(4, 2, 12), a.reshape(96), a[None], jnp.broadcast_to(a[:, None, :], (8, 4, 12)),
                          jnp.squeeze(a.reshape(8, 1, 12), 1)),
               (rnd(8, 12),)),
    "movement": (lambda a, b: (jnp.concatenate([a, b], 0), a[2:6], jnp.pad(a, ((1, 1), (0, 0))), jnp.flip(a, 0),
                               jax.lax.dynamic_slice(a, (2, 0), (4, 12)), jax.lax.dynamic_update_slice(a, b[:2], (3, 0)),
                               jnp.sort(a, axis=1), jnp.arange(12.0) * 2),
                 (rnd(8, 12), rnd(8, 12, seed=1))),
}


def _elementwise(a, b):
    return jnp.tanh(a) * b, jnp.maximum(a, b), jnp.where(a > 0, a, b), a.astype(jnp.int32)


def _contract(a, b):
    return a @ b, jnp.einsum("ik,jk->ij", a, a)


def _reduce(a):
    return a.sum(0), a.max(1), jnp.argmax(a, axis=1), jnp.cumsum(a, axis=0), jnp.sort(a, axis=0)


def _move(a, b):
    return (jnp.concatenate([a, b], 0), a.T, a.reshape(-1), a[None], jnp.pad(a, ((1, 1), (0, 0))),
            jnp.flip(a, 1), a[:, None, :] * 1.0)


# the same families over degenerate dims: size 1 (no factor) and 0 (no elements), beside primes
# (gather, scatter, conv and pooling on such dims: tests/test_indexing_conv.py, checked against XLA)
DEGENERATE = {
    f"{name} {shape}": (fn, shape)
    for shape in ((1, 12), (8, 1), (0, 12), (7, 13))
    for name, fn in (("elementwise", _elementwise), ("reduce", _reduce), ("move", _move))
    if not (fn is _reduce and shape[1] == 0)  # jnp: a max over no elements is an error
} | {
    f"contract {m}x{k}x{n}": (_contract, (m, k, n)) for m, k, n in ((1, 12, 16), (8, 1, 16), (8, 0, 4))
}


def _degenerate_args(fn, shape):
    if fn is _contract:
        m, k, n = shape
        return rnd(m, k), rnd(k, n, seed=1)
    if fn in (_elementwise, _move):
        return rnd(*shape), rnd(*shape, seed=1)
    return (rnd(*shape),)


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_builtin_signatures_on_degenerate_dims(case, mesh):
    fn, shape = DEGENERATE[case]
    failures = check_equation_rules(fn, *_degenerate_args(fn, shape), mesh=mesh, max_strategies=3)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("family", sorted(CATALOGUE))
def test_builtin_signatures_compute_the_same_on_shards(family, mesh):
    fn, args = CATALOGUE[family]
    failures = check_equation_rules(fn, *args, mesh=mesh, max_strategies=3)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("shape", [(8, 12), (4, 2, 8)])
def test_resharding_rules_keep_the_value(shape, mesh):
    failures = check_reshard_rules(shape, mesh, max_edges=16)
    assert not failures, "\n".join(failures)


def _rms_primitive():
    prim = Primitive("test_rms_norm")

    def impl(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w

    prim.def_impl(impl)
    prim.def_abstract_eval(lambda x, w: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
    return prim


def test_user_primitive_signature_plans_and_runs(mesh):
    prim = _rms_primitive()
    rule = shardsat.register_signature(prim, "b s d, d -> b s d", need_replication_factors=("d",))
    check_rule(rule, max_examples=3, max_strategies=4, meshes=((2, 4),), sizes=(2, 8))

    def model(p, x):
        h = prim.bind(x, p["scale"])
        return jnp.tanh(h @ p["w1"]) @ p["w2"]

    p = {"scale": rnd(64), "w1": rnd(64, 256, seed=1), "w2": rnd(256, 64, seed=2)}
    x = rnd(8, 16, 64, seed=3)
    plan = shardsat.saturate_and_extract(model, mesh, p, x, profile="h100")
    check_plan(plan, p, x)


def test_wrong_user_rule_is_caught():
    prim = _rms_primitive()
    wrong = shardsat.register_signature(prim, "b d, d -> b d")  # d declared pass-through: wrong
    with pytest.raises(RuleCheckError, match="relative error"):
        check_rule(wrong, max_examples=6, max_strategies=6, meshes=((2, 4),), sizes=(2, 4))
    shardsat.register_signature(prim, "b d, d -> b d", need_replication_factors=("d",))


def test_a_wrong_rule_is_caught_where_its_op_is_nan_for_some_operands():
    """An op that takes the log of its operand is NaN for the negative half of the random
    operands check_rule draws, whole and on shards alike. The comparison read NaN for the whole
    result, and a NaN error counted as none: a wrong signature passed."""
    prim = Primitive("test_log_rms")

    def impl(x, w):
        return jnp.log(x) * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w

    prim.def_impl(impl)
    prim.def_abstract_eval(lambda x, w: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
    wrong = shardsat.register_signature(prim, "b d, d -> b d")  # the mean over d: not pass-through
    with pytest.raises(RuleCheckError, match="relative error"):
        check_rule(wrong, max_examples=6, max_strategies=6, meshes=((2, 4),), sizes=(2, 4))
    right = shardsat.register_signature(prim, "b d, d -> b d", need_replication_factors=("d",))
    check_rule(right, max_examples=4, max_strategies=6, meshes=((2, 4),), sizes=(2, 4))


def test_bad_signatures_are_rejected_when_defined():
    with pytest.raises(shardsat.InvalidSignatureError, match="unknown factor"):
        shardsat.register_signature("nope_p", "i k, k j -> i j", reduction_factors=("q",))
    with pytest.raises(shardsat.InvalidSignatureError, match="'->'"):
        shardsat.register_signature("nope_p", "i k, k j")
    with pytest.raises(shardsat.InvalidSignatureError, match="also appear in a result"):
        shardsat.register_signature("nope_p", "i k -> i k", reduction_factors=("k",))
    rule = shardsat.register_signature("nope_p", "i k, k j -> i j", reduction_factors=("k",))
    with pytest.raises(shardsat.InvalidSignatureError, match="operands"):
        rule.signature([(2, 3)], [(2, 4)])


def test_golden_signatures():
    from shardsat.egraph.program import trace
    from shardsat.rules.apply import _eqn_types, signature_for

    def sig_of(fn, *args):
        prog = trace(fn, args)
        eqn = prog.equations[-1]
        return signature_for(eqn, _eqn_types(prog, eqn), None)[0]

    s = sig_of(lambda a, b: jnp.einsum("bik,bkj->bij", a, b), rnd(2, 3, 4), rnd(2, 4, 5))
    assert s.operands[0][0] == s.operands[1][0] == s.results[0][0]  # batch shared
    assert s.operands[0][2] == s.operands[1][1] and s.operands[0][2][0] in s.reduction  # k reduced
    s = sig_of(lambda a: a.reshape(4, 6), rnd(24))
    assert s.operands[0][0] == s.results[0][0] + s.results[0][1]  # merge: compound factor
    s = sig_of(lambda a: jnp.sort(a, axis=1), rnd(4, 6))
    assert s.operands[0][1][0] in s.need_replication and s.operands[0][0][0] not in s.need_replication
    s = sig_of(lambda a: a.sum(1), rnd(4, 6))
    assert s.operands[0][1][0] in s.reduction and s.linear == ((0,),)


def test_complex_values_and_ffts_plan_by_rule(mesh):
    """`complex` is pointwise and shards; an fft is replicated by rule (XLA's partitioner gathers
    its operand whatever is split), so neither falls back; a complex zero pad value used to crash
    pad's rule (float() of a complex), which fell back to replicated."""
    import warnings

    from shardsat.testing import check_collectives

    def f(x, y, w):
        z = jax.lax.complex(x, y)
        spec = jnp.fft.rfft(jnp.tanh(x @ w), axis=-1)
        padded = jnp.pad(z, ((0, 0), (1, 2)))
        return jnp.abs(z) * 2, jnp.abs(spec).sum(0), jnp.real(padded)

    args = (rnd(64, 32), rnd(64, 32, seed=1), rnd(32, 16, seed=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardsat.FallbackWarning)
        plan = shardsat.saturate_and_extract(f, mesh, *args)
    check_plan(plan, *args)
    check_collectives(plan, *args)
    assert plan.report.fallbacks == []


def test_ragged_dot_splits_its_free_and_contracted_dimensions(mesh):
    """lax.ragged_dot (an MoE's grouped product) and its gradients, which contract the ragged
    dimension: every strategy of every equation computes the same on shards, and the plan, its
    experts' hidden dimension split as Megatron's MLP (no ragged dot left replicated by
    fallback), matches jax.jit and predicts its collectives."""
    from shardsat.testing import check_collectives

    def step(w, w2, x, gs):
        def loss(w, w2):
            h = jax.nn.relu(jax.lax.ragged_dot(x, w, gs))
            return jnp.mean(jax.lax.ragged_dot(h, w2, gs) ** 2)
        g, g2 = jax.grad(loss, (0, 1))(w, w2)
        return w - 0.1 * g, w2 - 0.1 * g2

    small = (rnd(4, 16, 32) * 0.1, rnd(4, 32, 16, seed=1) * 0.1, rnd(64, 16, seed=2),
             jnp.array([10, 20, 30, 4], jnp.int32))
    # (gradients sum partial products that cancel: float32 ulps of their parts show at 1e-4; a
    # wrong rule is off by O(1))
    assert check_equation_rules(step, *small, mesh=mesh, max_strategies=2, rtol=1e-2) == []  # all: 44 s
    args = (rnd(4, 64, 256) * 0.05, rnd(4, 256, 64, seed=1) * 0.05, rnd(256, 64, seed=2),
            jnp.array([100, 50, 44, 62], jnp.int32))
    plan = shardsat.saturate_and_extract(step, mesh, *args)
    assert plan.report.fallbacks == []
    layouts = [plan.layout_of(e.outputs[0]) for e in plan.program.equations if e.name == "ragged_dot_general"]
    assert any(lay is not None and (lay.used_axes() or lay.partial) for lay in layouts)  # split, not replicated
    check_plan(plan, *args, rtol=1e-4)
    check_collectives(plan, *args)


def test_batched_linear_algebra_splits_its_batch(mesh):
    """Stacks of matrices (cholesky, eigh, qr, svd, lu, triangular_solve): every strategy computes
    the same on shards, and the plan splits the batch over the mesh, with no collective XLA does
    not run (they were replicated by fallback)."""
    from shardsat.testing import check_collectives

    def f(a, b):
        s = a @ jnp.swapaxes(a, -1, -2) + 8 * jnp.eye(a.shape[-1])
        c = jnp.linalg.cholesky(s)
        w, v = jnp.linalg.eigh(s)
        lu, piv, perm = jax.lax.linalg.lu(s)
        x = jax.scipy.linalg.solve_triangular(c, b, lower=True)
        return c, w, jnp.abs(v), jnp.abs(jnp.linalg.qr(a)[1]), jnp.linalg.svd(a, compute_uv=False), x, lu, piv, perm

    args = (rnd(16, 8, 8), rnd(16, 8, 4, seed=1))
    assert check_equation_rules(f, *args, mesh=mesh, max_strategies=2, rtol=1e-3) == []
    plan = shardsat.saturate_and_extract(f, mesh, *args)
    assert plan.report.fallbacks == []
    chol = next(e for e in plan.program.equations if e.name == "cholesky")
    assert plan.layout_of(chol.outputs[0]).spec(plan.axes)[0] is not None  # the batch is split
    check_plan(plan, *args, rtol=1e-4)
    check_collectives(plan, *args)


def test_eig_and_tridiagonal_solve_split_their_batch(mesh):
    """jnp.linalg.eig (CPU only) and lax.linalg.tridiagonal_solve on stacks were replicated by
    fallback; like the other batched library calls, XLA splits their batch with no collective."""
    from shardsat.testing import check_collectives

    def f(a, dl, d, du, b):
        w, v = jnp.linalg.eig(a)
        return jnp.abs(w), jnp.abs(v), jax.lax.linalg.tridiagonal_solve(dl, d, du, b)

    ones = np.ones((16, 7), np.float32)
    zero = np.zeros((16, 1), np.float32)
    args = (rnd(16, 6, 6), np.concatenate([zero, ones], 1), 5 + rnd(16, 8) * 0.1, np.concatenate([ones, zero], 1),
            rnd(16, 8, 3, seed=1))
    assert check_equation_rules(f, *args, mesh=mesh, rtol=1e-3) == []
    plan = shardsat.saturate_and_extract(f, mesh, *args)
    assert plan.report.fallbacks == []
    for e in plan.program.equations:
        if e.name in ("eig", "tridiagonal_solve"):
            assert plan.layout_of(e.outputs[0]).spec(plan.axes)[0] is not None, e.name  # the batch is split
    check_plan(plan, *args, rtol=1e-3)
    check_collectives(plan, *args)


def test_linear_solve_is_planned_through_its_solve_body(mesh):
    """`custom_linear_solve` (jnp.linalg.solve, scipy's cg) was replicated by fallback: its value
    is its solve body applied to the solve's constants and the right-hand side, which is now
    inlined, so a stack of solves and its gradient split by the batch as the lu under it does."""

    def f(a, b):
        return jnp.linalg.solve(a + 8 * jnp.eye(8), b)

    def step(a, b, m):
        grads = jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1))(a, b)
        x, _ = jax.scipy.sparse.linalg.cg(lambda v: (m @ m.T + 64 * jnp.eye(64)) @ v, b[0, :, 0].sum() + m[0],
                                          maxiter=10)
        return grads, x

    # a batch of 256 solves: at 16, replicating them beats the one all-gather a split plan needs
    # on CPU (XLA:CPU does not combine gathers, so it pays a whole latency)
    args = (rnd(256, 8, 8), rnd(256, 8, 1, seed=1), rnd(64, 64, seed=2))
    plan = shardsat.saturate_and_extract(step, mesh, *args)
    assert plan.report.fallbacks == []
    lus = [e for e in plan.program.equations if e.name == "lu"]
    assert lus and all(plan.layout_of(e.outputs[0]).spec(plan.axes)[0] is not None for e in lus)
    check_plan(plan, *args, rtol=1e-3)


def test_vmap_psum_and_a_users_reduce_are_split(mesh):
    """vmap's psum, pmax and pmin over its named axis (positional: per-example normalisation,
    a batch norm written with pmean) and lax.reduce with the user's combiner (max with its argmax):
    every strategy of each computes the same on shards, and neither is replicated by fallback."""

    def f(x, i):
        norm = jax.vmap(lambda r: r / jax.lax.psum(r.sum(), "b") + jax.lax.pmax(r, "b") - jax.lax.pmin(r, "b"),
                        axis_name="b")
        best = jax.lax.reduce((x, i), (-jnp.inf, 0), lambda a, b: (jnp.maximum(a[0], b[0]),
                                                                     jnp.where(a[0] >= b[0], a[1], b[1])), (1,))
        return norm(x), best

    args = (rnd(16, 8), jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (16, 8)))
    assert check_equation_rules(f, *args, mesh=mesh, rtol=1e-4, max_strategies=3) == []  # all: 17 s
    plan = shardsat.saturate_and_extract(f, mesh, *args, strict=True)
    assert plan.report.fallbacks == []
    check_plan(plan, *args, rtol=1e-4)
