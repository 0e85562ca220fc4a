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

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult, milp
from scipy.sparse import coo_matrix

from ..egraph.export import ExportedGraph, NodeKind
from .cost import CostModel
from .result import Extraction, GroupChoice, ReshardStep
from .searchgraph import operands_first

CUTOFF = 1e-6  # with an incumbent plan, only plans this much cheaper are sought
NO_CHEAPER = "optimal"  # proven: no plan is cheaper than the incumbent


@dataclass
class ExactResult:
    extraction: Extraction | None
    status: str
    gap: float | None
    seconds: float
    variables: int


Roots = list[tuple[int, frozenset[int] | None]]  # (value group, allowed layouts or None) per output
Ties = list[tuple[int, int]]  # (argument's value group, index of the root it is returned as)


def solve_exact(
    g: ExportedGraph,
    node_cost: np.ndarray,
    group_space: list[int],
    model: CostModel,
    combinable: frozenset[int],
    roots: Roots,
    place_pins: dict[int, frozenset[int]],
    ties: Ties,
    partial_layouts: set[int],
    time_limit: float,
    weight: np.ndarray | None = None,
    incumbent: float | None = None,
) -> ExactResult:
    """The cheapest plan of the e-graph, within `time_limit`. With `incumbent` (the cost of a
    plan in hand), only strictly cheaper plans are sought: the solver stops as soon as its bound
    proves there are none ("no cheaper plan": the incumbent is optimal)."""
    t0 = time.perf_counter()
    gr = _Graph.of(g, node_cost)
    cols = _columns(gr, _reachable(gr, roots, ties), place_pins, ties)
    rows = _Rows()
    _choice_rows(rows, gr, cols)
    prods = _production_rows(rows, gr, cols)
    _output_rows(rows, gr, cols, roots, ties, partial_layouts)
    _used_rows(rows, gr, cols, prods)
    _acyclic_rows(rows, gr, cols)
    cost = np.zeros(cols.nvar)
    cost[:cols.nx] = [node_cost[n] for n in cols.nodes]
    res = _milp(rows, cols, cost, gr.big, time_limit, incumbent)
    seconds = time.perf_counter() - t0
    if res.x is None:
        if incumbent is not None and res.status == 2:  # infeasible: nothing beats the incumbent
            return ExactResult(None, NO_CHEAPER, 0.0, seconds, cols.nvar)
        return ExactResult(None, str(res.message), None, seconds, cols.nvar)
    x = res.x
    gap = None
    if getattr(res, "mip_gap", None) is not None:
        gap = float(res.mip_gap)
    chosen = {cols.nodes[j] for j in range(cols.nx) if x[j] > 0.5}
    w = weight if weight is not None else np.ones(g.num_groups)
    ex = _to_extraction(g, chosen, node_cost, group_space, model, combinable, roots, ties, cols.tie_vars, x,
                        partial_layouts, w)
    ex.seconds = seconds
    ex.method = "exact-ilp" + ("" if res.status == 0 else " (time limit)")
    status = "optimal" if res.status == 0 else str(res.message)
    return ExactResult(ex, status, gap, seconds, cols.nvar)


_PLACE = int(NodeKind.PLACE)
_RESHARD = frozenset(int(k) for k in NodeKind if k.is_reshard)


