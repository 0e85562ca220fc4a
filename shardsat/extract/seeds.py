"""Global starting points for the local search: the layouts experts start from.

Extraction improves a plan one value or one chain at a time; switching every parameter between
replicated and sharded at once is beyond such moves. For a training step (loop-carried state)
two seeds are tried besides the cost estimate: data parallel (state replicated, each other input
split on its leading dimension over as many mesh axes as divide it) and fully sharded state
(ZeRO-3: each state leaf split on its largest dimension that divides, inputs as before).
"""

from __future__ import annotations

from ..egraph.export import ExportedGraph
from ..egraph.layout import Layout, SpaceTable
from ..egraph.program import Program


def _split(shape: tuple[int, ...], dim: int, spaces: SpaceTable) -> Layout | None:
    mesh = spaces.mesh
    axes: list[int] = []
    for a in mesh.active:  # as many axes as divide, in mesh order
        if shape[dim] % mesh.size((*axes, a)) == 0:
            axes.append(a)
    if not axes:
        return None
    return Layout(tuple(tuple(axes) if d == dim else () for d in range(len(shape))), ())


def seeds(program: Program, graph: ExportedGraph, spaces: SpaceTable, ties: list[tuple[int, int]],
          pins: dict[int, int]) -> list[dict[int, int]]:
    """Seeds as {input group: layout id}; empty when the program carries no state."""
    if not ties:
        return []
    state = {a for a, _ in ties}
    dp: dict[int, int] = {}
    zero: dict[int, int] = {}
    for pos, vid in enumerate(program.args):
        if pos in pins:
            continue
        grp = graph.value_group.get(vid)
        if grp is None:
            continue
        shape = program.values[vid].shape
        if pos in state:
            dp[grp] = spaces.layouts.intern(Layout.replicated(len(shape)))
            if shape:
                big = max(range(len(shape)), key=lambda d: (shape[d], -d))
                lay = _split(shape, big, spaces)
                if lay is not None:
                    zero[grp] = spaces.layouts.intern(lay)
        elif shape:
            lay = _split(shape, 0, spaces)
            if lay is not None:
                dp[grp] = zero[grp] = spaces.layouts.intern(lay)
    return [dp, zero]
