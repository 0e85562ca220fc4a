"""The generic rule: a factor signature and a mesh give the ways to run an equation locally.

Each mesh axis shards at most one factor, carries a pending partial sum through one linear
operand group, or is unused. Every choice is one *strategy*: a layout per operand and per result.
Per-primitive code never enumerates anything; it only states its signature.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

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


def enumerate_strategies(
    sig: FactorSignature,
    mesh: MeshAxes,
    spaces: SpaceTable,
    operand_spaces: Sequence[Space | None],  # None for literal operands
    result_spaces: Sequence[Space],
) -> list[Strategy]:
    sizes = dict(sig.sizes)
    in_results = {f for t in sig.results for d in t for f in d}
    shardable = [
        f for f in sig.factors
        if f not in sig.need_replication and sizes[f] > 1 and (f in in_results or f in sig.reduction)
    ]
    literal = [sp is None for sp in operand_spaces]
    groups = [g for g in sig.linear if not any(literal[i] for i in g)]
    active = mesh.active
    # per axis, only the factors its size divides: a factor split over several axes must be
    # divisible by each of them (3-axis meshes: most of the product is pruned here)
    per_axis: list[list[tuple[str, object]]] = []
    for axis in active:
        opts: list[tuple[str, object]] = [("none", None)]
        opts += [("factor", f) for f in shardable if sizes[f] % mesh.sizes[axis] == 0]
        opts += [("linear", k) for k in range(len(groups))]
        per_axis.append(opts)
    space_sets = [None if sp is None else frozenset(sp.layouts) for sp in operand_spaces]
    result_sets = [frozenset(sp.layouts) for sp in result_spaces]
    out: list[Strategy] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for choice in itertools.product(*per_axis):
        assign: dict[str, list[int]] = {}
        carried: list[int] = []
        carried_by: dict[int, list[int]] = {}
        for axis, (kind, what) in zip(active, choice, strict=True):
            if kind == "factor":
                assign.setdefault(what, []).append(axis)  # type: ignore[arg-type]
            elif kind == "linear":
                carried.append(axis)
                for i in groups[what]:  # type: ignore[index]
                    carried_by.setdefault(i, []).append(axis)
        if any(sizes[f] % _prod_sizes(ax, mesh.sizes) for f, ax in assign.items()):
            continue
        ins: list[int] = []
        ok = True
        for i, tensor in enumerate(sig.operands):
            if literal[i]:
                continue
            lay = _layout(tensor, assign, sizes, mesh.sizes, tuple(carried_by.get(i, ())))
            if lay is None:
                ok = False
                break
            lid = spaces.layouts.intern(lay)
            if lid not in space_sets[i]:  # type: ignore[operator]
                ok = False
                break
            ins.append(lid)
        if not ok:
            continue
        reduced = sorted({a for f in sig.reduction for a in assign.get(f, [])} | set(carried))
        outs: list[int] = []
        for r, tensor in enumerate(sig.results):
            lay = _layout(tensor, assign, sizes, mesh.sizes, tuple(reduced))
            if lay is None:
                ok = False
                break
            lid = spaces.layouts.intern(lay)
            if lid not in result_sets[r]:
                ok = False
                break
            outs.append(lid)
        if not ok:
            continue
        sig_key = (tuple(ins), tuple(outs))
        if sig_key in seen:
            continue
        seen.add(sig_key)
        split = math.prod(mesh.sizes[a] for ax in assign.values() for a in ax)
        out.append(
            Strategy(
                ins=tuple(ins),
                outs=tuple(outs),
                split=split,
                factor_axes=tuple((f, tuple(ax)) for f, ax in assign.items()),
                carried=tuple(carried),
            )
        )
    return out
