"""User rewrites (shardsat.Rewrite): both sides in the e-graph, the cheaper one planned and run."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_equivalent

import shardsat
from shardsat.testing import RuleCheckError, check_rule

S = jax.ShapeDtypeStruct
F32 = jnp.float32
EX3 = (S((2, 3), F32), S((3, 4), F32), S((4, 5), F32))
LEFT = shardsat.Rewrite("matmul-left", lambda a, b, c: a @ (b @ c), lambda a, b, c: (a @ b) @ c, EX3)
RIGHT = shardsat.Rewrite("matmul-right", lambda a, b, c: (a @ b) @ c, lambda a, b, c: a @ (b @ c), EX3)


def low_rank(x, u, v):
    return jnp.tanh(x @ (u @ v))


def operands(batch, d=512, r=16):
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (batch, d)), jax.random.normal(k[1], (d, r)) / 20,
            jax.random.normal(k[2], (r, d)) / 4)


def dots_run(plan):
    """Result shapes of the matrix products the plan runs."""
    eqns = [plan.program.equations[r.eqn] for r in plan.runs]
    return [plan.program.values[e.outputs[0]].shape for e in eqns if e.name == "dot_general"]


def test_reassociation_is_planned_when_cheaper():
    args = operands(4096)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plain = shardsat.saturate_and_extract(low_rank, mesh, *args, profile="h100")
    plan = shardsat.saturate_and_extract(low_rank, mesh, *args, profile="h100", rules=[LEFT])
    assert plan.program.equivalences, "the rewrite matched nothing"
    assert plan.cost.total_s < plain.cost.total_s
    # the 512x512 product u @ v is never formed: x @ u (rank 16), then times v
    assert (512, 512) not in dots_run(plan)
    assert sorted(dots_run(plan)) == [(4096, 16), (4096, 512)]
    assert_equivalent(plan, low_rank, *args, rtol=1e-4)


def test_rewrite_not_taken_when_the_original_is_cheaper():
    def fn(x, u, v):
        return jnp.tanh((x @ u) @ v)

    args = operands(4096)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = shardsat.saturate_and_extract(fn, mesh, *args, profile="h100", rules=[RIGHT])
    assert plan.program.equivalences
    assert (512, 512) not in dots_run(plan)
    assert_equivalent(plan, fn, *args, rtol=1e-4)


def test_rewrites_apply_in_every_layer_and_to_their_own_results():
    # a chain of four: a second round reassociates a product the first round introduced
    def chain(x, a, b, c):
        return x @ (a @ (b @ c))

    k = jax.random.split(jax.random.key(1), 4)
    args = (jax.random.normal(k[0], (2048, 256)), jax.random.normal(k[1], (256, 8)) / 16,
            jax.random.normal(k[2], (8, 256)) / 3, jax.random.normal(k[3], (256, 256)) / 16)
    mesh = jax.make_mesh((8,), ("data",))
    plan = shardsat.saturate_and_extract(chain, mesh, *args, profile="h100", rules=[LEFT])
    assert len(plan.program.equivalences) >= 2
    assert len(dots_run(plan)) == 3
    assert max(m * n for m, n in dots_run(plan)) <= 2048 * 256
    assert_equivalent(plan, chain, *args, rtol=1e-4)


def test_check_rule_on_rewrites():
    check_rule(LEFT, max_examples=6)
    wrong = shardsat.Rewrite("transpose-swap", lambda a, b: a @ b, lambda a, b: (b.T @ a.T).T * 1.001,
                             (S((2, 3), F32), S((3, 4), F32)))
    with pytest.raises(RuleCheckError, match="transpose-swap"):
        check_rule(wrong)


def test_check_rule_matches_nans_where_both_sides_have_them():
    """`log a + log a == 2 log a` holds everywhere, NaN on both sides for a < 0 (operands are
    standard normal), and passes; `exp(2 log a) == a * a` holds for a > 0 only and is named with
    the entry where the lhs is NaN and the rhs is not (both read "relative error nan" before)."""
    a = (S((4, 4), F32),)
    check_rule(shardsat.Rewrite("log-twice", lambda x: jnp.log(x) + jnp.log(x), lambda x: 2 * jnp.log(x), a),
               max_examples=4)
    domain = shardsat.Rewrite("exp-log", lambda x: jnp.exp(2 * jnp.log(x)), lambda x: x * x, a)
    with pytest.raises(RuleCheckError, match=r"exp-log.*lhs gives nan and rhs"):
        check_rule(domain, max_examples=4)


def test_bad_rewrites_are_rejected():
    mesh = jax.make_mesh((8,), ("data",))
    args = operands(64)
    shape_changing = shardsat.Rewrite("bad", lambda a, b, c: a @ (b @ c), lambda a, b, c: (a @ b), EX3)
    with pytest.raises(shardsat.InvalidArgumentError, match="bad"):
        shardsat.saturate_and_extract(low_rank, mesh, *args, rules=[shape_changing])


def test_rewrites_in_folded_layers():
    # a match in every layer keeps the layers periodic: they fold, and the replayed layers run the
    # chosen side of the rewrite
    def net(ps, x):
        for u, v in ps:
            x = x + jnp.tanh(x @ (u @ v))
        return x.sum()

    k = jax.random.split(jax.random.key(2), 13)
    ps = [(jax.random.normal(k[2 * i], (256, 8)) / 16, jax.random.normal(k[2 * i + 1], (8, 256)) / 3)
          for i in range(6)]
    x = jax.random.normal(k[12], (1024, 256))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = shardsat.saturate_and_extract(net, mesh, ps, x, profile="h100", rules=[LEFT], fold_loops=True)
    assert plan.program.scans and len(plan.program.equivalences) == 6
    assert (256, 256) not in dots_run(plan)
    assert_equivalent(plan, net, ps, x, rtol=1e-4)


def test_a_rewrite_and_its_inverse_plan_a_program_that_runs():
    """Regression: with `a @ (b @ c) -> (a @ b) @ c` and its inverse, the two sides of a rewrite
    were equations of one kind, `(x @ a) @ b` and `x @ (a @ b)`; lowering ran the first while the
    plan computed the second, and `x @ a` was never made (KeyError at plan.jit()). The equation
    run is now the one reading what the plan's production reads."""
    e3 = (jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((3, 4), jnp.float32),
          jax.ShapeDtypeStruct((4, 5), jnp.float32))
    left = shardsat.Rewrite("left_assoc", lambda a, b, c: a @ (b @ c), lambda a, b, c: (a @ b) @ c, example_args=e3)
    right = shardsat.Rewrite("right_assoc", lambda a, b, c: (a @ b) @ c, lambda a, b, c: a @ (b @ c), example_args=e3)

    def chain(x, a, b, c):
        return x @ (a @ (b @ c))

    k = jax.random.split(jax.random.key(0), 4)
    args = (jax.random.normal(k[0], (128, 64)), jax.random.normal(k[1], (64, 64)) / 8,
            jax.random.normal(k[2], (64, 4)) / 8, jax.random.normal(k[3], (4, 64)) / 2)
    for rules in ([left, right], [right, left]):
        plan = shardsat.saturate_and_extract(chain, jax.make_mesh((2, 4), ("data", "model")), *args, rules=rules)
        assert_equivalent(plan, chain, *args, rtol=1e-4)


@pytest.mark.parametrize("rhs, words", [
    (lambda a: a.T * 2.0, "its lhs gives float32[32, 16] there, its rhs float32[16, 32]"),
    (lambda a: a + a * jnp.ones((4, 4)), "its rhs fails on them: TypeError"),
])
def test_a_rewrite_whose_rhs_fits_only_its_examples_is_named(rhs, words):
    """Regression: an rhs right on square example_args but not on the (32, 16) match panicked
    inside egglog (an illegal merge), and one that fails to trace there raised the user's raw
    error; both are an InvalidArgumentError naming the rewrite and the operand shapes."""
    rw = shardsat.Rewrite("square_only", lambda a: a * 2.0, rhs,
                          example_args=(jax.ShapeDtypeStruct((4, 4), jnp.float32),))
    with pytest.raises(shardsat.InvalidArgumentError, match=r"Rewrite `square_only` matched at operand shapes \[\(32, 16\)\]") as e:
        shardsat.saturate_and_extract(lambda a: jnp.sin(a * 2.0), jax.make_mesh((2, 4), ("data", "model")),
                                      jnp.ones((32, 16)), rules=[rw])
    assert words in str(e.value)
