"""Narrowing: give each value only the layouts a prior kept, so that the e-graph of a big program
on a mesh of many axes stays within the node budget.

The number of layouts of a tensor grows as (rank + 2) ** axes, and the resharding e-nodes as its
square: a GPT step has ~0.2 M (value, layout) pairs on 2x2x2 and ~1 M on 2x2x2x2, where the full
e-graph passes any node limit. A narrowed value keeps:
- the kept layouts and every layout with fewer axes than one of them (a gather of a kept layout
  stays inside the set, so every kept layout reaches and is reached from replicated);
- replicated, so the all-replicated plan always remains.
Values that must share one layout (tied state, a scan's carry, values a rewrite proved equal) or
that hash-cons into one e-class (the same computation of the same operands) share one set.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from .layout import Layout, SpaceTable
from .program import Literal, Program
from .unionfind import UnionFind


def fewer_axes(lay: Layout) -> set[Layout]:
    """`lay` and every layout that leaves out some of its axes (mesh order stays)."""
    used = sorted(lay.used_axes())
    out = set()
    for k in range(len(used) + 1):
        for drop in itertools.combinations(used, k):
            gone = set(drop)
            out.add(Layout(tuple(tuple(a for a in d if a not in gone) for d in lay.dims),
                           tuple(a for a in lay.partial if a not in gone)))
    return out


def _same_computation(program: Program, union: UnionFind) -> None:
    """Join the outputs of equations with one key (literals are part of it) and the same operands."""
    seen: dict[tuple[object, ...], list[int]] = {}
    for eqn in program.equations:
        if eqn.key is None:
            continue
        ops = tuple(-1 if isinstance(a, Literal) else union.find(program.alias(a)) for a in eqn.inputs)
        first = seen.setdefault((eqn.key, ops), list(eqn.outputs))
        for a, b in zip(first, eqn.outputs, strict=True):
            union.union(a, b)


def narrow_spaces(program: Program, spaces: SpaceTable, keep: Mapping[int, Iterable[int]],
                  together: Iterable[tuple[int, int]] = ()) -> int:
    """Narrow every value in `keep` (value id -> layout ids) to those layouts, with fewer axes
    and replicated; the pairs in `together` and equal computations share a set. Returns the
    number of (value, layout) pairs left out."""
    union = UnionFind(len(program.values))
    for a, b in together:
        union.union(program.alias(a), program.alias(b))
    for a, b in program.equivalences:
        union.union(program.alias(a), program.alias(b))
    _same_computation(program, union)
    table = spaces.layouts
    shared: dict[int, set[int]] = {}
    for vid, lids in keep.items():
        members = shared.setdefault(union.find(program.alias(vid)), set())
        for lid in lids:
            members.update(table.intern(lay) for lay in fewer_axes(table[lid]))
    removed = 0
    for vid, v in enumerate(program.values):
        members = shared.get(union.find(program.alias(vid)))
        if members is None:
            continue
        whole = len(spaces.space(v.shape, v.dtype).layouts)
        removed += whole - len(spaces.narrow(vid, v.shape, v.dtype, frozenset(members)).layouts)
    return removed
