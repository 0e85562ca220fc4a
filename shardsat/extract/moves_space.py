"""Tensor-space moves: every complete value of one tensor space (shape, dtype) moved to one
layout at once. Single-value and chain moves cannot leave a local optimum where a whole residual
stream (and the loop carry that holds it) sits in a poor layout: each value alone would pay
resharding on both sides."""

from __future__ import annotations

import math
import time

import numpy as np

from .planstate import PlanState
from .searchgraph import EPS, SearchGraph

# space moves: rounds per run, and the heaviest tensor spaces tried in each
MAX_SPACE_ROUNDS = 4
MAX_SPACES = 16

# per (space key, every_layout): neighbourhoods in which a space move was tried and found nothing
SpaceSeen = dict[tuple[int, bool, bool], set[tuple]]


def _ranked_spaces(sg: SearchGraph, st: PlanState) -> tuple[list[tuple[int, bool]], dict[tuple[int, bool], list[int]]]:
    """The spaces with two or more used values, heaviest (size times weight) first, and their values."""
    by_space: dict[tuple[int, bool], list[int]] = {}
    for grp in st.choice:
        if sg.group_space[grp] >= 0:
            by_space.setdefault(sg.group_key[grp], []).append(grp)
    size = {key: float(np.prod(sg.spaces.spaces[key[0]].shape or (1,))) for key in by_space}
    ranked = sorted((key for key, grps in by_space.items() if len(grps) >= 2),
                    key=lambda key: (-size[key] * sum(sg.weight[x] for x in by_space[key]), key))
    return ranked, by_space


def space_moves(sg: SearchGraph, st: PlanState, seen_by_space: SpaceSeen, work: list[int], deadline: float,
                every_layout: bool = True) -> set[int]:
    """Move every complete value of one tensor space to one layout at once, heaviest spaces
    first, keeping each move that lowers the exact DAG cost. every_layout=False tries only the
    layouts the space's values are produced or read in now (a quick pass for starting points;
    the polishing pass tries every one). `seen_by_space` remembers the spaces that found nothing."""
    ranked, by_space = _ranked_spaces(sg, st)
    tie_roots: dict[int, list[int]] = {h: rs for h, rs in st.roots_of.items() if h in st.place_of}
    layout_of = sg.node_layout.__getitem__
    changed: set[int] = set()
    for key in ranked[:MAX_SPACES]:
        if time.perf_counter() >= deadline:
            break
        groups = sorted((x for x in by_space[key] if not sg.spaces.layouts[layout_of(st.choice[x])].partial),
                        key=lambda x: sg.rank[x])
        if len(groups) < 2:
            continue
        # the outcome depends only on the choices around these values: skip a space whose
        # neighbourhood is as it was when it last found no move (the common case in later
        # rounds and when a plan is resumed)
        snap = space_snapshot(sg, st, groups, tie_roots)
        seen = seen_by_space.setdefault((*key, every_layout), set())
        if snap in seen:
            continue
        best_plan = _best_space_plan(sg, st, groups, tie_roots, work, deadline, every_layout)
        if best_plan is not None:
            try_moves(sg, st, best_plan, tie_roots, keep=True)
            changed.update(best_plan)
        else:
            seen.add(snap)
    return changed


def _best_space_plan(sg: SearchGraph, st: PlanState, groups: list[int], tie_roots: dict[int, list[int]],
                     work: list[int], deadline: float, every_layout: bool) -> dict[int, int] | None:
    """The move of these values to one layout that saves most (more than EPS), or None."""
    layout_of = sg.node_layout.__getitem__
    # group -> layout -> productions
    at: dict[int, dict[int, list[int]]] = {x: sg.by_layout(x, st.prod[x]) for x in groups if st.prod[x]}
    candidates = ({lay for ax in at.values() for lay in ax} if every_layout else
                  {layout_of(st.choice[x]) for x in groups} | {lay for x in groups for lay in st.demand[x]})
    targets = sorted(lay for lay in candidates if not sg.spaces.layouts[lay].partial)
    best_gain, best_plan = EPS, None
    now: dict[int, float] = {}  # each touched value's seconds in the plan as it is (every try is undone)
    for b in targets:
        if time.perf_counter() >= deadline:
            break
        plan = space_plan(sg, st, groups, b, tie_roots, at)
        work[0] += len(groups)
        if not plan:
            continue
        gain = try_moves(sg, st, plan, tie_roots, keep=False, now=now)
        if gain > best_gain:
            best_gain, best_plan = gain, plan
    return best_plan


