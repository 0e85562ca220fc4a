"""Resharding: the layouts one collective away from a layout of the same value.

Which layouts each kind reaches is its `edges` in `shardsat/egraph/collectives.py`: all-gather (split -> less split; the minor axes of a dimension), dynamic slice (replicated ->
split, free), all-reduce (partial -> summed), reduce-scatter (partial -> summed and split),
all-to-all (a dimension's minor axis moves to another dimension). Multi-axis forms are one
collective over several axes, as XLA emits them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..egraph.collectives import COLLECTIVES, NodeKind
from ..egraph.layout import Space, SpaceTable


@dataclass(frozen=True)
class ReshardEdge:
    kind: NodeKind
    src: int
    dst: int
    axes: tuple[int, ...]
    dim: int = 0
    dim2: int = 0


def reshard_edges(space: Space, spaces: SpaceTable) -> list[ReshardEdge]:
    """Every one-collective edge between layouts of `space`, per source layout in the order of
    `COLLECTIVES` (each kind's `edges` says which layouts it reaches)."""
    table = spaces.layouts
    members = frozenset(space.layouts)
    edges: list[ReshardEdge] = []
    for src in space.layouts:
        lay = table[src]
        used = lay.used_axes()
        free = tuple(a for a in spaces.mesh.active if a not in used)
        for kind in COLLECTIVES.values():
            for dst_layout, axes, dim, dim2 in kind.edges(lay, free):
                dst = table.ids.get(dst_layout)
                if dst is not None and dst in members:
                    edges.append(ReshardEdge(kind.node, src, dst, axes, dim, dim2))
    return edges
