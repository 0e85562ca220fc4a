"""Single-value moves: one value's production changed, the rest of the plan fixed, priced
exactly on the DAG (its own node and resharding tree, and its operands' resharding trees);
and the same pricing read as a plan's "why this" (the best alternative layout per value)."""

from __future__ import annotations

import math

from .moves_tie import tied_alternative
from .planstate import PlanState
from .searchgraph import EPS, SearchGraph


def improve(sg: SearchGraph, st: PlanState, grp: int) -> bool:
    """Best single change of this value's production, priced exactly on the DAG: its own
    node and resharding tree, and its operands' resharding trees."""
    choice, demand = st.choice, st.demand
    own, demands = sg.own, sg.demands
    cur = choice[grp]
    targets = frozenset(demand[grp])
    base = own(grp, cur, targets)
    cur_d = demands(cur)
    # operand layouts still demanded without this value's current use, and their price now
    rest: dict[int, frozenset[int]] = {}
    before: dict[int, float] = {}
    # a bound: an operand's resharding tree only grows with the layouts asked of it, so no
    # production saves more on its operands than dropping the current one's demands does
    saving = 0.0
    for h, mine in cur_d.items():
        if h not in choice:
            return False  # an operand not produced in the current plan: no move is exact
        d = demand[h]
        rest[h] = frozenset(k for k, v in d.items() if v > mine.count(k))
        before[h] = own(h, choice[h], frozenset(d))
        saving += own(h, choice[h], rest[h]) - before[h]
    best_delta, best_n = -EPS - 1e-9 * base, -1
    slack = EPS + 1e-9 * abs(base)  # the bound sums in another order than delta below
    # own(grp, n, targets) inlined for the loop over every production (same operations)
    costs, cost_l, node_layout, pk, wg = sg.cache.cost, sg.cost_l, sg.node_layout, sg.group_pk[grp], sg.weight_l[grp]
    for n in st.prod[grp]:
        if n == cur:
            continue
        c = costs.get((pk, node_layout[n], targets))
        if c is None:
            c = sg.steiner_cost(grp, node_layout[n], targets)
        delta = cost_l[n] + wg * c - base
        if delta + saving > best_delta + slack:
            continue
        new_d = demands(n)
        ok = True
        for h in cur_d.keys() | new_d.keys():
            if h not in choice:
                ok = False  # operand not produced in the current plan
                break
            if h not in rest:
                d = demand[h]
                mine = cur_d.get(h, ())
                rest[h] = frozenset(k for k, v in d.items() if v > mine.count(k)) if mine else frozenset(d)
                before[h] = own(h, choice[h], frozenset(d))
            lays = new_d.get(h)
            after = rest[h].union(lays) if lays else rest[h]
            if not after:
                ok = False
                break
            delta += own(h, choice[h], after) - before[h]
            if delta >= best_delta and h not in new_d:
                break
        if ok and delta < best_delta:
            best_delta, best_n = delta, n
    if best_n < 0:
        return False
    st.set(sg, [grp], [best_n])
    return True


def alternative(sg: SearchGraph, st: PlanState, grp: int) -> tuple[int, float] | None:
    """(layout, extra seconds) of the best production of this value in another layout, the
    rest of the plan fixed (operands' resharding priced exactly)."""
    g = sg.g
    choice, demand = st.choice, st.demand
    cur = choice[grp]
    cur_lay = int(g.class_layout[g.node_class[cur]])
    targets = frozenset(demand[grp])
    base = sg.own(grp, cur, targets)
    cur_d = sg.demands(cur)
    best: tuple[int, float] | None = None
    for n in st.prod[grp] if grp not in st.place_of else st.place_of[grp].values():
        lay = int(g.class_layout[g.node_class[n]])
        if lay == cur_lay:
            continue
        delta = sg.own(grp, n, targets) - base
        new_d = sg.demands(n)
        for h in cur_d.keys() | new_d.keys():
            if h not in choice:
                delta = math.inf
                break
            rest = demand[h].copy()
            for lay_h in cur_d.get(h, ()):
                rest[lay_h] -= 1
            after = frozenset(k for k, v in rest.items() if v > 0) | frozenset(new_d.get(h, ()))
            if not after:
                delta = math.inf
                break
            delta += sg.own(h, choice[h], after) - sg.own(h, choice[h], frozenset(demand[h]))
        if math.isfinite(delta) and (best is None or delta < best[1]):
            best = (lay, delta)
    return best


def alternatives(sg: SearchGraph, st: PlanState) -> dict[int, tuple[int, float]]:
    """Per used value, the cheapest plan that differs in its layout ("why this"). Tries moves on
    `st`, so callers pass a copy of the plan's state."""
    out = {}
    for grp in st.choice:
        if grp in st.place_of and st.roots_of.get(grp):
            alt = tied_alternative(sg, st, grp, st.roots_of[grp])
        else:
            alt = alternative(sg, st, grp)
        if alt is not None:
            out[grp] = alt
    return out