@dataclass
class _Graph:
    """The exported graph as the model builder reads it: Python ints and lists (comparing numpy
    scalars with an IntEnum is slow), finite-cost nodes by class, classes by value group."""

    g: ExportedGraph
    kinds: list[int]
    kids: list[np.ndarray]
    nodes_of: list[list[int]]  # the nodes of finite cost in each class
    group_classes: dict[int, list[int]]

    @classmethod
    def of(cls, g: ExportedGraph, node_cost: np.ndarray) -> _Graph:
        kids = [g.children(n) for n in range(g.num_nodes)]
        nodes_of: list[list[int]] = [[] for _ in range(g.num_classes)]
        for n in range(g.num_nodes):
            if math.isfinite(node_cost[n]):
                nodes_of[int(g.node_class[n])].append(n)
        group_classes: dict[int, list[int]] = {}
        for c in range(g.num_classes):
            group_classes.setdefault(int(g.class_group[c]), []).append(c)
        return cls(g, g.node_kind.tolist(), kids, nodes_of, group_classes)

    def group(self, n: int) -> int:
        """The value group node `n` computes."""
        return int(self.g.class_group[self.g.node_class[n]])

    def is_reshard(self, n: int) -> bool:
        return self.kinds[n] in _RESHARD

    @property
    def big(self) -> float:
        """The largest value group's class count: the order potentials' range and big-M."""
        return float(max((len(cs) for cs in self.group_classes.values()), default=1))


def _reachable(gr: _Graph, roots: Roots, ties: Ties) -> np.ndarray:
    """The classes reachable from the roots and the tied arguments (others cannot matter)."""
    seen = np.zeros(gr.g.num_classes, dtype=bool)
    stack = [c for grp, _ in roots for c in gr.group_classes.get(grp, [])]
    for h, _ in ties:
        stack += gr.group_classes.get(h, [])
    while stack:
        c = stack.pop()
        if seen[c]:
            continue
        seen[c] = True
        for n in gr.nodes_of[c]:
            stack.extend(int(k) for k in gr.kids[n] if not seen[k])
    return np.flatnonzero(seen)


@dataclass
class _Columns:
    """The integer program's variables, in column order: one binary per e-node that may be chosen,
    one per used class, one per (tie, layout), then one order potential per class."""

    nodes: list[int]  # the e-node of each node column
    nidx: dict[int, int]  # e-node -> its column
    classes: np.ndarray  # the class of each class column (offset nx)
    cidx: dict[int, int]  # class -> its class column, less nx
    tie_vars: list[tuple[int, int, int]]  # (tie index, layout, column)
    places: dict[int, dict[int, list[int]]]  # value group -> layout -> columns of its placements

    @property
    def nx(self) -> int:
        return len(self.nodes)

    @property
    def t_off(self) -> int:
        """The first order potential's column."""
        return len(self.nodes) + len(self.classes) + len(self.tie_vars)

    @property
    def nvar(self) -> int:
        return self.t_off + len(self.classes)

    def tie_cols(self) -> dict[int, list[tuple[int, int]]]:
        """(layout, column) of each tie's selectors, by tie index."""
        out: dict[int, list[tuple[int, int]]] = {}
        for t, lay, c_ in self.tie_vars:
            out.setdefault(t, []).append((lay, c_))
        return out


def _columns(gr: _Graph, classes: np.ndarray, place_pins: dict[int, frozenset[int]], ties: Ties) -> _Columns:
    """The variables over the reachable classes: the nodes whose children are all reachable and
    that respect the program's order and the pins, and one tie selector per placed layout."""
    g, kinds, kids = gr.g, gr.kinds, gr.kids
    cidx = {int(c): i for i, c in enumerate(classes)}
    # operands of a production must come strictly earlier (the program's order of value groups):
    # otherwise the solver could compute a value from itself through a rewritten term
    rank = _group_rank(g, gr.nodes_of, kids)
    nodes = [n for c in classes for n in gr.nodes_of[int(c)]
             if all(int(k) in cidx for k in kids[n])
             and (kinds[n] in _RESHARD
                  or all(rank[int(g.class_group[k])] < rank[gr.group(n)] for k in kids[n]))]
    # pinned placements
    nodes = [n for n in nodes if not (kinds[n] == _PLACE and gr.group(n) in place_pins
                                       and int(g.node_b[n]) not in place_pins[gr.group(n)])]
    nidx = {n: i for i, n in enumerate(nodes)}
    # placements by value group and layout (ties read them; scanning every node per tie was
    # quadratic: 12 minutes of model building on a 194k-node e-graph)
    places: dict[int, dict[int, list[int]]] = {}
    for n, j in nidx.items():
        if kinds[n] == _PLACE:
            places.setdefault(gr.group(n), {}).setdefault(int(g.node_b[n]), []).append(j)
    # tie selectors: one binary per (tie, layout)
    tie_vars: list[tuple[int, int, int]] = []
    col = len(nodes) + len(classes)
    for t, (h, _) in enumerate(ties):
        for lay in sorted(places.get(h, {})):
            tie_vars.append((t, lay, col))
            col += 1
    return _Columns(nodes, nidx, classes, cidx, tie_vars, places)


