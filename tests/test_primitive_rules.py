"""PrimitiveRule: one registered object per primitive. The built-in flags must match the tables
they replaced (written out below from those tables: a lost entry fails), and the flags a user
sets through register_signature must reach the stages that read them."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import shardsat
from shardsat.egraph.layout import MeshAxes, SpaceTable
from shardsat.egraph.program import trace
from shardsat.extract import fusion
from shardsat.extract.cost import CostModel
from shardsat.extract.profile import get_profile
from shardsat.extract.structure import heavy_roles
from shardsat.rules import SIGNATURES, UNSUPPORTED, PrimitiveRule, rule_for
from shardsat.rules import indexing as ix
from shardsat.rules import primitives as p
from shardsat.rules import windowed as w
from shardsat.rules.apply import build_tables
from shardsat.rules.primitives import EqnTypes
from shardsat.rules.rule import Fuse
from shardsat.runtime.local import local_params

# ---- the former tables, as they stood (rules/primitives.py ELEMENTWISE, _ADDITIVE, _UNARY_LINEAR;
# extract/cost.py FUSIBLE; extract/structure.py HEAVY; runtime/local.py LOCALIZE; rules/apply.py
# CONSTRAINTS and runtime/lower.py PINS; the scan_stack case of extract/cost.py)
OLD_ELEMENTWISE = [
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "clz", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq",
    "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma", "igammac", "imag",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne",
    "neg", "nextafter", "not", "or", "population_count", "pow", "real", "reduce_precision", "rem", "round",
    "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh",
    "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "eq_to", "le_to", "lt_to", "bessel_i0e",
    "bessel_i1e", "polygamma", "zeta", "regularized_incomplete_beta", "random_gamma_grad", "threefry2x32",
    "sharding_constraint", "device_put",
]
OLD_ADDITIVE = {"add", "sub", "add_any"}
# (the old list also named "reduce_precision_linear", which had no builder: never reached)
OLD_UNARY_LINEAR = {"neg", "copy", "copy_p", "real", "imag", "conj", "stop_gradient", "sharding_constraint",
                    "device_put", "reshard"}
OLD_FUSIBLE = frozenset(OLD_ELEMENTWISE) | {
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "iota", "slice", "pad",
    "concatenate", "rev", "dynamic_slice", "dynamic_update_slice", "split", "clamp", "bitcast_convert_type",
    "scan_slice", "scan_final",
}
OLD_HEAVY = {"dot_general", "conv_general_dilated"}
OLD_LOCALIZE = {"broadcast_in_dim": ("shape", "result"), "reshape": ("new_sizes", "result"),
                "iota": ("shape", "result"), "slice": ("limit_indices", "operand"),
                "dynamic_slice": ("slice_sizes", "operand"), "gather": ("slice_sizes", "operand")}
OLD_PINS = {"sharding_constraint": "sharding", "reshard": "dst_sharding"}
OLD_SLOT = {"scan_stack"}
# extract/fusion.py: CHEAP, EXPENSIVE, REDUCE, "gather", INPLACE, INPLACE_OPAQUE, REREADS
OLD_CHEAP = {
    "add", "add_any", "sub", "mul", "neg", "max", "min", "select_n", "convert_element_type", "eq",
    "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "abs", "sign", "floor", "ceil", "round",
    "is_finite", "copy", "copy_p", "square", "clamp", "nextafter", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "clz", "reduce_precision", "real", "imag", "conj",
    "complex", "bitcast_convert_type", "integer_pow", "stop_gradient", "sharding_constraint",
    "device_put", "reshard", "empty", "empty2", "broadcast_in_dim", "reshape", "squeeze",
    "expand_dims", "iota", "slice", "pad", "concatenate", "rev", "dynamic_slice", "transpose",
    "split", "stack", "unstack", "tile", "scan_slice", "sin", "cos", "eq_to", "le_to", "lt_to",
}
OLD_EXPENSIVE = {
    "div", "rem", "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "sqrt", "rsqrt", "cbrt",
    "pow", "erf", "erfc", "erf_inv", "atan2", "tan", "asin", "acos", "atan", "asinh", "acosh", "atanh",
    "sinh", "cosh", "lgamma", "digamma", "igamma", "igammac", "bessel_i0e", "bessel_i1e", "polygamma",
    "zeta", "regularized_incomplete_beta", "random_gamma_grad", "threefry2x32",
}
OLD_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
              "argmax", "argmin"}
OLD_INPLACE = {"dynamic_update_slice", "scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min",
               "scatter_max", "scatter_sub", "scatter_apply"}
OLD_INPLACE_OPAQUE = {"sort"}
OLD_REREADS = {"broadcast_in_dim", "pad", "concatenate", "tile"}


def _old_fuse(name: str) -> Fuse:
    """The old extract/fusion.py `kind`, by name."""
    if name in OLD_CHEAP:
        return Fuse.CHEAP
    if name in OLD_EXPENSIVE:
        return Fuse.EXPENSIVE
    if name in OLD_REDUCE:
        return Fuse.REDUCE
    if name == "gather":
        return Fuse.GATHER
    if name in OLD_INPLACE or name.startswith("scatter"):
        return Fuse.INPLACE
    return Fuse.OPAQUE


OLD_SIGNATURES = {name: p.elementwise for name in OLD_ELEMENTWISE}
OLD_SIGNATURES.update({
    "dot_general": p.dot_general, "reduce_sum": p.reduce_sum, "reduce_max": p.reduce_other,
    "reduce_min": p.reduce_other, "reduce_prod": p.reduce_other, "reduce_and": p.reduce_other,
    "reduce_or": p.reduce_other, "reduce_xor": p.reduce_other, "argmax": p.argminmax, "argmin": p.argminmax,
    "cumsum": p.cumulative, "cumprod": p.cumulative, "cummax": p.cumulative, "cummin": p.cumulative,
    "cumlogsumexp": p.cumulative, "broadcast_in_dim": p.broadcast_in_dim, "transpose": p.transpose,
    "reshape": p.reshape, "squeeze": p.squeeze, "expand_dims": p.expand_dims, "iota": p.iota,
    "slice": p.slice_, "pad": p.pad, "dynamic_slice": p.dynamic_slice,
    "dynamic_update_slice": p.dynamic_update_slice, "concatenate": p.concatenate, "stack": p.stack,
    "unstack": p.unstack, "tile": p.tile, "optimization_barrier": p.optimization_barrier, "rev": p.rev,
    "sort": p.sort, "top_k": p.top_k, "split": p.split, "clamp": p.clamp,
    "bitcast_convert_type": p.bitcast_convert_type, "reshard": p.elementwise, "empty": p.elementwise,
    "empty2": p.elementwise, "scan_slice": p.scan_slice, "scan_stack": p.scan_stack, "scan_final": p.elementwise,
    "cond_merge": p.cond_merge, "random_bits": p.replicated, "random_seed": p.replicated,
    "random_wrap": p.replicated, "random_unwrap": p.replicated, "random_split": p.replicated,
    "random_fold_in": p.replicated, "gather": ix.gather,
    **{name: ix.scatter for name in ("scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter_sub",
                                     "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
                                     "scatter_max")},
    "conv_general_dilated": w.conv_general_dilated, "reduce_window_sum": w.reduce_window_sum,
    "reduce_window_max": w.reduce_window_other, "reduce_window_min": w.reduce_window_other,
    "reduce_window": w.reduce_window_other, "select_and_scatter_add": w.select_and_scatter_add,
    "select_and_scatter": w.select_and_scatter, "select_and_gather_add": w.select_and_gather_add,
    **{name: p.replicated for name in ("pure_callback", "io_callback", "debug_callback", "debug_print")},
})
OLD_UNSUPPORTED = {
    "while": "a loop with side effects and no results runs as one replicated equation",
    "cond": "a cond with side effects and no results runs as one replicated equation",
    "shard_map": "the function is already manually partitioned",
    "xla_pmap": "pmap is already manually partitioned",
    "rng_bit_generator": "stateful RNG is not partitioned yet",
}
ALL_OLD = (set(OLD_SIGNATURES) | set(OLD_UNSUPPORTED) | OLD_FUSIBLE | OLD_HEAVY | set(OLD_LOCALIZE)
           | set(OLD_PINS) | OLD_ADDITIVE | OLD_UNARY_LINEAR | OLD_CHEAP | OLD_EXPENSIVE | OLD_REDUCE
           | OLD_INPLACE | OLD_INPLACE_OPAQUE | OLD_REREADS)

# ---- rules changed or added since those tables, each by its own commit: `complex` (real and
# imaginary parts zipped) got the elementwise signature it lacked (it was known to fusion only);
# `fft` is replicated by rule (XLA's partitioner all-gathers its operand whatever is split);
# `ragged_dot_general` (lax.ragged_dot) got a signature and is heavy, as dot_general
OLD_SIGNATURES |= {"complex": p.elementwise, "fft": p.replicated, "ragged_dot_general": p.ragged_dot_general}
OLD_ELEMENTWISE = [*OLD_ELEMENTWISE, "complex"]
OLD_FUSIBLE = OLD_FUSIBLE | {"complex"}
OLD_HEAVY = OLD_HEAVY | {"ragged_dot_general"}
ALL_OLD = ALL_OLD | {"fft", "ragged_dot_general"}
# the batched linear algebra (cholesky, eigh, qr, svd, lu, triangular_solve, ...) got one
# signature: batch dimensions split, each matrix whole (it was replicated by fallback)
OLD_SIGNATURES |= {name: p.batched_linalg for name in p.LINALG_CORE}
ALL_OLD = ALL_OLD | set(p.LINALG_CORE)
# lax.approx_max_k is planned as top_k, and random_gamma (its key is PRNG plumbing) replicated by
# rule, as the other key consumers (both were replicated by fallback, with a warning)
OLD_SIGNATURES |= {"approx_top_k": p.top_k, "random_gamma": p.replicated, "platform_index": p.replicated}
ALL_OLD = ALL_OLD | {"approx_top_k", "random_gamma", "platform_index"}
# igamma_grad_a (the gradient of lax.igamma in its first argument) is elementwise and expensive
OLD_SIGNATURES |= {"igamma_grad_a": p.elementwise}
OLD_ELEMENTWISE = [*OLD_ELEMENTWISE, "igamma_grad_a"]
OLD_FUSIBLE = OLD_FUSIBLE | {"igamma_grad_a"}
OLD_EXPENSIVE = OLD_EXPENSIVE | {"igamma_grad_a"}
# device_put of values of other shapes is an identity on each (the elementwise signature cannot
# pair them); of one shape, elementwise as before
OLD_SIGNATURES |= {"device_put": p.device_put}
ALL_OLD = ALL_OLD | {"igamma_grad_a"}
# vmap's psum, pmax and pmin over its named axis (positional axes) are reductions, and
# lax.reduce with a user's combiner keeps its reduced dimensions whole (all were fallbacks)
OLD_SIGNATURES |= {"psum": p.positional_collective, "pmax": p.positional_collective,
                   "pmin": p.positional_collective, "reduce": p.reduce_generic}
OLD_REDUCE = OLD_REDUCE | {"psum", "pmax", "pmin", "reduce"}
ALL_OLD = ALL_OLD | {"psum", "pmax", "pmin", "reduce"}
# random_bits is drawn split where the generator is partitionable threefry (replicated otherwise)
OLD_SIGNATURES |= {"random_bits": p.random_bits}


def _old_linear(name: str, t: EqnTypes) -> tuple[tuple[int, ...], ...]:
    """The old rules/primitives.py `_linear_groups` (applied by the elementwise builder only)."""
    if OLD_SIGNATURES.get(name) is not p.elementwise:
        return ()
    n = len(t.in_shapes)
    if name in OLD_ADDITIVE:
        return (tuple(range(n)),)
    if name in OLD_UNARY_LINEAR:
        return ((0,),)
    if name == "convert_element_type":
        return ((0,),) if np.dtype(t.out_dtypes[0]).kind == "f" and np.dtype(t.in_dtypes[0]) != bool else ()
    return {"mul": ((0,), (1,)), "div": ((0,),), "select_n": (tuple(range(1, n)),)}.get(name, ())


def _types(name: str, n: int, in_dtype: str = "float32", out_dtype: str = "float32") -> EqnTypes:
    return EqnTypes(name, {}, ((4, 8),) * n, (np.dtype(in_dtype),) * n, ((4, 8),), (np.dtype(out_dtype),),
                    (False,) * n)


@pytest.mark.parametrize("name", sorted(ALL_OLD))
def test_every_old_table_entry_has_a_rule_with_the_same_flags(name):
    rule = rule_for(name)
    assert rule.name == name
    assert rule.builder is OLD_SIGNATURES.get(name)
    assert rule.unsupported == OLD_UNSUPPORTED.get(name)
    assert rule.elementwise == (name in OLD_ELEMENTWISE)
    assert rule.fusible == (name in OLD_FUSIBLE)
    assert rule.heavy == (name in OLD_HEAVY)
    assert rule.writes_slot == (name in OLD_SLOT)
    assert rule.pin == OLD_PINS.get(name)
    assert (rule.localize is None) == (name not in OLD_LOCALIZE)
    assert rule.sorts_in_place == (name in OLD_INPLACE_OPAQUE)
    assert rule.rereads == (name in OLD_REREADS)
    eqn = SimpleNamespace(name=name, primitive=Primitive(name))  # not the registered object: found by name
    assert fusion.kind(eqn) == _old_fuse(name)  # type: ignore[arg-type]
    if rule.builder is p.elementwise:
        for n, din, dout in ((1, "float32", "float32"), (2, "float32", "float32"), (3, "int32", "float32"),
                             (1, "bool", "float32"), (1, "float32", "int32")):
            t = _types(name, n, din, dout)
            got = () if rule.linear is None else rule.linear(t)
            assert got == _old_linear(name, t), (name, n, din, dout)


def test_no_rule_beyond_the_old_tables_has_flags():
    """Every registered built-in came from the old tables (none was invented on the way)."""
    from shardsat.rules.registry import _BUILTIN

    assert {r.name for r in _BUILTIN} == ALL_OLD


@pytest.mark.parametrize("name", sorted(OLD_LOCALIZE))
def test_localizers_rewrite_the_same_param(name):
    param, which = OLD_LOCALIZE[name]
    ins = [((8, 6), (4, 6))]
    outs = [((8, 6), (4, 3))]
    got = local_params(name, {param: (8, 6)}, ins, outs)
    assert got[param] == ((4, 3) if which == "result" else (4, 6))


def test_legacy_views_read_and_write_the_registry():
    assert "dot_general" in SIGNATURES and "while" in UNSUPPORTED and "while" not in SIGNATURES
    prim = Primitive("legacy_view_prim")
    assert rule_for(prim).builder is None  # looked up (and remembered) before it is registered
    SIGNATURES[prim.name] = p.elementwise
    assert rule_for(prim).builder is p.elementwise
    SIGNATURES.pop(prim.name)
    assert rule_for(prim).builder is None and prim.name not in SIGNATURES


def _user_prim(name: str) -> Primitive:
    prim = Primitive(name)
    prim.def_impl(lambda x: x * 2.0)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    return prim


def _local_bytes(prim: Primitive) -> float:
    """Bytes the cost model charges the primitive's equation (replicated strategy aside: any)."""
    prog = trace(lambda x: jnp.tanh(prim.bind(x)), [jnp.ones((64, 128))])
    spaces = SpaceTable(MeshAxes(("x", "y"), (2, 4)))
    tables = build_tables(prog, spaces, "error")
    eqn = next(e for e in prog.equations if e.primitive is prim)
    model = CostModel(get_profile("h100"), spaces, tables)
    return model.local_work(tables.output_key[eqn.outputs[0]], 0)[2]


