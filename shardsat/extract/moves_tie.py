"""Tie moves: loop-carried state (an input placed in the layout an output returns it in) moves
its placement and every output tied to it together; moved apart, each would pay resharding."""

from __future__ import annotations

import math

from .planstate import PlanState
from .searchgraph import SearchGraph, improvement_bar


def tie_options(sg: SearchGraph, st: PlanState, h: int, rs: list[int]
                ) -> tuple[float, list[tuple[int, float]]] | None:
    """The exact cost of a state leaf (its placement and every root tied to it) as it is, and
    with all of them moved to each other layout they allow; None if a root is unplanned."""
    roots = st.roots
    outs = [roots[r][0] for r in rs]
    if any(o not in st.choice for o in outs):
        return None
    cur = st.root_layouts[rs[0]]
    touched = set(outs) | {h}
    before = st.cost_of(sg, touched)
    options = []
    for lay, node in sorted(st.place_of[h].items()):
        if lay == cur or any(roots[r][1] is not None and lay not in roots[r][1] for r in rs):
            continue
        if any((o, lay) not in sg.class_at for o in outs):
            continue
        st.retie(h, rs, lay, node)
        options.append((lay, st.cost_of(sg, touched)))
        st.retie(h, rs, cur, st.place_of[h][cur])
    return before, options


def move_tie(sg: SearchGraph, st: PlanState, h: int, rs: list[int]) -> bool:
    """Move a state leaf's layout (input placement and every root tied to it together) to the
    layout that minimises the exact cost of all of them."""
    costed = tie_options(sg, st, h, rs)
    if costed is None:
        return False
    before, options = costed
    best, best_lay = improvement_bar(before), -1
    for lay, after in options:
        if after < best:
            best, best_lay = after, lay
    if best_lay < 0:
        return False
    st.retie(h, rs, best_lay, st.place_of[h][best_lay])
    return True


def tied_alternative(sg: SearchGraph, st: PlanState, h: int, rs: list[int]) -> tuple[int, float] | None:
    """(layout, extra seconds) of loop-carried state placed and returned in another layout:
    the input and every output tied to it move together, as `move_tie` moves them."""
    costed = tie_options(sg, st, h, rs)
    if costed is None:
        return None
    before, options = costed
    deltas = [(lay, after - before) for lay, after in options if math.isfinite(after - before)]
    return min(deltas, key=lambda x: x[1]) if deltas else None
