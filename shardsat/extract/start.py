"""The estimate's plan, the first one a search improves.

1. Bottom-up estimate: est(class) = cheapest way to obtain it, where an operand's estimate is
   shared among the value's consumers (divided by their count) so that values used many times
   (residual streams, weights read forward and backward) are not paid once per use as tree-cost
   extraction would (egglog-notes.md).
2. Top-down choice, consumers before producers: each value picks the production that minimises
   its own cost plus the resharding tree to its *actual* demanded layouts plus its operands'
   estimates.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import NoPlanError
from .planstate import PlanState
from .searchgraph import SearchGraph
from .spacepaths import SpacePaths

# a value is reached in Python, at the layouts it has classes in, where that is at most this many
# (row, class) pairs: below, numpy's per-call overhead exceeded the work (most values of a GPT
# step on 2x4: the estimate was a tenth of its planning); above, numpy's rows win (2x2x2)
PY_REACH_PAIRS = 128


def estimates(sg: SearchGraph, st: PlanState) -> tuple[list[float], list[float], dict[int, float]]:
    """Per class the estimated seconds to obtain it, per group its share divisor (its
    consumers and outputs), and per production its own cost plus its operands' shares (what
    choose_top_down weighs too)."""
    uses = [float(max(1, len(ps))) for ps in sg.parents]
    for grp, _ in st.roots:
        uses[grp] += 1
    est = [math.inf] * sg.g.num_classes
    share = [math.inf] * sg.g.num_classes  # est[c] / uses[c's group], the same division
    node_v: dict[int, float] = {}
    cost_l, node_layout, kids = sg.cost_l, sg.node_layout, sg.kids
    for grp in sg.order:
        classes = sg.group_classes[grp]
        if not classes:
            continue
        sp = sg.paths[sg.group_key[grp]]
        index = sp.index
        row_v: dict[int, float] = {}  # layout row -> its cheapest production's value
        for n in st.prod[grp]:
            v = node_v[n] = cost_l[n] + sum(map(share.__getitem__, kids[n]))
            r = index[node_layout[n]]
            if v < row_v.get(r, math.inf):
                row_v[r] = v
        rows = [(r, v) for r, v in row_v.items() if math.isfinite(v)]
        if rows:
            _reach(sg, grp, sp, rows, classes, est)
            for c in classes:
                share[c] = est[c] / uses[grp]
    return est, uses, node_v


def _reach(sg: SearchGraph, grp: int, sp: SpacePaths, rows: list[tuple[int, float]], classes: list[int],
           est: list[float]) -> None:
    """Each class's estimate: the cheapest production row resharded to its layout (the
    value's weight times the distance)."""
    w = sg.weight_l[grp]
    cols = [sp.index[sg.class_layout_l[c]] for c in classes]
    dist = None
    if len(rows) * len(classes) <= PY_REACH_PAIRS and 0.0 < w < math.inf:
        dist = [sp.dist_list(r) for r, _ in rows]
    if dist is None or None in dist:
        rows = sorted(rows)
        vals = np.array([v for _, v in rows])
        reach = np.min(vals[:, None] + w * sp.dist[[r for r, _ in rows]], axis=0).tolist()
        for c, j in zip(classes, cols, strict=True):
            est[c] = reach[j]
        return
    for c, j in zip(classes, cols, strict=True):
        m = math.inf
        for (_, v), d in zip(rows, dist, strict=True):
            x = v + w * d[j]
            if x < m:
                m = x
        est[c] = m


def choose_roots(sg: SearchGraph, st: PlanState, est: list[float], tied_root: dict[int, int],
                 seed: dict[int, int] | None) -> None:
    """Each output's layout: the cheapest estimate it allows; a tied output in the layout its
    input is seeded in or its first tied output chose, its input then placed there."""
    g = sg.g
    cls_layout = g.class_layout
    demand, root_layouts = st.demand, st.root_layouts
    forced: dict[int, int] = {}  # tied input group -> the layout its first root chose
    for r, (grp, allowed) in enumerate(st.roots):
        best_c, best_v = -1, math.inf
        tied = st.place_of.get(tied_root[r]) if r in tied_root else None
        if tied is not None:
            h = tied_root[r]
            lay = forced.get(h, seed.get(h, -1) if seed else -1)
            if lay in tied and (allowed is None or lay in allowed) and (grp, lay) in sg.class_at:
                demand[grp][lay] += 1
                root_layouts.append(lay)
                st.prod[h] = [tied[lay]]
                forced[h] = lay
                continue
        for c in sg.group_classes[grp]:
            lay = int(cls_layout[c])
            if sg.spaces.layouts[lay].partial:
                continue
            if allowed is not None and lay not in allowed:
                continue
            if tied is not None and lay not in tied:
                continue
            if est[c] < best_v:
                best_c, best_v = c, est[c]
        if best_c < 0:
            raise NoPlanError(
                f"No layout of {sg.describe(grp)} can be produced"
                + (" within its pinned layout." if allowed is not None else ".")
            )
        demand[grp][int(cls_layout[best_c])] += 1
        root_layouts.append(int(cls_layout[best_c]))
        if tied is not None:
            h = tied_root[r]
            st.prod[h] = [tied[int(cls_layout[best_c])]]
            forced[h] = int(cls_layout[best_c])


def choose_top_down(sg: SearchGraph, st: PlanState, est: list[float], uses: list[float],
                    node_v: dict[int, float]) -> None:
    """Consumers before producers, each demanded value the production cheapest for its actual
    demands plus its operands' estimates (`node_v`, estimates' value of each production it
    weighed; a tied input's place node chosen since is weighed here)."""
    choice, demand = st.choice, st.demand
    cost_l, node_layout, kids, cls_group_l = sg.cost_l, sg.node_layout, sg.kids, sg.class_group_l
    for grp in reversed(sg.order):
        if not demand[grp]:
            continue
        targets = frozenset(demand[grp])
        best_n, best_v = -1, math.inf
        w = sg.weight_l[grp]
        for n in st.prod[grp]:
            v = node_v.get(n)
            if v is None:
                v = cost_l[n] + sum(est[c] / uses[cls_group_l[c]] for c in kids[n])
            if v >= best_v:
                continue
            v += w * sg.steiner_cost(grp, node_layout[n], targets)
            if v < best_v:
                best_n, best_v = n, v
        if best_n < 0:
            raise NoPlanError(f"No way to produce {sg.describe(grp)} in the layouts its consumers need.")
        choice[grp] = best_n
        for h, lay in sg.kid_gl[best_n]:
            demand[h][lay] += 1