def test_user_flags_reach_the_cost_model_and_structure():
    plain, fused = _user_prim("rule_plain_p"), _user_prim("rule_fused_p")
    shardsat.register_signature(plain, "a b -> a b")
    shardsat.register_signature(fused, "a b -> a b", fusible=True, heavy=True, elementwise=True, fuse="expensive",
                                rereads=True, sorts_in_place=True)
    assert not rule_for(plain).fusible and rule_for(fused).fusible and rule_for(fused).elementwise
    eqn = SimpleNamespace(name=fused.name, primitive=fused)
    assert fusion.kind(eqn) == Fuse.EXPENSIVE and fusion.in_place(eqn)  # type: ignore[arg-type]
    assert rule_for(fused).rereads and rule_for(plain).fuse == Fuse.OPAQUE
    # fusible: charged for its result only (half of reading the operand and writing the result)
    assert _local_bytes(fused) == pytest.approx(_local_bytes(plain) / 2)
    prog = trace(lambda x: jnp.tanh(fused.bind(x)), [jnp.ones((64, 128))])
    before, after = heavy_roles(prog)
    assert before[0] and after[prog.outputs[0]]  # a contraction now: the input feeds it
    # a later registration keeps the flags it does not set
    shardsat.register_signature(fused, "a b -> a b", need_replication_factors=("b",))
    assert rule_for(fused).fusible and rule_for(fused).heavy


