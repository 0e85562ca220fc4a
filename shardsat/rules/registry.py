"""The primitive registry: one `PrimitiveRule` per primitive, found by the `Primitive` object or,
failing that, by its name. A rule has a signature builder, a listed reason it is unsupported, or
neither (unknown): three outcomes kept apart, as in Shardy's op_sharding_rule_registry.

Adding a built-in primitive is one entry in `_BUILTIN` below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping
from typing import Any

from . import indexing as ix
from . import primitives as p
from . import windowed as w
from .rule import (
    Fuse,
    LinearFn,
    PrimitiveRule,
    all_operands,
    each_operand,
    first_operand,
    float_convert,
    operand_sizes,
    result_shape,
    select_cases,
)


def _ew(name: str, linear: LinearFn | None = None, **kw: Any) -> PrimitiveRule:
    """Pointwise arithmetic: the elementwise signature, fused by XLA."""
    kw.setdefault("fuse", Fuse.CHEAP)
    return PrimitiveRule(name, kw.pop("builder", p.elementwise), linear=linear, elementwise=True, fusible=True, **kw)


def _op(name: str, builder: p.Builder, **kw: Any) -> PrimitiveRule:
    return PrimitiveRule(name, builder, **kw)


def _replicated(name: str) -> PrimitiveRule:
    return PrimitiveRule(name, p.replicated)


# pointwise ops XLA duplicates into every reader
_CHEAP = (
    "abs", "and", "ceil", "clz", "cos", "eq", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "lt",
    "max", "min", "ne", "nextafter", "not", "or", "population_count", "reduce_precision", "round",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "square", "xor", "eq_to",
    "le_to", "lt_to",
)
# pointwise ops XLA stores when several kernels read them (InstructionFusion::IsExpensive)
_EXPENSIVE = (
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "cosh", "digamma", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "igamma", "igammac", "lgamma", "log", "log1p", "logistic", "pow", "rem",
    "rsqrt", "sinh", "sqrt", "tan", "tanh", "bessel_i0e", "bessel_i1e", "polygamma", "zeta",
    "regularized_incomplete_beta", "random_gamma_grad", "threefry2x32", "igamma_grad_a",
)

_BUILTIN: list[PrimitiveRule] = [
    # ---- elementwise (linear ones pass a pending partial sum through)
    *(_ew(name) for name in _CHEAP),
    *(_ew(name, fuse=Fuse.EXPENSIVE) for name in _EXPENSIVE),
    *(_ew(name, all_operands) for name in ("add", "add_any", "sub")),
    *(_ew(name, first_operand) for name in ("neg", "copy", "copy_p", "real", "imag", "conj", "stop_gradient")),
    _ew("device_put", first_operand, builder=p.device_put),
    _ew("complex"),  # real and imaginary parts zipped: pointwise, a pending sum not passed through
    _ew("div", first_operand, fuse=Fuse.EXPENSIVE),
    _ew("mul", each_operand),
    _ew("select_n", select_cases),
    _ew("convert_element_type", float_convert),
    _ew("clamp", builder=p.clamp),
    _ew("sharding_constraint", first_operand, pin="sharding"),  # a user's layout pin
    # reshard: a user's layout pin too (rules/apply.py keeps its layout)
    _op("reshard", p.elementwise, linear=first_operand, pin="dst_sharding", fuse=Fuse.CHEAP),
    # ---- contractions and reductions
    _op("dot_general", p.dot_general, heavy=True),
    _op("ragged_dot_general", p.ragged_dot_general, heavy=True),
    _op("reduce_sum", p.reduce_sum, fuse=Fuse.REDUCE),
    *(_op(name, p.reduce_other, fuse=Fuse.REDUCE)
      for name in ("reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")),
    # vmap's psum, pmax and pmin over its named axis
    *(_op(name, p.positional_collective, fuse=Fuse.REDUCE) for name in ("psum", "pmax", "pmin")),
    _op("reduce", p.reduce_generic, fuse=Fuse.REDUCE),  # lax.reduce with the user's combiner
    _op("argmax", p.argminmax, fuse=Fuse.REDUCE),
    _op("argmin", p.argminmax, fuse=Fuse.REDUCE),
    *(_op(name, p.cumulative, prefix_scan=True) for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")),
    # ---- data movement (XLA fuses most of it)
    _op("broadcast_in_dim", p.broadcast_in_dim, fusible=True, localize=result_shape("shape"),
        fuse=Fuse.CHEAP, rereads=True),
    _op("transpose", p.transpose, fusible=True, fuse=Fuse.CHEAP),
    _op("reshape", p.reshape, fusible=True, localize=result_shape("new_sizes"), fuse=Fuse.CHEAP),
    _op("squeeze", p.squeeze, fusible=True, fuse=Fuse.CHEAP),
    _op("expand_dims", p.expand_dims, fusible=True, fuse=Fuse.CHEAP),
    _op("iota", p.iota, fusible=True, localize=result_shape("shape"), fuse=Fuse.CHEAP),
    _op("slice", p.slice_, fusible=True, localize=operand_sizes("limit_indices"), fuse=Fuse.CHEAP),
    _op("pad", p.pad, fusible=True, fuse=Fuse.CHEAP, rereads=True, fused_once=True),
    _op("dynamic_slice", p.dynamic_slice, fusible=True, localize=operand_sizes("slice_sizes"),
        fuse=Fuse.CHEAP),
    _op("dynamic_update_slice", p.dynamic_update_slice, fusible=True, fuse=Fuse.INPLACE),
    _op("concatenate", p.concatenate, fusible=True, fuse=Fuse.CHEAP, rereads=True, fused_once=True),
    _op("stack", p.stack, fuse=Fuse.CHEAP),
    _op("unstack", p.unstack, fuse=Fuse.CHEAP),
    _op("tile", p.tile, fuse=Fuse.CHEAP, rereads=True),
    _op("optimization_barrier", p.optimization_barrier),
    _op("rev", p.rev, fusible=True, fuse=Fuse.CHEAP),
    _op("sort", p.sort, sorts_in_place=True),
    _op("top_k", p.top_k),
    _op("approx_top_k", p.top_k),  # lax.approx_max_k: replicated as top_k (not measured apart from it)
    # XLA's partitioner all-gathers an fft's operand even where only batch dimensions are split
    # (jax 0.10, CPU): replicated by rule, so the plan predicts the gather that runs
    _replicated("fft"),
    *(_op(name, p.batched_linalg) for name in p.LINALG_CORE),
    _op("split", p.split, fusible=True, fuse=Fuse.CHEAP),
    _op("bitcast_convert_type", p.bitcast_convert_type, fusible=True, fuse=Fuse.CHEAP),
    # uninitialised buffers (scan's transpose makes them): any layout, nothing to compute
    _op("empty", p.elementwise, fuse=Fuse.CHEAP),
    _op("empty2", p.elementwise, fuse=Fuse.CHEAP),
    # ---- lax.scan plumbing: the body is planned once, between these pseudo-equations
    # a scan reads its iteration's slice of xs in place
    _op("scan_slice", p.scan_slice, fusible=True, fuse=Fuse.CHEAP),
    _op("scan_stack", p.scan_stack, writes_slot=True),  # each iteration writes its own slot of ys
    _op("scan_final", p.elementwise, fusible=True),
    _op("cond_merge", p.cond_merge),
    # ---- PRNG: bits drawn where they are used (partitionable threefry); keys, small, replicated
    _op("random_bits", p.random_bits),
    *(_replicated(name) for name in ("random_seed", "random_wrap", "random_unwrap",
                                     "random_split", "random_fold_in", "random_gamma")),
    # lax.platform_dependent's branch index: a scalar the lowering fixes
    _replicated("platform_index"),
    # ---- indexing.py: gather and the scatter family
    _op("gather", ix.gather, localize=operand_sizes("slice_sizes"), fuse=Fuse.GATHER),
    *(_op(name, ix.scatter, fuse=Fuse.INPLACE) for name in ix.SCATTERS),
    # ---- no signature yet, but known to XLA's fusion (the memory model)
    PrimitiveRule("scatter_apply", fuse=Fuse.INPLACE),
    # ---- windowed.py: convolutions and windowed reductions
    _op("conv_general_dilated", w.conv_general_dilated, heavy=True),
    _op("reduce_window_sum", w.reduce_window_sum),
    *(_op(name, w.reduce_window_other) for name in ("reduce_window_max", "reduce_window_min", "reduce_window")),
    _op("select_and_scatter_add", w.select_and_scatter_add),
    _op("select_and_scatter", w.select_and_scatter),
    _op("select_and_gather_add", w.select_and_gather_add),
    # ---- host callbacks see whole arrays: operands and results replicated by rule (not by
    # fallback: there is nothing better to plan for them)
    *(_replicated(name) for name in ("pure_callback", "io_callback", "debug_callback", "debug_print")),
    # ---- deliberately unsupported, with the reason given to the user. (custom_partitioning has
    # a rule per function, not per primitive: rules/custom.py.)
    PrimitiveRule("while", unsupported="a loop with side effects and no results runs as one replicated equation"),
    PrimitiveRule("cond", unsupported="a cond with side effects and no results runs as one replicated equation"),
    PrimitiveRule("shard_map", unsupported="the function is already manually partitioned"),
    PrimitiveRule("xla_pmap", unsupported="pmap is already manually partitioned"),
    PrimitiveRule("rng_bit_generator", unsupported="stateful RNG is not partitioned yet"),
]

_BY_NAME: dict[str, PrimitiveRule] = {}
_BY_PRIMITIVE: dict[Any, PrimitiveRule] = {}  # user primitives registered as objects
# what rule_for found, by Primitive object or name: the memory model asks per equation, often
_FOUND: dict[Any, PrimitiveRule] = {}


def add_rule(rule: PrimitiveRule, primitive: Any = None) -> PrimitiveRule:
    """Register (or replace) a rule, under its name and, if given, its Primitive object."""
    _BY_NAME[rule.name] = rule
    if primitive is not None and not isinstance(primitive, str):
        _BY_PRIMITIVE[primitive] = rule
    _FOUND.clear()
    return rule


for _rule in _BUILTIN:
    assert _rule.name not in _BY_NAME, f"{_rule.name} listed twice"
    add_rule(_rule)


def rule_for(primitive: Any) -> PrimitiveRule:
    """The rule of a Primitive (by object first, then by name) or of a name; an empty rule (no
    builder, no flags) for a primitive nobody registered."""
    hit = _FOUND.get(primitive)
    if hit is None:
        hit = _FOUND[primitive] = _find(primitive)
    return hit


def _find(primitive: Any) -> PrimitiveRule:
    if not isinstance(primitive, str):
        hit = _BY_PRIMITIVE.get(primitive)
        if hit is not None:
            return hit
        primitive = primitive.name
    hit = _BY_NAME.get(primitive)
    return hit if hit is not None else PrimitiveRule(primitive)


def known_rules() -> dict[str, PrimitiveRule]:
    """Every rule registered by name (a copy)."""
    return dict(_BY_NAME)


def _update(name: str, **changes: Any) -> None:
    """Change fields of a name's rule (an empty one if none), wherever it is registered."""
    _BY_NAME[name] = dataclasses.replace(rule_for(name), **changes)
    for prim, rule in list(_BY_PRIMITIVE.items()):
        if rule.name == name:
            _BY_PRIMITIVE[prim] = dataclasses.replace(rule, **changes)
    _FOUND.clear()