def space_snapshot(sg: SearchGraph, st: PlanState, groups: list[int], tie_roots: dict[int, list[int]]) -> tuple:
    """Everything a space move's outcome reads: the productions chosen for the space's
    values, their possible operands, tied outputs, and every consumer of those (which make
    up their demands), plus the layouts of the roots among them."""
    roots = st.roots
    base = set(groups)
    for grp in groups:
        if grp in st.place_of:
            for n in st.place_of[grp].values():
                base.update(sg.demands(n))
        else:
            base.update(sg.operands_of(grp, st.prod[grp]))
        base.update(roots[r][0] for r in tie_roots.get(grp, ()))
    deps = set(base)
    for x in base:
        deps.update(sg.parents[x])
    ordered = sorted(deps)
    return (tuple(st.choice.get(x, -1) for x in ordered),
            tuple(st.root_layouts[r] for r, (grp, _) in enumerate(roots) if grp in base))


def space_plan(sg: SearchGraph, st: PlanState, groups: list[int], b: int, tie_roots: dict[int, list[int]],
               at: dict[int, dict[int, list[int]]]) -> dict[int, int]:
    """For each group (in order), the production in layout b that is cheapest given the
    groups before it already moved; groups with none in b stay."""
    roots, choice = st.roots, st.choice
    cost_l, weight_l, node_layout, demands, steiner_cost = sg.cost_l, sg.weight_l, sg.node_layout, sg.demands, sg.steiner_cost
    moved: dict[int, int] = {}
    for grp in groups:
        if grp in st.place_of:
            node = st.place_of[grp].get(b)
            rs = tie_roots.get(grp, [])
            if node is None or any(roots[r][1] is not None and b not in roots[r][1] for r in rs) or any(
                    (roots[r][0], b) not in sg.class_at for r in rs):
                continue
            if node != choice.get(grp):
                moved[grp] = node
            continue
        best_n, best_v = -1, math.inf
        for n in at.get(grp, {}).get(b, ()):
            v = cost_l[n]
            for h, lays in demands(n).items():
                if h not in choice:
                    v = math.inf
                    break
                src = moved.get(h, choice[h])
                v += weight_l[h] * steiner_cost(h, node_layout[src], frozenset(lays))
            if v < best_v:
                best_n, best_v = n, v
        if best_n >= 0 and best_n != choice[grp]:
            moved[grp] = best_n
    return moved


def try_moves(sg: SearchGraph, st: PlanState, plan: dict[int, int], tie_roots: dict[int, list[int]],
              keep: bool, now: dict[int, float] | None = None) -> float:
    """Apply the moves, return the exact saving; undo them unless `keep`. `now`: the values'
    seconds in the plan as it is, kept between tries that are all undone (the same sums
    st.cost_of takes, in the same order)."""
    g = sg.g
    choice = st.choice
    touched = set(plan)
    for grp, n in plan.items():
        touched |= set(sg.demands(choice[grp])) | set(sg.demands(n))
        touched |= {st.roots[r][0] for r in tie_roots.get(grp, [])}
    touched = {x for x in touched if x in choice}
    if now is None:
        before = st.cost_of(sg, touched)
    else:
        before = 0.0
        for x in touched:
            c = now.get(x)
            if c is None:
                c = now[x] = st.cost_of(sg, {x})
            before += c
    old = {grp: choice[grp] for grp in plan}

    def put(nodes: dict[int, int]) -> None:
        for grp, n in nodes.items():
            if grp in st.place_of:
                st.retie(grp, tie_roots.get(grp, []), int(g.node_b[n]), n)
            else:
                st.set(sg, [grp], [n])

    put(plan)
    after = st.cost_of(sg, touched)
    gain = before - after - 1e-9 * before
    if not keep or not (gain > EPS):
        put(old)  # re-tying an input restores its roots' layouts too
    return gain
