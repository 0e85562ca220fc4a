"""User sharding rules: factor signatures in the einsum-like syntax of
`jax.experimental.custom_partitioning(sharding_rule=...)`, registered on the same path as the
built-in ones.

    rule = shardsat.register_signature(rms_norm_p, "b d, d -> b d", need_replication_factors=("d",))

`(a b)` is one dimension made of two factors (a major); `1` a size-1 dimension. Factor sizes are
read from the operands' shapes when the rule is applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.experimental.custom_partitioning import custom_partitioning

from ..checks import known_keywords
from ..errors import InvalidArgumentError, InvalidSignatureError
from . import custom
from .primitives import EqnTypes
from .registry import add_rule, rule_for
from .rule import Fuse, Localizer, PrimitiveRule
from .signature import (
    FactorSignature,
    TensorFactors,
    factors_of,
    infer_sizes,
    parse_tensors,
    structure_problem,
)


@dataclass(frozen=True)
class SignatureRule:
    """A registered signature; `check_rule` (shardsat.testing) tests it numerically."""

    primitive: Any  # the jax.extend Primitive (or its name), or a custom_partitioning function
    name: str
    spec: str
    operands: tuple[TensorFactors, ...]
    results: tuple[TensorFactors, ...]
    reduction: frozenset[str] = frozenset()
    need_replication: frozenset[str] = frozenset()
    linear: tuple[tuple[int, ...], ...] = ()
    flops_per_element: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def factors(self) -> tuple[str, ...]:
        return factors_of((*self.operands, *self.results))

    def signature(self, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]) -> FactorSignature:
        """The factor signature for concrete shapes (validated; errors name this rule)."""
        where = f"rule `{self.name}` ({self.spec!r})"
        if len(in_shapes) != len(self.operands):
            raise InvalidSignatureError(
                f"{where} describes {len(self.operands)} operands but `{self.name}` was called with {len(in_shapes)}."
            )
        if len(out_shapes) != len(self.results):
            raise InvalidSignatureError(
                f"{where} describes {len(self.results)} results but `{self.name}` returns {len(out_shapes)}."
            )
        sizes = infer_sizes([*self.operands, *self.results], [*in_shapes, *out_shapes], self.name)
        out_elems = 1
        for s in out_shapes[:1]:
            for n in s:
                out_elems *= n
        sig = FactorSignature(
            self.operands, self.results, sizes, self.reduction, self.need_replication, self.linear,
            flops=self.flops_per_element * out_elems * max(1, len(in_shapes)), name=self.name,
        )
        return sig.validate(in_shapes, out_shapes)

    def builder(self, t: EqnTypes) -> FactorSignature:
        return self.signature(t.in_shapes, t.out_shapes)


@known_keywords
def register_signature(
    primitive: Any,
    spec: str,
    *,
    reduction_factors: Sequence[str] = (),
    need_replication_factors: Sequence[str] = (),
    linear: Sequence[Sequence[int]] = (),
    flops_per_element: float = 1.0,
    fusible: bool | None = None,
    elementwise: bool | None = None,
    heavy: bool | None = None,
    writes_slot: bool | None = None,
    localize: Localizer | None = None,
    pin: str | None = None,
    fuse: Fuse | str | None = None,
    sorts_in_place: bool | None = None,
    rereads: bool | None = None,
) -> SignatureRule:
    """Teach shardsat how `primitive` shards, as a factor signature "ops -> results".

    reduction_factors: factors the primitive sums over; sharding one leaves a pending partial sum
      (only declare this for ops linear in the operands that carry the factor).
    need_replication_factors: factors that may not be sharded (a normalisation over them, a
      sort, a window).
    linear: groups of operand positions through which a pending partial sum passes unchanged.
    The other keywords set the rest of the primitive's PrimitiveRule (rules/rule.py); None keeps
    what a rule already registered under the name says (False / none for a new primitive):
    fusible: XLA fuses it into its neighbours (the cost model charges only its result's bytes).
    elementwise: pointwise arithmetic (counted in the optimizer update's FLOPs).
    heavy: a contraction, like dot_general (collectives between two cannot be combined).
    writes_slot: it writes its operand into one slot of a larger result (charged the operand).
    localize: rewrites params that name global sizes to the local ones, for running on shards.
    pin: the param holding a sharding the result must have (the op is the user's layout pin).
    fuse: what XLA's fusion makes of it, a Fuse or its name ("cheap", "expensive", "reduce",
      "gather", "inplace", "opaque"): which of its results the memory model counts as buffers.
    sorts_in_place: opaque, yet writes its result into a dying operand's buffer (like sort).
    rereads: reads each operand element many times (like broadcast_in_dim).
    `primitive` may be a `custom_partitioning` function (after `def_partition`): the rule then
    applies to its calls only, in place of its own sharding_rule, and its reduction factors and
    linear groups are kept whole there (its partition callback returns complete results).
    Raises InvalidSignatureError naming the rule if the spec is malformed, InvalidArgumentError
    if an argument has the wrong type (a string of factor names, a negative flops_per_element).
    """
    from ..options import signature_problems

    problems = signature_problems(primitive, spec, reduction_factors, need_replication_factors, linear,
                                  flops_per_element)
    problems += _flag_problems(fusible=fusible, elementwise=elementwise, heavy=heavy, writes_slot=writes_slot,
                               localize=localize, pin=pin, fuse=fuse, sorts_in_place=sorts_in_place,
                               rereads=rereads)
    if problems:
        raise InvalidArgumentError("register_signature: " + " ".join(problems))
    cp = isinstance(primitive, custom_partitioning)
    name = _cp_name(primitive) if cp else getattr(primitive, "name", None) or str(primitive)
    operands, results = _parse_spec(name, spec, reduction_factors, need_replication_factors, linear)
    rule = SignatureRule(
        primitive=primitive, name=name, spec=spec, operands=operands, results=results,
        reduction=frozenset(reduction_factors), need_replication=frozenset(need_replication_factors),
        linear=tuple(tuple(int(i) for i in g) for g in linear), flops_per_element=flops_per_element,
    )
    if cp:
        # calls carry the partition callback, not the function: find the rule by the callback
        custom.FUNCTION_RULES[primitive.partition] = rule.builder
        return rule
    flags = {"fusible": fusible, "elementwise": elementwise, "heavy": heavy, "writes_slot": writes_slot,
             "localize": localize, "pin": pin, "fuse": None if fuse is None else _fuse(fuse),
             "sorts_in_place": sorts_in_place, "rereads": rereads}
    old = rule_for(name)  # a flag not given keeps the value a rule of this name has
    kept = {k: getattr(old, k) if v is None else v for k, v in flags.items()}
    add_rule(PrimitiveRule(name, rule.builder, **kept), primitive)
    return rule


def _parse_spec(name: str, spec: str, reduction_factors: Sequence[str], need_replication_factors: Sequence[str],
                linear: Sequence[Sequence[int]]) -> tuple[tuple[TensorFactors, ...], tuple[TensorFactors, ...]]:
    """(operands, results) of a spec, checked against the other arguments; errors name the rule."""
    where = f"rule `{name}` ({spec!r})"
    if "->" not in spec:
        raise InvalidSignatureError(f"{where} needs '->' between operands and results.")
    lhs, _, rhs = spec.partition("->")
    operands = tuple(parse_tensors(lhs, name))
    results = tuple(parse_tensors(rhs, name))
    if not results:
        raise InvalidSignatureError(f"{where} names no result.")
    problem = structure_problem(operands, results, {"reduction_factors": reduction_factors,
                                "need_replication_factors": need_replication_factors}, reduction_factors, linear)
    problem = problem or _spec_problem((*operands, *results), reduction_factors, need_replication_factors)
    if problem:
        raise InvalidSignatureError(f"{where}: {problem}")
    return operands, results


def _spec_problem(tensors: Sequence[TensorFactors], reduction: Sequence[str], replication: Sequence[str]) -> str | None:
    """What a user's spec says that no strategy can hold: a factor twice in one tensor (a diagonal:
    split once it would be split twice), a factor both summed and kept whole."""
    for k, t in enumerate(tensors):
        names = [f for d in t for f in d]
        twice = sorted({f for f in names if names.count(f) > 1})
        if twice:
            return (f"factor(s) {twice} appear twice in tensor {k} (a diagonal): no sharding splits them once. "
                    "Consider a factor per dimension, listed in need_replication_factors= where it must stay whole.")
    both = sorted(set(reduction) & set(replication))
    if both:
        return f"factor(s) {both} are both reduction and need-replication factors. Consider one of the two."
    return None


def _flag_problems(**flags: Any) -> list[str]:
    """The PrimitiveRule keywords of register_signature, checked before anything is registered."""
    out = []
    for k in ("fusible", "elementwise", "heavy", "writes_slot", "sorts_in_place", "rereads"):
        if flags[k] is not None and not isinstance(flags[k], bool):
            out.append(f"{k} must be True, False or None (keep the registered value), got {flags[k]!r}.")
    if flags["localize"] is not None and not callable(flags["localize"]):
        out.append(f"localize must be a function (params, ins, outs) -> params, got {flags['localize']!r}.")
    if flags["pin"] is not None and not isinstance(flags["pin"], str):
        out.append(f"pin must be the name of the param holding the sharding, got {flags['pin']!r}.")
    fuse = flags["fuse"]
    if fuse is not None and not isinstance(fuse, Fuse) and str(fuse).upper() not in Fuse.__members__:
        out.append(f"fuse must be a shardsat.rules.Fuse or one of {[k.lower() for k in Fuse.__members__]}, "
                   f"got {fuse!r}.")
    return out


def _fuse(value: Fuse | str) -> Fuse:
    return value if isinstance(value, Fuse) else Fuse[str(value).upper()]


def _cp_name(fn: Any) -> str:
    """A custom_partitioning function's name; it must have its partition callback already."""
    name = getattr(fn.fun, "__qualname__", None) or repr(fn.fun)
    if getattr(fn, "partition", None) is None:
        raise InvalidSignatureError(
            f"custom_partitioning function `{name}` has no partition callback yet; consider calling "
            "`def_partition(...)` before shardsat.register_signature().")
    return name
