"""Exact extraction: an integer program over the exported e-graph, solved by HiGHS through
`scipy.optimize.milp`.

One binary per e-node and per class; a chosen node needs its child classes; a used class has
exactly one chosen node; each output has a class in an allowed layout; each value is produced
by at most one local op or placement (the plans the runtime executes); loop-carried state is
placed in the layout it is returned in. Acyclicity rows (an order potential per class, tightened
per value group) keep the solver from "producing" a layout through a free cycle of gathers and
slices. The objective is the DAG cost: each chosen node paid once. The solver runs under a time
limit; its best plan and the optimality gap are reported.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ..egraph.export import ExportedGraph, NodeKind
from .cost import CostModel
from .result import Extraction, GroupChoice, ReshardStep

CUTOFF = 1e-6  # with an incumbent plan, only plans this much cheaper are sought
NO_CHEAPER = "optimal"  # proven: no plan is cheaper than the incumbent


@dataclass
class ExactResult:
    extraction: Extraction | None
    status: str
    gap: float | None
    seconds: float
    variables: int


def solve_exact(
    g: ExportedGraph,
    node_cost: np.ndarray,
    group_space: list[int],
    model: CostModel,
    combinable: frozenset[int],
    roots: list[tuple[int, frozenset[int] | None]],
    place_pins: dict[int, frozenset[int]],
    ties: list[tuple[int, int]],
    partial_layouts: set[int],
    time_limit: float,
    weight: np.ndarray | None = None,
    incumbent: float | None = None,
) -> ExactResult:
    """The cheapest plan of the e-graph, within `time_limit`. With `incumbent` (the cost of a
    plan in hand), only strictly cheaper plans are sought: the solver stops as soon as its bound
    proves there are none ("no cheaper plan": the incumbent is optimal)."""
    t0 = time.perf_counter()
    C, N = g.num_classes, g.num_nodes
    kinds = g.node_kind.tolist()  # Python ints: comparing numpy scalars with an IntEnum is slow
    place = int(NodeKind.PLACE)
    reshard_kinds = {int(k) for k in NodeKind if k.is_reshard}
    # classes reachable from the roots (others cannot matter)
    kids = [g.children(n) for n in range(N)]
    nodes_of: list[list[int]] = [[] for _ in range(C)]
    for n in range(N):
        if math.isfinite(node_cost[n]):
            nodes_of[int(g.node_class[n])].append(n)
    group_classes: dict[int, list[int]] = {}
    for c in range(C):
        group_classes.setdefault(int(g.class_group[c]), []).append(c)
    seen = np.zeros(C, dtype=bool)
    stack = [c for grp, _ in roots for c in group_classes.get(grp, [])]
    for h, _ in ties:
        stack += group_classes.get(h, [])
    while stack:
        c = stack.pop()
        if seen[c]:
            continue
        seen[c] = True
        for n in nodes_of[c]:
            stack.extend(int(k) for k in kids[n] if not seen[k])
    classes = np.flatnonzero(seen)
    cidx = {int(c): i for i, c in enumerate(classes)}
    # operands of a production must come strictly earlier (the program's order of value groups):
    # otherwise the solver could compute a value from itself through a rewritten term
    rank = _group_rank(g, nodes_of, kids)
    nodes = [n for c in classes for n in nodes_of[int(c)]
             if all(int(k) in cidx for k in kids[n])
             and (kinds[n] in reshard_kinds
                  or all(rank[int(g.class_group[k])] < rank[int(g.class_group[g.node_class[n]])] for k in kids[n]))]
    # pinned placements
    nodes = [n for n in nodes if not (kinds[n] == place and int(g.class_group[g.node_class[n]]) in place_pins
                                       and int(g.node_b[n]) not in place_pins[int(g.class_group[g.node_class[n]])])]
    nidx = {n: i for i, n in enumerate(nodes)}
    nx, ny = len(nodes), len(classes)
    # tie selectors: one binary per (tie, layout)
    tie_vars: list[tuple[int, int, int]] = []  # (tie index, layout, column)
    col = nx + ny
    # placements by value group and layout (ties read them; scanning every node per tie was
    # quadratic: 12 minutes of model building on a 194k-node e-graph)
    places: dict[int, dict[int, list[int]]] = {}
    for n, j in nidx.items():
        if kinds[n] == place:
            places.setdefault(int(g.class_group[g.node_class[n]]), {}).setdefault(int(g.node_b[n]), []).append(j)
    for t, (h, _) in enumerate(ties):
        for lay in sorted(places.get(h, {})):
            tie_vars.append((t, lay, col))
            col += 1
    tie_cols: dict[int, list[tuple[int, int]]] = {}
    for t, lay, c_ in tie_vars:
        tie_cols.setdefault(t, []).append((lay, c_))
    # order potentials for acyclicity, one per class
    t_off = col
    nvar = col + ny
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        nonlocal r
        for c_, v_ in entries:
            rows.append(r)
            cols.append(c_)
            vals.append(v_)
        lo.append(lb)
        hi.append(ub)
        r += 1

    for i, c in enumerate(classes):
        row([(nx + i, 1.0)] + [(nidx[n], -1.0) for n in nodes_of[int(c)] if n in nidx], 0.0, 0.0)
    for n, j in nidx.items():
        for k in set(int(x) for x in kids[n]):
            row([(j, 1.0), (nx + cidx[k], -1.0)], -np.inf, 0.0)
    # one production (placement or local op) per value group
    prods: dict[int, list[int]] = {}
    for n, j in nidx.items():
        if kinds[n] not in reshard_kinds:
            prods.setdefault(int(g.class_group[g.node_class[n]]), []).append(j)
    for js in prods.values():
        if len(js) > 1:
            row([(j, 1.0) for j in js], 0.0, 1.0)
    tied_roots = {r_: t for t, (_, r_) in enumerate(ties)}
    for ri, (grp, allowed) in enumerate(roots):
        ok = [cidx[c] for c in group_classes.get(grp, []) if c in cidx
              and int(g.class_layout[c]) not in partial_layouts
              and (allowed is None or int(g.class_layout[c]) in allowed)]
        if ri in tied_roots:
            continue
        row([(nx + i, 1.0) for i in ok], 1.0, np.inf)
    for t, (h, ri) in enumerate(ties):
        mine = tie_cols.get(t, [])
        row([(c_, 1.0) for _, c_ in mine], 1.0, 1.0)
        o = roots[ri][0]
        for lay, c_ in mine:
            oc = [cidx[c] for c in group_classes.get(o, []) if c in cidx and int(g.class_layout[c]) == lay]
            if oc:
                row([(nx + oc[0], 1.0), (c_, -1.0)], 0.0, np.inf)
            else:
                row([(c_, 1.0)], 0.0, 0.0)
            for j in places.get(h, {}).get(lay, []):
                row([(j, 1.0), (c_, -1.0)], -np.inf, 0.0)
    # a used value has a production
    for grp, js in prods.items():
        for c in group_classes.get(grp, []):
            if c in cidx:
                row([(nx + cidx[c], 1.0)] + [(j, -1.0) for j in js], -np.inf, 0.0)
    # acyclicity inside each value group (operands of local ops come earlier in the program):
    # t[class] >= t[child] + 1 when the resharding node is chosen, big-M = the group's size
    size = {grp: len(cs) for grp, cs in group_classes.items()}
    big = float(max(size.values(), default=1))
    for n, j in nidx.items():
        c = cidx[int(g.node_class[n])]
        if kinds[n] not in reshard_kinds:
            continue
        m = float(size[int(g.class_group[g.node_class[n]])])
        for k in set(int(x) for x in kids[n]):
            kk = cidx[k]
            row([(t_off + c, 1.0), (t_off + kk, -1.0), (j, -m)], 1.0 - m, np.inf)
    A = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    cost = np.zeros(nvar)
    cost[:nx] = [node_cost[n] for n in nodes]
    integrality = np.ones(nvar)
    integrality[t_off:] = 0
    lb = np.zeros(nvar)
    ub = np.ones(nvar)
    ub[t_off:] = big
    # normalised objective: the solver's absolute tolerances must not swamp picosecond costs
    scale = 1.0 / max(float(np.max(np.abs(cost))), 1e-300)
    constraints = [LinearConstraint(A, np.asarray(lo), np.asarray(hi))]
    if incumbent is not None and incumbent > 0:
        constraints.append(LinearConstraint(cost * scale, -np.inf, incumbent * scale * (1 - CUTOFF)))
    res = milp(cost * scale, integrality=integrality, bounds=Bounds(lb, ub), constraints=constraints,
               options={"time_limit": max(0.1, time_limit), "disp": False})
    seconds = time.perf_counter() - t0
    if res.x is None:
        if incumbent is not None and res.status == 2:  # infeasible: nothing beats the incumbent
            return ExactResult(None, NO_CHEAPER, 0.0, seconds, nvar)
        return ExactResult(None, str(res.message), None, seconds, nvar)
    x = res.x
    gap = None
    if getattr(res, "mip_gap", None) is not None:
        gap = float(res.mip_gap)
    chosen = {nodes[j] for j in range(nx) if x[j] > 0.5}
    w = weight if weight is not None else np.ones(g.num_groups)
    ex = _to_extraction(g, chosen, node_cost, group_space, model, combinable, roots, ties, tie_vars, x, cidx,
                        nx, partial_layouts, w)
    ex.seconds = seconds
    ex.method = "exact-ilp" + ("" if res.status == 0 else " (time limit)")
    status = "optimal" if res.status == 0 else str(res.message)
    return ExactResult(ex, status, gap, seconds, nvar)


def _group_rank(g: ExportedGraph, nodes_of: list[list[int]], kids: list[np.ndarray]) -> np.ndarray:
    """A topological rank of value groups by production operands (cycles broken by group id)."""
    G = g.num_groups
    deps: list[set[int]] = [set() for _ in range(G)]
    for c, ns in enumerate(nodes_of):
        grp = int(g.class_group[c])
        for n in ns:
            if NodeKind(int(g.node_kind[n])).is_reshard:
                continue
            for k in kids[n]:
                h = int(g.class_group[k])
                if h != grp:
                    deps[grp].add(h)
    rank = np.full(G, -1, dtype=np.int64)
    indeg = [len(d) for d in deps]
    users: list[list[int]] = [[] for _ in range(G)]
    for grp, d in enumerate(deps):
        for h in d:
            users[h].append(grp)
    import heapq

    ready = [x for x in range(G) if indeg[x] == 0]
    heapq.heapify(ready)
    r = 0
    while ready:
        x = heapq.heappop(ready)
        rank[x] = r
        r += 1
        for u in users[x]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, u)
    for x in range(G):
        if rank[x] < 0:
            rank[x] = r
            r += 1
    return rank


def _to_extraction(g, chosen, node_cost, group_space, model, combinable, roots, ties, tie_vars, x, cidx, nx,
                   partial_layouts, weight) -> Extraction:
    materialized: dict[int, set[int]] = {}
    for n in chosen:
        c = int(g.node_class[n])
        materialized.setdefault(int(g.class_group[c]), set()).add(int(g.class_layout[c]))
    root_layouts = []
    tied = {ri: t for t, (_, ri) in enumerate(ties)}
    for ri, (grp, allowed) in enumerate(roots):
        if ri in tied:
            lay = next(lay for t, lay, c_ in tie_vars if t == tied[ri] and x[c_] > 0.5)
        else:
            cands = sorted(lay for lay in materialized.get(grp, ()) if lay not in partial_layouts
                           and (allowed is None or lay in allowed))
            lay = cands[0]
        root_layouts.append(lay)
    # only what the roots reach: a free node (a collective of no cost) may be chosen and read by
    # no one, and the compiler would drop it from the program the plan predicts
    node_of = {int(g.node_class[n]): n for n in chosen}
    class_at = {(int(g.class_group[c]), int(g.class_layout[c])): c for c in node_of}
    stack = [class_at[(grp, lay)] for (grp, _), lay in zip(roots, root_layouts, strict=True)]
    needed: set[int] = set()
    while stack:
        c = stack.pop()
        if c not in needed:
            needed.add(c)
            stack.extend(int(k) for k in g.children(node_of[c]))
    prod: dict[int, int] = {}
    steps: dict[int, list[ReshardStep]] = {}
    materialized = {}
    for n in chosen:
        c = int(g.node_class[n])
        if c not in needed:
            continue
        grp = int(g.class_group[c])
        materialized.setdefault(grp, set()).add(int(g.class_layout[c]))
        kind = NodeKind(int(g.node_kind[n]))
        if kind.is_reshard:
            child = int(g.children(n)[0])
            src, dst = int(g.class_layout[child]), int(g.class_layout[c])
            axes = model.mesh.unmask(int(g.node_a[n]))
            cc = model.collective(kind, axes, group_space[grp], src, dst, grp in combinable)
            steps.setdefault(grp, []).append(ReshardStep(kind, src, dst, axes, int(g.node_b[n]), int(g.node_c[n]),
                                                         cc.seconds, cc.moved_bytes, cc.buffer_bytes))
        else:
            prod[grp] = n
    choices = {}
    total = 0.0
    for grp, n in prod.items():
        lay = int(g.class_layout[g.node_class[n]])
        st = steps.get(grp, [])
        # order the steps from the produced layout outwards
        order, frontier, rest = [], {lay}, list(st)
        while rest:
            nxt = [s for s in rest if s.src in frontier]
            if not nxt:
                break
            for s in nxt:
                order.append(s)
                frontier.add(s.dst)
                rest.remove(s)
        demanded = tuple(sorted(materialized.get(grp, {lay})))
        choices[grp] = GroupChoice(grp, n, lay, demanded, order, float(node_cost[n]), weight=float(weight[grp]))
        total += float(node_cost[n]) + float(weight[grp]) * sum(s.seconds for s in order)
    return Extraction(choices=choices, root_layouts=root_layouts, total_s=total, method="exact-ilp", seconds=0.0)
