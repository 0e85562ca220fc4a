"""The search's read-only view of one e-graph: built once, shared by every search on it.

`SearchGraph` holds the value groups' productions in an acyclic order, the all-pairs cheapest
resharding per tensor space, and the node costs and value weights the moves price with.
`with_costs` gives the same structure under other costs (the search's pressure restarts and
shallow loop copies) without rebuilding it. What depends on the structure alone and is filled
in lazily (operand demands, resharding trees) lives in one `SearchCache` that every costing of
the graph shares on purpose: a cached tree's float sum is the one later searches read.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..egraph.collectives import reshard_mask
from ..egraph.export import ExportedGraph
from ..egraph.layout import SpaceTable
from ..rules.reshard import ReshardEdge
from .cost import CostModel
from .spacepaths import SpacePaths, space_paths

# A move must save more than this many seconds (plus a relative 1e-9) to be taken: float noise
# must never make two plans look better than each other in turn.
EPS = 1e-12


def improvement_bar(before: float) -> float:
    """What a move's new cost must be below to count as an improvement on `before`: by more than
    EPS and a relative 1e-9, so that sums taken in another order never look like a saving."""
    return before - EPS - 1e-9 * before


Tree = tuple[float, tuple[tuple[int, int], ...]]  # a resharding tree: seconds, edges (row pairs)

# From this many layouts on, a chain's dynamic program prices every row of a space at once
# (steiner_costs) rather than walking one resharding tree per row (steiner_cost).
ROW_WALK_MIN = 512


@dataclass
class SearchCache:
    """Lazily filled tables that depend on the graph's structure only, never on its costs: shared
    by every `with_costs` copy (and so by every search over the graph)."""

    demands: dict[int, dict[int, tuple[int, ...]]] = field(default_factory=dict)  # node -> group -> layouts
    steiner: dict[tuple[int, int, frozenset[int]], Tree] = field(default_factory=dict)
    # the trees' seconds alone, the first sum taken of each key (a tree's or a cost-only one): equal
    # frozensets may iterate in other orders, and the first order's float sum is the one kept
    cost: dict[tuple[int, int, frozenset[int]], float] = field(default_factory=dict)
    rows: dict[tuple[int, frozenset[int]], list[float | None]] = field(default_factory=dict)
    row_costs: dict[tuple[int, frozenset[int]], np.ndarray] = field(default_factory=dict)  # steiner_costs
    # per group: a production list (a plan state's, never mutated once built) and the groups its
    # productions read, kept while the list is the one a state holds (the space moves' snapshots)
    operands: dict[int, tuple[list[int], frozenset[int]]] = field(default_factory=dict)
    # ... and the same list's productions by the layout they make (by_layout: the space moves)
    by_layout: dict[int, tuple[list[int], dict[int, list[int]]]] = field(default_factory=dict)
    whole: dict[int, list[int]] | None = None  # whole_productions


def operands_first(operands: list[set[int]], readers: list[set[int]] | None = None) -> list[int]:
    """Value groups in topological order, operands before their readers, ties by group number;
    groups on a cycle (only through user rewrites) last, by group number. `operands[g]`: the
    groups g's productions read; `readers`: the inverse, where the caller has it."""
    G = len(operands)
    if readers is None:
        readers = [set() for _ in range(G)]
        for grp, ops in enumerate(operands):
            for h in ops:
                readers[h].add(grp)
    indeg = [len(ops) for ops in operands]
    ready = [x for x in range(G) if indeg[x] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        x = heapq.heappop(ready)
        order.append(x)
        for p in readers[x]:
            indeg[p] -= 1
            if indeg[p] == 0:
                heapq.heappush(ready, p)
    if len(order) < G:
        seen = set(order)
        order += [x for x in range(G) if x not in seen]
    return order


def _order(g: ExportedGraph, prod: list[list[int]], kids: dict[int, tuple[int, ...]]
           ) -> tuple[list[int], np.ndarray, list[set[int]], list[list[int]]]:
    """Value groups operands first (ties by group number), their rank, their consumers, and the
    productions whose operands all come strictly earlier (acyclic plans)."""
    G = g.num_groups
    parents: list[set[int]] = [set() for _ in range(G)]
    child_groups: list[set[int]] = [set() for _ in range(G)]
    cg = g.class_group.tolist()
    for grp in range(G):
        for n in prod[grp]:
            for c in kids[n]:
                h = cg[c]
                if h != grp:
                    child_groups[grp].add(h)
    for grp in range(G):
        for h in child_groups[grp]:
            parents[h].add(grp)
    order = operands_first(child_groups, parents)
    rank = np.empty(G, dtype=np.int64)
    rank[order] = np.arange(G)
    # a production is usable only if its operands come strictly earlier (acyclic plans)
    rank_l = rank.tolist()
    acyclic = [[n for n in prod[grp] if all(rank_l[cg[c]] < rank_l[grp] for c in kids[n])] for grp in range(G)]
    return order, rank, parents, acyclic


@dataclass(frozen=True, eq=False)
class SearchGraph:
    """Everything the moves read and never change. Hot loops index the `_l` Python lists:
    numpy scalar indexing costs ~10x a list lookup."""

    g: ExportedGraph
    spaces: SpaceTable
    model: CostModel
    describe: Callable[[int], str]
    combinable: frozenset[int]
    group_space: list[int]  # group -> tensor space (-1: none)
    # resharding prices depend on the space and on whether XLA can combine the collectives
    group_key: list[tuple[int, bool]]
    group_pk: list[int]  # group -> a small int per distinct group_key (memo keys)
    paths: dict[tuple[int, bool], SpacePaths]
    kids: dict[int, tuple[int, ...]]  # production node -> its child classes
    prod_any: list[list[int]]  # productions per group before acyclicity narrows them: for bounds
    prod: list[list[int]]  # usable productions per group (operands strictly earlier)
    order: list[int]  # groups, operands first
    rank: np.ndarray  # group -> position in `order`
    parents: list[set[int]]  # group -> groups with a production reading it
    node_layout: list[int]
    kid_gl: dict[int, tuple[tuple[int, int], ...]]  # node -> (operand group, layout) per child
    class_at: set[tuple[int, int]]  # (group, layout) pairs that exist as classes
    class_group_l: list[int]
    class_layout_l: list[int]
    group_classes: list[list[int]]
    cost: np.ndarray  # seconds per e-node, already weighted
    weight: np.ndarray  # per group: executions per step
    cost_l: list[float]
    weight_l: list[float]
    cache: SearchCache

    @classmethod
    def build(cls, g: ExportedGraph, node_cost: np.ndarray, value_space: list[int], spaces: SpaceTable,
              edges: dict[int, list[ReshardEdge]], model: CostModel, describe: Callable[[int], str] | None,
              combinable: frozenset[int], weight: np.ndarray | None) -> SearchGraph:
        G = g.num_groups
        weight = weight if weight is not None else np.ones(G)
        group_space = g.group_spaces(value_space)
        group_key = [(sp, grp in combinable) for grp, sp in enumerate(group_space)]
        paths: dict[tuple[int, bool], SpacePaths] = {}
        for key in sorted(set(group_key)):
            if key[0] >= 0:
                paths[key] = space_paths(key[0], spaces, edges.get(key[0], []), model, key[1])
        # production nodes per group, with their child classes
        prod: list[list[int]] = [[] for _ in range(G)]
        kids: dict[int, tuple[int, ...]] = {}
        kind = np.asarray(g.node_kind)
        usable = ~reshard_mask(kind) & np.isfinite(node_cost)
        ptr = g.child_ptr.tolist()
        child = g.child_idx.tolist()
        node_group = g.class_group[g.node_class].tolist()
        for n in np.flatnonzero(usable).tolist():
            prod[node_group[n]].append(n)
            kids[n] = tuple(child[ptr[n]:ptr[n + 1]])
        order, rank, parents, acyclic = _order(g, prod, kids)
        cg, cl = g.class_group.tolist(), g.class_layout.tolist()
        pk_index: dict[tuple[int, bool], int] = {}
        group_classes: list[list[int]] = [[] for _ in range(G)]
        for c, grp in enumerate(cg):
            group_classes[grp].append(c)
        return cls(
            g=g, spaces=spaces, model=model, describe=describe or (lambda grp: f"value group {grp}"),
            combinable=combinable, group_space=group_space, group_key=group_key,
            group_pk=[pk_index.setdefault(key, len(pk_index)) for key in group_key], paths=paths, kids=kids,
            prod_any=prod, prod=acyclic, order=order, rank=rank, parents=parents,
            node_layout=g.class_layout[g.node_class].tolist(),
            kid_gl={n: tuple((cg[c], cl[c]) for c in ks) for n, ks in kids.items()},
            class_at={(int(grp), int(lay)) for grp, lay in zip(g.class_group, g.class_layout, strict=True)},
            class_group_l=cg, class_layout_l=cl, group_classes=group_classes,
            cost=node_cost, weight=weight, cost_l=np.asarray(node_cost, dtype=float).tolist(),
            weight_l=np.asarray(weight, dtype=float).tolist(), cache=SearchCache())

    def whole_productions(self) -> dict[int, list[int]]:
        """Per group, its productions that make the value whole from whole operands (groups with
        none are left out): the all-replicated starting plan. Cached: structure only."""
        hit = self.cache.whole
        if hit is None:
            layouts = self.spaces.layouts.layouts
            whole = [not lay.used_axes() for lay in layouts]  # no split, no pending sum
            hit = {}
            for grp, nodes in enumerate(self.prod):
                ok = [n for n in nodes if whole[self.node_layout[n]] and all(whole[lay] for _, lay in self.kid_gl[n])]
                if ok:
                    hit[grp] = ok
            self.cache.whole = hit
        return hit

    def with_costs(self, node_cost: np.ndarray, weight: np.ndarray) -> SearchGraph:
        """The same structure, paths and cache under other node costs and value weights."""
        return dataclasses.replace(self, cost=node_cost, weight=weight,
                                   cost_l=np.asarray(node_cost, dtype=float).tolist(),
                                   weight_l=np.asarray(weight, dtype=float).tolist())

    def steiner(self, grp: int, src_layout: int, targets: frozenset[int]) -> Tree:
        """Cost and edges (row pairs) of the union of cheapest paths src -> each target."""
        key = (self.group_pk[grp], src_layout, targets)
        hit = self.cache.steiner.get(key)
        if hit is not None:
            return hit
        sp = self.paths[self.group_key[grp]]
        s = sp.index[src_layout]
        used: set[tuple[int, int]] = set()
        total = 0.0
        for t_lid in targets:
            t = sp.index[t_lid]
            if not math.isfinite(sp.dist[s, t]):
                total = math.inf
                break
            while t != s:
                u = int(sp.pred[s, t])
                if (u, t) not in used:
                    used.add((u, t))
                    total += sp.edge[(u, t)][1]
                t = u
        total = self.cache.cost.setdefault(key, total)
        out = (total, tuple(sorted(used)))
        self.cache.steiner[key] = out
        return out

    def steiner_cost(self, grp: int, src_layout: int, targets: frozenset[int]) -> float:
        """steiner()'s seconds alone: the moves price trees and never read their edges."""
        key = (self.group_pk[grp], src_layout, targets)
        hit = self.cache.cost.get(key)
        if hit is None:
            hit = self._steiner_sum(key, self.paths[self.group_key[grp]], src_layout, targets)
        return hit

    def _steiner_sum(self, key: tuple[int, int, frozenset[int]], sp: SpacePaths, src_layout: int,
                     targets: frozenset[int]) -> float:
        """steiner()'s walk and float sum in its order (so bit-identical), without the edge tuple; cached."""
        index, edge_s = sp.index, sp.edge_s
        s = index[src_layout]
        pred, finite = sp.lists(s)
        used: set[tuple[int, int]] = set()
        total = 0.0
        for t_lid in targets:
            t = index[t_lid]
            if not finite[t]:
                total = math.inf
                break
            while t != s:
                u = pred[t]
                if (u, t) not in used:
                    used.add((u, t))
                    total += edge_s[(u, t)]
                t = u
        self.cache.cost[key] = total
        return total

    def steiner_row(self, grp: int, targets: frozenset[int]) -> list[float | None]:
        """steiner()'s costs to these targets by source row (None until the caller fills it in):
        a chain's dynamic program prices every predecessor layout against the same target set,
        and a list lookup costs a fraction of steiner()'s keyed one."""
        key = (self.group_pk[grp], targets)
        row = self.cache.rows.get(key)
        if row is None:
            row = self.cache.rows[key] = [None] * len(self.paths[self.group_key[grp]].layouts)
        return row

    def prices_rows(self, grp: int) -> bool:
        """Whether a chain's dynamic program prices this group's trees a whole row at a time
        (steiner_costs) rather than one walk per row (steiner_cost)."""
        return len(self.paths[self.group_key[grp]].layouts) >= ROW_WALK_MIN

    def steiner_costs(self, grp: int, targets: frozenset[int]) -> np.ndarray:
        """steiner_cost() to these targets from every source row, walked in numpy: for the
        spaces with so many layouts (prices_rows) that one walk per row is the search's cost.
        Each entry is the sum steiner_cost() takes in this frozenset's order; where an equal set
        was summed in another order first, the two may differ in the last bit (the chain search
        only proposes with these; its moves are accepted on the plan's exact cost)."""
        key = (self.group_pk[grp], targets)
        hit = self.cache.row_costs.get(key)
        if hit is None:
            hit = self.cache.row_costs[key] = self.paths[self.group_key[grp]].tree_sums(targets)
        return hit

    def demands(self, n: int) -> dict[int, tuple[int, ...]]:
        """Layouts node n needs of each operand group."""
        hit = self.cache.demands.get(n)
        if hit is None:
            out: dict[int, list[int]] = {}
            for c in self.kids[n]:
                out.setdefault(int(self.g.class_group[c]), []).append(int(self.g.class_layout[c]))
            hit = self.cache.demands[n] = {h: tuple(sorted(v)) for h, v in out.items()}
        return hit

    def operands_of(self, grp: int, nodes: list[int]) -> frozenset[int]:
        """The groups these productions of grp read: a state's production lists are rebound, never
        mutated, so the union is kept for as long as the same list object is asked about."""
        hit = self.cache.operands.get(grp)
        if hit is not None and hit[0] is nodes:
            return hit[1]
        out: set[int] = set()
        for n in nodes:
            out.update(self.demands(n))
        ops = frozenset(out)
        self.cache.operands[grp] = (nodes, ops)
        return ops

    def by_layout(self, grp: int, nodes: list[int]) -> dict[int, list[int]]:
        """These productions of grp by the layout they make, in their order (read only): kept
        while the list is the one a state holds, as operands_of."""
        hit = self.cache.by_layout.get(grp)
        if hit is not None and hit[0] is nodes:
            return hit[1]
        out: dict[int, list[int]] = {}
        for n in nodes:
            out.setdefault(self.node_layout[n], []).append(n)
        self.cache.by_layout[grp] = (nodes, out)
        return out

    def own(self, grp: int, n: int, targets: frozenset[int]) -> float:
        """A value's seconds produced by n and resharded to `targets` (steiner_cost inlined: the
        moves' hottest call)."""
        lay = self.node_layout[n]
        c = self.cache.cost.get((self.group_pk[grp], lay, targets))
        if c is None:
            c = self.steiner_cost(grp, lay, targets)
        return self.cost_l[n] + self.weight_l[grp] * c