@dataclass
class _Rows:
    """The constraint matrix, built a row at a time in COO form, with each row's bounds."""

    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)

    def add(self, entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        r = len(self.lo)
        for c_, v_ in entries:
            self.rows.append(r)
            self.cols.append(c_)
            self.vals.append(v_)
        self.lo.append(lb)
        self.hi.append(ub)

    def constraint(self, nvar: int) -> LinearConstraint:
        A = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), nvar)).tocsr()
        return LinearConstraint(A, np.asarray(self.lo), np.asarray(self.hi))


def _choice_rows(rows: _Rows, gr: _Graph, cols: _Columns) -> None:
    """A used class has exactly one chosen node; a chosen node needs its child classes."""
    nx = cols.nx
    for i, c in enumerate(cols.classes):
        rows.add([(nx + i, 1.0)] + [(cols.nidx[n], -1.0) for n in gr.nodes_of[int(c)] if n in cols.nidx], 0.0, 0.0)
    for n, j in cols.nidx.items():
        for k in set(int(x) for x in gr.kids[n]):
            rows.add([(j, 1.0), (nx + cols.cidx[k], -1.0)], -np.inf, 0.0)


def _production_rows(rows: _Rows, gr: _Graph, cols: _Columns) -> dict[int, list[int]]:
    """At most one production (placement or local op) per value group: the plans the runtime
    executes. Returns the production columns by group."""
    prods: dict[int, list[int]] = {}
    for n, j in cols.nidx.items():
        if not gr.is_reshard(n):
            prods.setdefault(gr.group(n), []).append(j)
    for js in prods.values():
        if len(js) > 1:
            rows.add([(j, 1.0) for j in js], 0.0, 1.0)
    return prods


def _output_rows(rows: _Rows, gr: _Graph, cols: _Columns, roots: Roots, ties: Ties,
                 partial_layouts: set[int]) -> None:
    """Each output has a class in an allowed layout; a tied output is in the layout its argument
    is placed in, one selector per tie choosing that layout."""
    g, nx, cidx = gr.g, cols.nx, cols.cidx
    tied_roots = {r_: t for t, (_, r_) in enumerate(ties)}
    for ri, (grp, allowed) in enumerate(roots):
        ok = [cidx[c] for c in gr.group_classes.get(grp, []) if c in cidx
              and int(g.class_layout[c]) not in partial_layouts
              and (allowed is None or int(g.class_layout[c]) in allowed)]
        if ri in tied_roots:
            continue
        rows.add([(nx + i, 1.0) for i in ok], 1.0, np.inf)
    tie_cols = cols.tie_cols()
    for t, (h, ri) in enumerate(ties):
        mine = tie_cols.get(t, [])
        rows.add([(c_, 1.0) for _, c_ in mine], 1.0, 1.0)
        o = roots[ri][0]
        for lay, c_ in mine:
            oc = [cidx[c] for c in gr.group_classes.get(o, []) if c in cidx and int(g.class_layout[c]) == lay]
            if oc:
                rows.add([(nx + oc[0], 1.0), (c_, -1.0)], 0.0, np.inf)
            else:
                rows.add([(c_, 1.0)], 0.0, 0.0)
            for j in cols.places.get(h, {}).get(lay, []):
                rows.add([(j, 1.0), (c_, -1.0)], -np.inf, 0.0)


