"""`jax.experimental.custom_partitioning` functions: their sharding_rule (or a signature
registered for them) is read like a built-in rule, and the plan's layouts reach the user's
partition callback."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardsat
from shardsat.egraph.keys import program_key
from shardsat.egraph.program import trace
from shardsat.rules.apply import _eqn_types, signature_for
from shardsat.testing import RuleCheckError, check_plan, check_rule

SEEN: list[tuple[P, ...]] = []  # operand specs each partition callback was called with


def _record(arg_shapes):
    SEEN.append(tuple(a.sharding.spec for a in arg_shapes))
    return tuple(a.sharding for a in arg_shapes)


def mm_tanh_impl(x, w):
    return jnp.tanh(x @ w)


def mm_tanh_partition(mesh, arg_shapes, result_shape):
    return mesh, mm_tanh_impl, result_shape.sharding, _record(arg_shapes)


@custom_partitioning
def mm_tanh(x, w):
    return mm_tanh_impl(x, w)


mm_tanh.def_partition(partition=mm_tanh_partition, sharding_rule="b k, k n -> b n", reduction_factors=("k",))


def mm_sigmoid_partition(mesh, arg_shapes, result_shape):
    return mesh, mm_tanh_impl, result_shape.sharding, _record(arg_shapes)


@custom_partitioning
def mm_sigmoid(x, w):  # same body as mm_tanh, another function (its key must differ)
    return mm_tanh_impl(x, w)


mm_sigmoid.def_partition(partition=mm_sigmoid_partition, sharding_rule="b k, k n -> b n", reduction_factors=("k",))


def norm_impl(x):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def norm_partition(mesh, arg_shapes, result_shape):
    return mesh, norm_impl, result_shape.sharding, _record(arg_shapes)


@custom_partitioning
def norm_no_rule(x):
    return norm_impl(x)


norm_no_rule.def_partition(partition=norm_partition)


def model(p, x):
    h = mm_tanh(x, p["w1"])
    return h @ p["w2"]


def params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return ({"w1": jax.random.normal(k1, (64, 256)), "w2": jax.random.normal(k2, (256, 64))},
            jax.random.normal(k3, (32, 64)))


def mesh24(kind=AxisType.Explicit):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))


def _norm(spec, rank):
    entries = list(spec) + [None] * (rank - len(spec))
    return tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else (e or None) for e in entries)


def cp_operand_specs(plan):
    """The plan's operand layouts of each custom_partitioning equation, as spec tuples."""
    out = []
    for r in plan.runs:
        eqn = plan.program.equations[r.eqn]
        if eqn.name == "custom_partitioning":
            ranks = [plan.program.values[a].shape for a in eqn.inputs]
            out.append(tuple(_norm(plan.layouts[lid].spec(plan.axes), len(s))
                             for lid, s in zip(r.operand_layouts, ranks, strict=True)))
    return out


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_rule_is_read_and_callback_gets_the_plans_layouts(kind):
    p, x = params()
    plan = shardsat.saturate_and_extract(model, mesh24(kind), p, x)
    SEEN.clear()
    check_plan(plan, p, x)
    want = cp_operand_specs(plan)
    got = [tuple(_norm(s, 2) for s in specs) for specs in SEEN]
    assert got == want, (got, want)
    assert any(d is not None for specs in got for s in specs for d in s), "no operand was sharded"
    assert "custom_partitioning" in plan.explain()


def test_reduction_factor_is_kept_whole():
    p, x = params()
    prog = trace(model, (p, x))
    eqn = next(e for e in prog.equations if e.name == "custom_partitioning")
    sig, fell_back = signature_for(eqn, _eqn_types(prog, eqn), None)
    assert not fell_back and not sig.reduction and not sig.linear
    k = sig.operands[0][1][0]
    assert k == sig.operands[1][0][0] and k in sig.need_replication
    assert sig.flops == 2 * 32 * 256 * 64 + 32 * 256  # dot_general and tanh of the call jaxpr
    # x arrives split along k: the plan gathers it, the callback sees k whole
    plan = shardsat.saturate_and_extract(model, mesh24(), p, x, in_shardings=(None, P(None, "model")))
    SEEN.clear()
    check_plan(plan, p, x)
    assert SEEN and all(_norm(specs[0], 2)[1] is None and _norm(specs[1], 2)[0] is None for specs in SEEN)


def test_rule_forms_compound_ellipsis_size_one_and_special_factors():
    def part(mesh, arg_shapes, result_shape):
        return mesh, lambda x, s: x, result_shape.sharding, _record(arg_shapes)

    @custom_partitioning
    def f(x, s):
        return x * s.sum()

    f.def_partition(partition=part, sharding_rule="... (a c) o, t -> ... (a c) o", a=2, c=4,
                    permutation_factors=("a",), need_replication_factors=("t",))
    prog = trace(f, (jnp.ones((3, 8, 1)), jnp.ones((5,))))
    eqn = prog.equations[0]
    sig, _ = signature_for(eqn, _eqn_types(prog, eqn), None)
    b = sig.operands[0][0]
    assert b == sig.results[0][0] and b[0].startswith("_batch")
    assert sig.operands[0][1] == ("a", "c") and sig.sizes["a"] == 2 and sig.sizes["c"] == 4
    assert sig.operands[0][2] == () and "o" not in sig.sizes  # size-1 factor dropped
    assert sig.need_replication == {"a", "t"}


