"""Factor signatures: how a primitive's dimensions are tied together (Shardy's sharding rules).

Each operand and result dimension maps to a tuple of factors (major to minor; one factor for a
plain dimension, several for a reshaped one, none for a size-1 dimension). Sharding a factor over
mesh axes shards every dimension mapped to it. A *reduction* factor is summed over: sharding it
leaves the result a pending partial sum. A *need-replication* factor may not be sharded at all.
`linear` lists operand groups through which a pending partial sum passes unchanged (for `add`:
both operands together; for `mul`: either operand alone).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import InvalidSignatureError

DimFactors = tuple[str, ...]
TensorFactors = tuple[DimFactors, ...]


@dataclass(frozen=True)
class FactorSignature:
    operands: tuple[TensorFactors, ...]
    results: tuple[TensorFactors, ...]
    sizes: Mapping[str, int]
    reduction: frozenset[str] = frozenset()
    need_replication: frozenset[str] = frozenset()
    linear: tuple[tuple[int, ...], ...] = ()
    flops: float = 0.0
    name: str = "signature"
    notes: tuple[str, ...] = field(default=())

    @property
    def factors(self) -> tuple[str, ...]:
        return factors_of((*self.operands, *self.results))

    def validate(
        self, operand_shapes: Sequence[tuple[int, ...]], result_shapes: Sequence[tuple[int, ...]]
    ) -> FactorSignature:
        """Check the signature against concrete shapes; raise naming the rule if it is wrong."""
        where = f"signature `{self.name}`"
        if len(self.operands) != len(operand_shapes):
            raise InvalidSignatureError(
                f"{where} has {len(self.operands)} operands but the primitive takes {len(operand_shapes)}."
            )
        if len(self.results) != len(result_shapes):
            raise InvalidSignatureError(
                f"{where} has {len(self.results)} results but the primitive gives {len(result_shapes)}."
            )
        for kind, tensors, shapes in (("operand", self.operands, operand_shapes),
                                      ("result", self.results, result_shapes)):
            for i, (t, shape) in enumerate(zip(tensors, shapes, strict=True)):
                if len(t) != len(shape):
                    raise InvalidSignatureError(
                        f"{where}: {kind} {i} has rank {len(shape)} (shape {shape}) but the signature "
                        f"names {len(t)} dimensions."
                    )
                for d, (fs, n) in enumerate(zip(t, shape, strict=True)):
                    for f in fs:
                        if f not in self.sizes:
                            raise InvalidSignatureError(f"{where}: factor `{f}` has no size.")
                    prod = math.prod(self.sizes[f] for f in fs)
                    if prod != n:
                        raise InvalidSignatureError(
                            f"{where}: {kind} {i} dimension {d} has size {n} but its factors "
                            f"{fs or '()'} multiply to {prod}."
                        )
        problem = structure_problem(self.operands, self.results, {"reduction": self.reduction,
                                    "need_replication": self.need_replication}, self.reduction, self.linear)
        if problem:
            raise InvalidSignatureError(f"{where}: {problem}")
        return self


def structure_problem(operands: Sequence[TensorFactors], results: Sequence[TensorFactors],
                      named: dict[str, Iterable[str]], reduction: Iterable[str],
                      linear: Sequence[Sequence[int]]) -> str | None:
    """What is wrong with a signature's factors apart from sizes, or None: factors `named` (by
    the argument that names them) that no tensor has, reduction factors in a result, linear
    groups naming operands it does not have. One check for built signatures (`validate`) and
    for specs at registration (`register_signature`), before any shape is known."""
    seen = set(factors_of((*operands, *results)))
    for label, fs in named.items():
        unknown = sorted(set(fs) - seen)
        if unknown:
            return f"{label} names unknown factor(s) {unknown}; the signature has {sorted(seen)}."
    in_results = {f for t in results for d in t for f in d}
    bad = sorted(set(reduction) & in_results)
    if bad:
        return f"reduction factor(s) {bad} also appear in a result."
    for group in linear:
        for i in group:
            if not 0 <= int(i) < len(operands):
                return f"linear group {tuple(group)} names operand {i}; there are {len(operands)} operands."
    return None


def factors_of(tensors: Sequence[TensorFactors]) -> tuple[str, ...]:
    """Every factor named by the tensors, in order of first appearance."""
    seen: dict[str, None] = {}
    for t in tensors:
        for d in t:
            for f in d:
                seen.setdefault(f, None)
    return tuple(seen)


_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*|1")


def parse_tensors(text: str, name: str) -> list[TensorFactors]:
    """Parse "b i k, b k j" into per-tensor, per-dim factor tuples. `(a b)` is one dimension made
    of factors a (major) and b; `1` is a size-1 dimension with no factor."""
    out: list[TensorFactors] = []
    if not text.strip():
        return out
    for part in text.split(","):
        dims: list[DimFactors] = []
        group: list[str] | None = None
        for tok in _TOKEN.findall(part):
            if tok == "(":
                if group is not None:
                    raise InvalidSignatureError(f"signature `{name}`: nested parentheses in {part!r}.")
                group = []
            elif tok == ")":
                if group is None:
                    raise InvalidSignatureError(f"signature `{name}`: unbalanced ')' in {part!r}.")
                dims.append(tuple(group))
                group = None
            elif group is not None:
                if tok != "1":
                    group.append(tok)
            else:
                dims.append(() if tok == "1" else (tok,))
        if group is not None:
            raise InvalidSignatureError(f"signature `{name}`: unbalanced '(' in {part!r}.")
        leftover = _TOKEN.sub("", part).strip()
        if leftover:
            raise InvalidSignatureError(f"signature `{name}`: cannot read {leftover!r} in {part!r}.")
        out.append(tuple(dims))
    return out


def infer_sizes(
    tensors: Sequence[TensorFactors], shapes: Sequence[tuple[int, ...]], name: str,
    known: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Factor sizes from shapes: plain dims first, then compound dims with one unknown factor.
    `known` gives sizes of factors that only appear inside compound dims."""
    sizes: dict[str, int] = dict(known or {})
    pending: list[tuple[DimFactors, int]] = []
    for t, shape in zip(tensors, shapes, strict=True):
        if len(t) != len(shape):
            raise InvalidSignatureError(
                f"signature `{name}`: a tensor of shape {shape} is described by {len(t)} dimensions."
            )
        for fs, n in zip(t, shape, strict=True):
            if len(fs) == 1:
                if sizes.setdefault(fs[0], n) != n:
                    raise InvalidSignatureError(
                        f"signature `{name}`: factor `{fs[0]}` has sizes {sizes[fs[0]]} and {n}."
                    )
            elif fs:
                pending.append((fs, n))
    changed = True
    while pending and changed:
        changed = False
        for fs, n in list(pending):
            unknown = [f for f in fs if f not in sizes]
            known = math.prod(sizes[f] for f in fs if f in sizes)
            if len(unknown) == 1 and n % known == 0:
                sizes[unknown[0]] = n // known
            elif unknown:
                continue
            pending.remove((fs, n))
            changed = True
    if pending:
        raise InvalidSignatureError(
            f"signature `{name}`: cannot infer the sizes of factors in {[fs for fs, _ in pending]}."
        )
    return sizes