def register(name: str, builder: p.Builder) -> None:
    """Register (or replace) the signature builder of a primitive; its other fields stay."""
    _update(name, builder=builder, linear=None, unsupported=None)


class _FieldView(MutableMapping[str, Any]):
    """A name -> field mapping over the registry (the former SIGNATURES and UNSUPPORTED dicts)."""

    def __init__(self, field: str, changes: dict[str, Any]) -> None:
        self._field = field
        self._changes = changes  # other fields reset when this one is set

    def __getitem__(self, name: str) -> Any:
        rule = _BY_NAME.get(name)
        value = None if rule is None else getattr(rule, self._field)
        if value is None:
            raise KeyError(name)
        return rule.signature if self._field == "builder" else value  # type: ignore[union-attr]

    def __setitem__(self, name: str, value: Any) -> None:
        _update(name, **{self._field: value, **self._changes})

    def __delitem__(self, name: str) -> None:
        self[name]  # KeyError if absent
        _update(name, **{self._field: None})

    def __iter__(self) -> Iterator[str]:
        return iter([n for n, r in _BY_NAME.items() if getattr(r, self._field) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


# name -> signature builder (with the rule's linearity), and name -> why it is unsupported
SIGNATURES: MutableMapping[str, p.Builder] = _FieldView("builder", {"linear": None})
UNSUPPORTED: MutableMapping[str, str] = _FieldView("unsupported", {})