def test_function_without_rule_errors_with_suggestion_or_falls_back():
    def f(x):
        return norm_no_rule(x) * 2.0

    x = jax.random.normal(jax.random.key(1), (16, 64))
    with pytest.raises(shardsat.UnsupportedPrimitiveError) as e:
        shardsat.saturate_and_extract(f, mesh24(), x, strict=True)
    msg = str(e.value)
    assert "norm_no_rule" in msg and "norm_partition" in msg
    assert 'sharding_rule="..."' in msg and "register_signature(fn" in msg
    with pytest.warns(shardsat.FallbackWarning, match="norm_no_rule"):
        plan = shardsat.saturate_and_extract(f, mesh24(), x)
    assert any("custom_partitioning" in fb for fb in plan.report.fallbacks)
    check_plan(plan, x)


def test_register_signature_on_custom_partitioning_function():
    @custom_partitioning
    def fresh(x):
        return x

    with pytest.raises(shardsat.InvalidSignatureError, match="def_partition"):
        shardsat.register_signature(fresh, "b d -> b d")

    def f(x):
        return jnp.tanh(norm_no_rule(x) @ jnp.ones((64, 64)))

    x = jax.random.normal(jax.random.key(1), (16, 64))
    try:
        wrong = shardsat.register_signature(norm_no_rule, "b d -> b d")  # d is normalised over
        with pytest.raises(RuleCheckError, match="relative error"):
            check_rule(wrong, max_examples=3, max_strategies=4, meshes=((2, 4),), sizes=(2, 8))
        rule = shardsat.register_signature(norm_no_rule, "b d -> b d", need_replication_factors=("d",))
        assert rule.name == "norm_no_rule"
        check_rule(rule, max_examples=3, max_strategies=4, meshes=((2, 4),), sizes=(2, 8))
        plan = shardsat.saturate_and_extract(f, mesh24(), x)
        assert not plan.report.fallbacks
        SEEN.clear()
        check_plan(plan, x)
        assert SEEN and all(_norm(specs[0], 2)[1] is None for specs in SEEN)  # d whole
        # a registered signature replaces the function's own sharding_rule
        # (its reduction factors stay whole: the callback returns complete results)
        shardsat.register_signature(mm_tanh, "b k, k n -> b n", need_replication_factors=("b",),
                                    reduction_factors=("k",), linear=[(0,)])
        prog = trace(model, params())
        eqn = next(e for e in prog.equations if e.name == "custom_partitioning")
        sig, _ = signature_for(eqn, _eqn_types(prog, eqn), None)
        assert sig.need_replication == {"b", "k"} and not sig.reduction and not sig.linear
        assert sig.flops == 2 * 32 * 256 * 64 + 32 * 256
    finally:
        from shardsat.rules.custom import FUNCTION_RULES

        FUNCTION_RULES.pop(norm_no_rule.partition, None)
        FUNCTION_RULES.pop(mm_tanh.partition, None)


def two_layers(p, x):
    h = mm_tanh(x, p["w1"])
    g = mm_tanh(x, p["w1"])  # the same call again: one key
    return h + g + mm_sigmoid(x, p["w1"])  # same body and types, another function


def keys_of_two_layers() -> list[str]:
    p, x = params()
    prog = trace(two_layers, (p, x))
    return [program_key(prog, e) for e in prog.equations if e.name == "custom_partitioning"]


def test_keys_are_deterministic_and_tell_functions_apart():
    keys = keys_of_two_layers()
    assert keys == keys_of_two_layers()
    assert keys[0] == keys[1] != keys[2] and "@" not in keys[0]
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import {Path(__file__).stem} as t; print(t.keys_of_two_layers())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(keys)


def test_repeated_layers_fold_and_every_repeat_gets_the_plans_layouts():
    def deep(ws, x):
        for w in ws:
            x = mm_tanh(x, w) + x
        return x

    k = jax.random.key(2)
    ws = [jax.random.normal(jax.random.fold_in(k, i), (64, 64)) * 0.1 for i in range(6)]
    x = jax.random.normal(k, (32, 64))
    plan = shardsat.saturate_and_extract(deep, mesh24(), ws, x, fold_loops=True)
    assert [s.folded for s in plan.program.scans] == [True]  # equal keys: one planned layer
    SEEN.clear()
    check_plan(plan, ws, x)
    want = cp_operand_specs(plan)
    assert len(SEEN) == 6 and {tuple(_norm(s, 2) for s in specs) for specs in SEEN} == set(want)
