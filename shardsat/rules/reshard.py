"""Resharding: the layouts one collective away from a layout of the same value.

all-gather (split -> less split; the minor axes of a dimension), dynamic slice (replicated ->
split, free), all-reduce (partial -> summed), reduce-scatter (partial -> summed and split),
all-to-all (a dimension's minor axis moves to another dimension). Multi-axis forms are one
collective over several axes, as XLA emits them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..egraph.export import NodeKind
from ..egraph.layout import Layout, Space, SpaceTable


@dataclass(frozen=True)
class ReshardEdge:
    kind: NodeKind
    src: int
    dst: int
    axes: tuple[int, ...]
    dim: int = 0
    dim2: int = 0


def _subsets(items: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [c for r in range(1, len(items) + 1) for c in itertools.combinations(items, r)]


def _with_dim(lay: Layout, d: int, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(axes if i == d else x for i, x in enumerate(lay.dims))


def reshard_edges(space: Space, spaces: SpaceTable) -> list[ReshardEdge]:
    table = spaces.layouts
    members = frozenset(space.layouts)
    edges: list[ReshardEdge] = []

    def add(kind: NodeKind, src: int, dst_layout: Layout, axes: tuple[int, ...], dim: int = 0, dim2: int = 0) -> None:
        dst = table.ids.get(dst_layout)
        if dst is not None and dst in members:
            edges.append(ReshardEdge(kind, src, dst, axes, dim, dim2))

    for src in space.layouts:
        lay = table[src]
        used = lay.used_axes()
        free = tuple(a for a in spaces.mesh.active if a not in used)
        for d, axes in enumerate(lay.dims):
            for k in range(1, len(axes) + 1):
                add(NodeKind.ALL_GATHER, src, Layout(_with_dim(lay, d, axes[:-k]), lay.partial), axes[-k:], d)
            for a in free:
                if not axes or a > axes[-1]:
                    add(NodeKind.DYN_SLICE, src, Layout(_with_dim(lay, d, (*axes, a)), lay.partial), (a,), d)
            if axes:
                a = axes[-1]
                for d2, axes2 in enumerate(lay.dims):
                    if d2 != d and (not axes2 or a > axes2[-1]):
                        dims = list(_with_dim(lay, d, axes[:-1]))
                        dims[d2] = (*axes2, a)
                        add(NodeKind.ALL_TO_ALL, src, Layout(tuple(dims), lay.partial), (a,), d, d2)
        for sub in _subsets(lay.partial):
            rest = tuple(a for a in lay.partial if a not in sub)
            add(NodeKind.ALL_REDUCE, src, Layout(lay.dims, rest), sub)
            for d, axes in enumerate(lay.dims):
                if not axes or sub[0] > axes[-1]:
                    add(NodeKind.REDUCE_SCATTER, src, Layout(_with_dim(lay, d, (*axes, *sub)), rest), sub, d)
    return edges
