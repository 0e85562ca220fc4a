"""Program structure the cost model needs beyond single e-nodes."""

from __future__ import annotations

from ..egraph.export import ExportedGraph
from ..egraph.program import Equation, Program
from ..rules.registry import rule_for


def is_heavy(eqn: Equation) -> bool:
    """A contraction (its PrimitiveRule says `heavy`): dot_general, conv_general_dilated."""
    return rule_for(eqn.primitive).heavy


def heavy_roles(program: Program) -> tuple[list[bool], list[bool]]:
    """Per value: (some contraction depends on it, it depends on a contraction). Loops count as
    unrolled: a carry's roles flow around the loop, and a folded loop's members (each layer's own
    arrays) share their body value's roles."""
    n = len(program.values)
    after = [False] * n
    before = [False] * n
    classes: dict[int, list[int]] = {}
    for a in program.aliases:
        classes.setdefault(program.alias(a), [program.alias(a)]).append(a)
    # (carry input, what it is fed from): the initial carry and the previous iteration's output
    loops = [(cin, src) for scan in program.scans
             for cin, cout, init in zip(scan.carry_in, scan.carry_out, scan.init, strict=True)
             for src in (cout, init) if isinstance(src, int)]
    heavy = [is_heavy(eqn) for eqn in program.equations]
    for _ in range(4):  # a few rounds reach the fixpoint of loops around loops
        changed = False
        for eqn, h in zip(program.equations, heavy, strict=True):
            dep = h or any(isinstance(a, int) and after[a] for a in eqn.inputs)
            for o in eqn.outputs:
                if dep and not after[o]:
                    after[o] = changed = True
        for eqn, h in zip(reversed(program.equations), reversed(heavy), strict=True):
            if h or any(before[o] for o in eqn.outputs):
                for a in eqn.inputs:
                    if isinstance(a, int) and not before[a]:
                        before[a] = changed = True
        for cin, src in loops:
            if after[src] and not after[cin]:
                after[cin] = changed = True
            if before[cin] and not before[src]:
                before[src] = changed = True
        for members in classes.values():
            for flags in (before, after):
                if any(flags[m] for m in members) and not all(flags[m] for m in members):
                    for m in members:
                        flags[m] = True
                    changed = True
        if not changed:
            break
    return before, after


def chained_values(program: Program) -> frozenset[int]:
    """Values that sit between two heavy ops (contractions) on a dependency chain: a collective
    of one cannot wait to be batched with others (an activation all-reduce between two matmuls);
    the rest can (gathering a weight depends on inputs only, reducing a gradient for the
    optimizer feeds only cheap ops). The runtime combines the latter's reductions itself
    (runtime/combine.py)."""
    before, after = heavy_roles(program)
    return frozenset(v for v in range(len(program.values)) if before[v] and after[v])


def combinable_groups(program: Program, graph: ExportedGraph) -> frozenset[int]:
    """Value groups whose collectives XLA's combiners can merge with others: none of their
    values is chained (`chained_values`)."""
    chained = chained_values(program)
    return frozenset(grp for grp, vids in enumerate(graph.group_values) if vids and chained.isdisjoint(vids))