def test_unknown_scatter_variants_update_in_place():
    eqn = SimpleNamespace(name="scatter-something", primitive=Primitive("scatter-something"))
    assert fusion.kind(eqn) == Fuse.INPLACE  # type: ignore[arg-type]


def test_user_flags_reach_localisation_and_pins():
    prim = _user_prim("rule_sized_p")

    def localize(params, ins, outs):
        return {**params, "n": outs[0][1][0]}

    shardsat.register_signature(prim, "a b -> a b", localize=localize, pin="where")
    assert local_params(prim, {"n": 8}, [((8, 2), (4, 2))], [((8, 2), (4, 2))]) == {"n": 4}
    assert rule_for(prim).pin == "where"
    # found by the Primitive object first: another primitive of the same name keeps its own rule
    other = Primitive("rule_sized_p")
    shardsat.register_signature(other, "a -> a")
    assert rule_for(prim).localize is localize and rule_for(other).pin == "where"  # kept by name
    with pytest.raises(shardsat.InvalidArgumentError, match="fusible must be"):
        shardsat.register_signature(prim, "a b -> a b", fusible="yes")
    with pytest.raises(shardsat.InvalidArgumentError, match="fuse must be"):
        shardsat.register_signature(prim, "a b -> a b", fuse="sometimes")


def test_a_rule_linearity_reaches_the_signature():
    """A rule's `linear` (a function of the equation's types) is what the pending sums see."""
    rule = PrimitiveRule("rule_linear_p", p.elementwise, linear=lambda t: ((0,),))
    sig = rule.signature(_types("rule_linear_p", 1))
    assert sig.linear == ((0,),)
    assert PrimitiveRule("rule_linear_p", p.elementwise).signature(_types("rule_linear_p", 1)).linear == ()
