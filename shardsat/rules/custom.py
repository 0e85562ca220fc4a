"""`jax.experimental.custom_partitioning` functions: their Shardy sharding rule, read as a factor
signature, or one registered for the function with `shardsat.register_signature(fn, ...)`.

All such functions bind one primitive, so rules are found per function, by the `partition`
callback the equation carries. The plan constrains operands and results to its layouts and XLA
calls the user's callback with them; the callback returns complete results, so reduction and
permutation factors are kept whole (we cannot know whether it sums a split contracting factor)
and no pending sum ever enters or leaves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidSignatureError
from .primitives import EqnTypes
from .signature import DimFactors, FactorSignature, TensorFactors, infer_sizes

PRIMITIVE = "custom_partitioning"

Builder = Callable[[EqnTypes], FactorSignature]

# partition callback -> builder of the signature registered for its function
FUNCTION_RULES: dict[Any, Builder] = {}

_BATCHING = "…"  # how jax's rule parser writes a leading `...`


def function_name(params: Mapping[str, Any]) -> str:
    """The user's function as the equation names it (its traced name and partition callback)."""
    call = params.get("call")
    debug = getattr(getattr(call, "jaxpr", None), "debug_info", None)
    fname = getattr(debug, "func_name", None)
    part = params.get("partition")
    pname = getattr(part, "__qualname__", None) or getattr(part, "__name__", None)
    if fname and pname:
        return f"{fname} (partition callback {pname})"
    return fname or pname or PRIMITIVE


def builder_for(params: Mapping[str, Any], default: Builder | None = None) -> tuple[Builder | None, str | None]:
    """The builder for one custom_partitioning equation: the signature registered for its
    function, else its sharding_rule, else `default` (one registered for the primitive's name);
    or None and the reason there is none."""
    registered = FUNCTION_RULES.get(params.get("partition"))
    if registered is not None:
        return _registered(registered), None
    rule = params.get("sharding_rule")
    if rule is not None and hasattr(rule, "operand_mappings"):
        return (lambda t: from_sdy_rule(rule, t)), None
    if default is not None:
        return default, None
    name = function_name(params)
    why = ("its sharding_rule is a callable shardsat cannot evaluate" if callable(rule)
           else "it has no sharding_rule")
    return None, (
        f"custom_partitioning function `{name}`: {why}; consider "
        f"`def_partition(..., sharding_rule=\"...\")` or `shardsat.register_signature(fn, \"...\")`"
    )


def _registered(builder: Builder) -> Builder:
    """A registered signature read like a sharding_rule: the callback returns complete results,
    so reduction factors stay whole and no pending sum passes through; FLOPs from the call."""
    def build(t: EqnTypes) -> FactorSignature:
        sig = builder(t)
        return dataclasses.replace(sig, need_replication=sig.need_replication | sig.reduction, reduction=frozenset(),
                                   linear=(), flops=jaxpr_flops(t.params["call"])).validate(t.in_shapes, t.out_shapes)

    return build


def _tensors(mappings: Any, shapes: tuple[tuple[int, ...], ...], where: str) -> list[TensorFactors]:
    """Shardy array mappings as factor tensors; a leading `...` becomes one factor per dimension
    it stands for, shared by every tensor of its group."""
    groups: dict[str, int] = {}
    out: list[TensorFactors] = []
    for i, (mapping, shape) in enumerate(zip(mappings, shapes, strict=True)):
        dims = list(mapping)
        lead: list[DimFactors] = []
        if dims and isinstance(dims[0], str) and dims[0].startswith(_BATCHING):
            group = dims.pop(0)[len(_BATCHING):] or "0"
            n = max(0, len(shape) - len(dims))
            if groups.setdefault(group, n) != n:
                raise InvalidSignatureError(
                    f"{where}: `...` stands for {groups[group]} and {n} dimensions (tensor {i}).")
            lead = [(f"_batch{group}_{j}",) for j in range(n)]
        out.append(tuple(lead) + tuple((d,) if isinstance(d, str) else tuple(d) for d in dims))
    return out


def from_sdy_rule(rule: Any, t: EqnTypes) -> FactorSignature:
    """A factor signature from an `SdyShardingRule`: pass-through factors shard; reduction,
    permutation and need-replication factors stay whole; size-1 factors are dropped."""
    name = f"custom_partitioning {function_name(t.params)}"
    if len(rule.operand_mappings) != len(t.in_shapes) or len(rule.result_mappings) != len(t.out_shapes):
        raise InvalidSignatureError(
            f"`{name}`: its sharding_rule has {len(rule.operand_mappings)} operands and "
            f"{len(rule.result_mappings)} results, the call {len(t.in_shapes)} and {len(t.out_shapes)}.")
    operands = _tensors(rule.operand_mappings, t.in_shapes, f"`{name}`")
    results = _tensors(rule.result_mappings, t.out_shapes, f"`{name}`")
    tensors, shapes = [*operands, *results], [*t.in_shapes, *t.out_shapes]
    for ten, shape in zip(tensors, shapes, strict=True):
        if len(ten) != len(shape):
            raise InvalidSignatureError(f"`{name}`: a tensor of shape {shape} is described by {len(ten)} dimensions.")
    sizes = infer_sizes(tensors, shapes, name, known=dict(rule.factor_sizes))
    ones = {f for f, n in sizes.items() if n == 1}

    def drop(ts: list[TensorFactors]) -> tuple[TensorFactors, ...]:
        return tuple(tuple(tuple(f for f in d if f not in ones) for d in ten) for ten in ts)

    whole = {*rule.reduction_factors, *rule.permutation_factors, *rule.need_replication_factors}
    sig = FactorSignature(
        drop(operands), drop(results), {f: n for f, n in sizes.items() if f not in ones},
        need_replication=frozenset(whole - ones), flops=jaxpr_flops(t.params["call"]), name=name,
    )
    return sig.validate(t.in_shapes, t.out_shapes)


def jaxpr_flops(jaxpr: Any) -> float:
    """A rough FLOP count of a (closed) jaxpr: 2*out*contracted for dot_general, output elements
    for other equations; sub-jaxprs counted once (scan bodies per iteration, the largest branch)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for e in getattr(jaxpr, "eqns", ()):
        subs = [v for v in e.params.values() if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns")]
        branches = [b for v in e.params.values() if isinstance(v, tuple | list) for b in v
                    if hasattr(getattr(b, "jaxpr", b), "eqns")]
        if subs or branches:
            inner = sum(jaxpr_flops(s) for s in subs) + max((jaxpr_flops(b) for b in branches), default=0.0)
            total += inner * int(e.params.get("length", 1) if e.primitive.name == "scan" else 1)
            continue
        out = sum(math.prod(getattr(v.aval, "shape", ())) for v in e.outvars)
        if e.primitive.name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            lhs = getattr(e.invars[0].aval, "shape", ())
            out *= 2 * math.prod(lhs[a] for a in lc)
        total += out
    return float(total)