def _used_rows(rows: _Rows, gr: _Graph, cols: _Columns, prods: dict[int, list[int]]) -> None:
    """A used value has a production."""
    for grp, js in prods.items():
        for c in gr.group_classes.get(grp, []):
            if c in cols.cidx:
                rows.add([(cols.nx + cols.cidx[c], 1.0)] + [(j, -1.0) for j in js], -np.inf, 0.0)


def _acyclic_rows(rows: _Rows, gr: _Graph, cols: _Columns) -> None:
    """Acyclicity inside each value group (operands of local ops come earlier in the program):
    t[class] >= t[child] + 1 when the resharding node is chosen, big-M = the group's size."""
    g, t_off = gr.g, cols.t_off
    for n, j in cols.nidx.items():
        c = cols.cidx[int(g.node_class[n])]
        if not gr.is_reshard(n):
            continue
        m = float(len(gr.group_classes[gr.group(n)]))
        for k in set(int(x) for x in gr.kids[n]):
            kk = cols.cidx[k]
            rows.add([(t_off + c, 1.0), (t_off + kk, -1.0), (j, -m)], 1.0 - m, np.inf)


def _milp(rows: _Rows, cols: _Columns, cost: np.ndarray, big: float, time_limit: float,
          incumbent: float | None) -> OptimizeResult:
    """HiGHS on the model: binaries but for the order potentials, in [0, big]."""
    nvar, t_off = cols.nvar, cols.t_off
    integrality = np.ones(nvar)
    integrality[t_off:] = 0
    lb = np.zeros(nvar)
    ub = np.ones(nvar)
    ub[t_off:] = big
    # normalised objective: the solver's absolute tolerances must not swamp picosecond costs
    scale = 1.0 / max(float(np.max(np.abs(cost))), 1e-300)
    constraints = [rows.constraint(nvar)]
    if incumbent is not None and incumbent > 0:
        constraints.append(LinearConstraint(cost * scale, -np.inf, incumbent * scale * (1 - CUTOFF)))
    with _quiet_stdout():
        return milp(cost * scale, integrality=integrality, bounds=Bounds(lb, ub), constraints=constraints,
                    options={"time_limit": max(0.1, time_limit), "disp": False})


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """File descriptor 1 sent to the null device: HiGHS prints some lines with printf whatever
    its log options (`HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();`
    when it finds a solution), onto the user's console. Python's own sys.stdout is flushed
    first, so nothing printed before is lost."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no file descriptor 1 to redirect
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


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
    rank = np.empty(G, dtype=np.int64)
    rank[operands_first(deps)] = np.arange(G)
    return rank


def _to_extraction(g: ExportedGraph, chosen: set[int], node_cost: np.ndarray, group_space: list[int],
                   model: CostModel, combinable: frozenset[int], roots: Roots, ties: Ties,
                   tie_vars: list[tuple[int, int, int]], x: np.ndarray, partial_layouts: set[int],
                   weight: np.ndarray) -> Extraction:
    """The solution as the extraction the runtime reads: each output's layout, and per value
    group what the roots reach of its production and resharding steps, steps in order."""
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
        order = _outwards(lay, steps.get(grp, []))
        demanded = tuple(sorted(materialized.get(grp, {lay})))
        choices[grp] = GroupChoice(grp, n, lay, demanded, order, float(node_cost[n]), weight=float(weight[grp]))
        total += float(node_cost[n]) + float(weight[grp]) * sum(s.seconds for s in order)
    return Extraction(choices=choices, root_layouts=root_layouts, total_s=total, method="exact-ilp", seconds=0.0)


def _outwards(produced: int, steps: list[ReshardStep]) -> list[ReshardStep]:
    """The steps ordered from the produced layout outwards: each after the one making its source."""
    order: list[ReshardStep] = []
    frontier, rest = {produced}, list(steps)
    while rest:
        nxt = [s for s in rest if s.src in frontier]
        if not nxt:
            break
        for s in nxt:
            order.append(s)
            frontier.add(s.dst)
            rest.remove(s)
    return order
