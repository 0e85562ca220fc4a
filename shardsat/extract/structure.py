"""Program structure the cost model needs beyond single e-nodes."""

from __future__ import annotations

from ..egraph.export import ExportedGraph
from ..egraph.program import Program

HEAVY = frozenset({"dot_general", "conv_general_dilated"})


def heavy_roles(program: Program) -> tuple[list[bool], list[bool]]:
    """Per value: (some contraction depends on it, it depends on a contraction)."""
    n = len(program.values)
    after = [False] * n
    before = [False] * n
    for eqn in program.equations:
        dep = eqn.name in HEAVY or any(isinstance(a, int) and after[a] for a in eqn.inputs)
        for o in eqn.outputs:
            after[o] = dep
    for eqn in reversed(program.equations):
        if eqn.name in HEAVY or any(before[o] for o in eqn.outputs):
            for a in eqn.inputs:
                if isinstance(a, int):
                    before[a] = True
    return before, after


def combinable_groups(program: Program, graph: ExportedGraph) -> frozenset[int]:
    """Value groups whose collectives XLA's combiners can merge with others: those that do not
    sit between two heavy ops (contractions) on a dependency chain. Gathering a weight (depends
    on inputs only) or reducing a gradient for the optimizer (feeds only cheap ops) can be
    delayed or hoisted and batched; an activation all-reduce between two matmuls cannot."""
    before, after = heavy_roles(program)
    out = set()
    for grp, vids in enumerate(graph.group_values):
        if vids and all(not (after[v] and before[v]) for v in vids):
            out.add(grp)
    return frozenset(out)
