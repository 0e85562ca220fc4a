"""The generic rule: a factor signature and a mesh give the ways to run an equation locally.

Each mesh axis shards at most one factor, carries a pending partial sum through one linear
operand group, or is unused. Every choice is one *strategy*: a layout per operand and per result.
Per-primitive code never enumerates anything; it only states its signature.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ..egraph.layout import Layout, MeshAxes, Space, SpaceTable
from .signature import FactorSignature, TensorFactors


@dataclass(frozen=True)
class Strategy:
    ins: tuple[int, ...]  # layout id of each non-literal operand
    outs: tuple[int, ...]  # layout id of each result
    split: int  # product of the sizes of mesh axes that shard a factor: the compute divisor
    factor_axes: tuple[tuple[str, tuple[int, ...]], ...]  # which factor each axis shards
    carried: tuple[int, ...] = ()  # axes along which a pending sum passes through


def _prod_sizes(axes: Sequence[int], sizes: Sequence[int]) -> int:
    return math.prod(sizes[a] for a in axes)


def _dim_axes(fs: tuple[str, ...], assign: dict[str, list[int]], factor_sizes: dict[str, int],
              mesh_sizes: Sequence[int]) -> tuple[int, ...] | None:
    axes: list[int] = []
    for i, f in enumerate(fs):
        fa = assign.get(f)
        if not fa:
            continue
        # a minor factor may be split only if every more-major factor is split completely
        if any(factor_sizes[g] != _prod_sizes(assign.get(g, []), mesh_sizes) for g in fs[:i]):
            return None
        axes.extend(fa)
    if any(b <= a for a, b in itertools.pairwise(axes)):
        return None  # layouts keep a dimension's axes in mesh order
    return tuple(axes)


def _layout(tensor: TensorFactors, assign: dict[str, list[int]], factor_sizes: dict[str, int],
            mesh_sizes: Sequence[int], partial: tuple[int, ...]) -> Layout | None:
    dims = []
    for fs in tensor:
        d = _dim_axes(fs, assign, factor_sizes, mesh_sizes)
        if d is None:
            return None
        dims.append(d)
    return Layout(tuple(dims), partial)


AxisOption = tuple[str, object]  # ("none", None), ("factor", name) or ("linear", operand group index)


@dataclass
class _Assignment:
    """What one choice of options gives the mesh axes: the axes sharding each factor, and the
    axes along which a pending sum passes through, overall and by operand."""

    factors: dict[str, list[int]] = field(default_factory=dict)
    carried: list[int] = field(default_factory=list)
    carried_by: dict[int, list[int]] = field(default_factory=dict)

    def strategy(self, ins: list[int], outs: list[int], mesh_sizes: Sequence[int]) -> Strategy:
        split = math.prod(mesh_sizes[a] for ax in self.factors.values() for a in ax)
        return Strategy(
            ins=tuple(ins),
            outs=tuple(outs),
            split=split,
            factor_axes=tuple((f, tuple(ax)) for f, ax in self.factors.items()),
            carried=tuple(self.carried),
        )


@dataclass
class _Enumeration:
    """One equation's strategy search: its signature on the mesh, and the layouts its operands and
    results may take (their spaces')."""

    sig: FactorSignature
    mesh: MeshAxes
    spaces: SpaceTable
    sizes: dict[str, int]
    literal: list[bool]  # per operand
    groups: list[tuple[int, ...]]  # the linear operand groups with no literal operand
    operand_sets: list[frozenset[int] | None]  # None for literal operands
    result_sets: list[frozenset[int]]
    # (tensor, the axes of its factors, pending axes) -> layout id, -1 for no layout: most
    # choices differ only in factors a given tensor does not have
    memo: dict[tuple[object, ...], int] = field(default_factory=dict)

    @classmethod
    def of(cls, sig: FactorSignature, mesh: MeshAxes, spaces: SpaceTable,
           operand_spaces: Sequence[Space | None], result_spaces: Sequence[Space]) -> _Enumeration:
        literal = [sp is None for sp in operand_spaces]
        return cls(sig, mesh, spaces, dict(sig.sizes), literal,
                   [g for g in sig.linear if not any(literal[i] for i in g)],
                   [None if sp is None else frozenset(sp.layouts) for sp in operand_spaces],
                   [frozenset(sp.layouts) for sp in result_spaces])

    def axis_options(self) -> list[list[AxisOption]]:
        """Per active axis, only the factors its size divides: a factor split over several axes
        must be divisible by each of them (3-axis meshes: most of the product is pruned here)."""
        sig, sizes = self.sig, self.sizes
        in_results = {f for t in sig.results for d in t for f in d}
        shardable = [
            f for f in sig.factors
            if f not in sig.need_replication and sizes[f] > 1 and (f in in_results or f in sig.reduction)
        ]
        per_axis: list[list[AxisOption]] = []
        for axis in self.mesh.active:
            opts: list[AxisOption] = [("none", None)]
            opts += [("factor", f) for f in shardable if sizes[f] % self.mesh.sizes[axis] == 0]
            opts += [("linear", k) for k in range(len(self.groups))]
            per_axis.append(opts)
        return per_axis

    def assign(self, choice: tuple[AxisOption, ...]) -> _Assignment | None:
        """The assignment of one option per active axis; None if a factor is not divisible by the
        product of its axes."""
        a = _Assignment()
        for axis, (kind, what) in zip(self.mesh.active, choice, strict=True):
            if kind == "factor":
                a.factors.setdefault(what, []).append(axis)  # type: ignore[arg-type]
            elif kind == "linear":
                a.carried.append(axis)
                for i in self.groups[what]:  # type: ignore[index]
                    a.carried_by.setdefault(i, []).append(axis)
        if any(self.sizes[f] % _prod_sizes(ax, self.mesh.sizes) for f, ax in a.factors.items()):
            return None
        return a

    def layout_ids(self, a: _Assignment,
                   tensors: Iterable[tuple[TensorFactors, tuple[int, ...], frozenset[int]]]) -> list[int] | None:
        """The interned layout of each (tensor, pending-sum axes, allowed layouts) in order; None
        at the first that is no layout or not one its space allows."""
        ids: list[int] = []
        factors = a.factors
        for tensor, partial, allowed in tensors:
            key = (tensor, tuple(tuple(factors.get(f, ())) for fs in tensor for f in fs), partial)
            lid = self.memo.get(key)
            if lid is None:
                lay = _layout(tensor, factors, self.sizes, self.mesh.sizes, partial)
                lid = self.memo[key] = -1 if lay is None else self.spaces.layouts.intern(lay)
            if lid < 0 or lid not in allowed:
                return None
            ids.append(lid)
        return ids

    def operands(self, a: _Assignment) -> Iterator[tuple[TensorFactors, tuple[int, ...], frozenset[int]]]:
        """The non-literal operands, each pending the sums its linear group carries."""
        for i, tensor in enumerate(self.sig.operands):
            if not self.literal[i]:
                yield tensor, tuple(a.carried_by.get(i, ())), self.operand_sets[i]  # type: ignore[misc]

    def results(self, a: _Assignment) -> Iterator[tuple[TensorFactors, tuple[int, ...], frozenset[int]]]:
        """The results, pending the sums over the axes sharding a reduction factor or carried."""
        reduced = tuple(sorted({x for f in self.sig.reduction for x in a.factors.get(f, [])} | set(a.carried)))
        for r, tensor in enumerate(self.sig.results):
            yield tensor, reduced, self.result_sets[r]


def structure_key(sig: FactorSignature, operand_spaces: Sequence[Space | None],
                  result_spaces: Sequence[Space]) -> tuple[object, ...]:
    """What `enumerate_strategies` depends on: the signature but its name, flops and notes, and
    the spaces."""
    return (sig.operands, sig.results, tuple(sorted(sig.sizes.items())), sig.reduction, sig.need_replication,
            sig.linear, tuple(None if sp is None else sp.id for sp in operand_spaces),
            tuple(sp.id for sp in result_spaces))


def enumerate_strategies(
    sig: FactorSignature,
    mesh: MeshAxes,
    spaces: SpaceTable,
    operand_spaces: Sequence[Space | None],  # None for literal operands
    result_spaces: Sequence[Space],
) -> list[Strategy]:
    """Every distinct strategy: one option per active mesh axis, kept where every operand and
    result layout is one its space holds; strategies with the same layouts are one."""
    e = _Enumeration.of(sig, mesh, spaces, operand_spaces, result_spaces)
    out: list[Strategy] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for choice in itertools.product(*e.axis_options()):
        a = e.assign(choice)
        if a is None:
            continue
        ins = e.layout_ids(a, e.operands(a))
        if ins is None:
            continue
        outs = e.layout_ids(a, e.results(a))
        if outs is None:
            continue
        sig_key = (tuple(ins), tuple(outs))
        if sig_key in seen:
            continue
        seen.add(sig_key)
        out.append(a.strategy(ins, outs, mesh.sizes))
    return out
