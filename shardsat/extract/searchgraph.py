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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..egraph.collectives import reshard_mask
from ..egraph.export import ExportedGraph
from ..egraph.layout import SpaceTable
from ..rules.reshard import ReshardEdge
from .cost import CostModel

# A move must save more than this many seconds (plus a relative 1e-9) to be taken: float noise
# must never make two plans look better than each other in turn.
EPS = 1e-12


def improvement_bar(before: float) -> float:
    """What a move's new cost must be below to count as an improvement on `before`: by more than
    EPS and a relative 1e-9, so that sums taken in another order never look like a saving."""
    return before - EPS - 1e-9 * before


Tree = tuple[float, tuple[tuple[int, int], ...]]  # a resharding tree: seconds, edges (row pairs)


@dataclass
class SpacePaths:
    """All-pairs cheapest resharding between the layouts of one space."""

    index: dict[int, int]  # layout id -> row
    layouts: tuple[int, ...]
    dist: np.ndarray  # [n, n]
    pred: np.ndarray  # [n, n] row of the node before t on the path s -> t (-1: none)
    edge: dict[tuple[int, int], tuple[ReshardEdge, float]]  # cheapest direct edge (u, v) rows
    edge_s: dict[tuple[int, int], float] = field(default_factory=dict)  # edge's seconds alone
    # per source row, pred's row and dist < inf as Python lists (numpy scalar indexing costs ~10x
    # a list lookup in steiner's walk), made on first use: a 3,456-layout space as lists whole
    # would take ~0.5 GB
    row_lists: dict[int, tuple[list[int], list[bool]]] = field(default_factory=dict)
    # edge_s as sorted keys u * n + v and their seconds, for whole-row tree walks (tree_sums)
    edge_keys: np.ndarray | None = None
    edge_vals: np.ndarray | None = None
    last_s: np.ndarray | None = None  # last_edge()

    def lists(self, s: int) -> tuple[list[int], list[bool]]:
        hit = self.row_lists.get(s)
        if hit is None:
            hit = self.row_lists[s] = (self.pred[s].tolist(), np.isfinite(self.dist[s]).tolist())
        return hit

    def edge_seconds(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """edge_s[(u, v)] for arrays of direct edges."""
        n = len(self.layouts)
        if self.edge_keys is None:
            keys = sorted((a * n + b, c) for (a, b), c in self.edge_s.items())
            self.edge_keys = np.array([k for k, _ in keys], dtype=np.int64)
            self.edge_vals = np.array([c for _, c in keys], dtype=float)
        assert self.edge_vals is not None
        return self.edge_vals[np.searchsorted(self.edge_keys, u * n + v)]

    def last_edge(self) -> np.ndarray:
        """[s, t]: the seconds of the last edge on the path s -> t (0 where there is none), made
        on first use: a whole-row walk then reads one entry per step instead of searching the
        edge table."""
        if self.last_s is None:
            n = len(self.layouts)
            self.last_s = np.zeros((n, n))
            s, t = np.nonzero(self.pred >= 0)
            self.last_s[s, t] = self.edge_seconds(self.pred[s, t], t)
        return self.last_s

    def tree_sums(self, targets: frozenset[int]) -> np.ndarray:
        """_steiner_sum from every source row at once: per row the same additions in the same
        order (targets in this frozenset's order, each walked back until the source), so each
        entry is bit-identical to the walk one source at a time. A row's paths form its pred
        tree, so a later target's walk that meets an edge already added has met every edge
        above it too and stops there."""
        n = len(self.layouts)
        last = self.last_edge()
        total = np.zeros(n)
        dead = np.zeros(n, dtype=bool)
        # row * n + node: node's tree edge already added (only a later target can meet one)
        counted = np.zeros(n * n, dtype=bool) if len(targets) > 1 else None
        for lid in targets:
            x = self.index[lid]
            dead |= ~np.isfinite(self.dist[:, x])
            rows = np.flatnonzero(~dead)
            cur = np.full(len(rows), x, dtype=np.int64)
            while True:
                moving = cur != rows
                if counted is not None:
                    code = rows * n + cur
                    moving &= ~counted[code]
                    counted[code[moving]] = True
                if not moving.any():
                    break
                rows, cur = rows[moving], cur[moving]
                total[rows] += last[rows, cur]
                cur = self.pred[rows, cur]
        total[dead] = math.inf
        return total


# Spaces up to this many layouts take Floyd-Warshall (numpy, n^3: 0.3 s at 468 layouts); larger
# ones, a rank-4 value on a 4-axis mesh has 1,296, take scipy's Dijkstra from every source (n^3
# there is 10 s per space, and the conv net on 2x2x2x2 has dozens). Both give the exact distances;
# they break ties between equally cheap paths differently, so the smaller spaces keep the order
# every plan so far was made with.
FLOYD_MAX_LAYOUTS = 512
# From this many layouts on, a chain's dynamic program prices every row of a space at once
# (steiner_costs) rather than walking one resharding tree per row (steiner_cost).
ROW_WALK_MIN = 512


def space_paths(space_id: int, spaces: SpaceTable, edges: Sequence[ReshardEdge], model: CostModel,
                combinable: bool = False) -> SpacePaths:
    sp = spaces.spaces[space_id]
    index = {lid: i for i, lid in enumerate(sp.layouts)}
    n = len(sp.layouts)
    best: dict[tuple[int, int], tuple[ReshardEdge, float]] = {}
    for e in edges:
        u, v = index[e.src], index[e.dst]
        c = model.collective(e.kind, e.axes, space_id, e.src, e.dst, combinable).seconds
        if (u, v) not in best or c < best[(u, v)][1]:
            best[(u, v)] = (e, c)
    direct = {uv: c for uv, (_, c) in best.items() if c < math.inf and uv[0] != uv[1]}
    dist, pred = (_floyd if n <= FLOYD_MAX_LAYOUTS else _dijkstra)(n, direct)
    return SpacePaths(index, sp.layouts, dist, pred, best, {uv: c for uv, (_, c) in best.items()})


def _floyd(n: int, direct: dict[tuple[int, int], float]) -> tuple[np.ndarray, np.ndarray]:
    dist = np.full((n, n), math.inf)
    np.fill_diagonal(dist, 0.0)
    pred = np.full((n, n), -1, dtype=np.int64)
    for (u, v), c in direct.items():
        dist[u, v] = c
        pred[u, v] = u
    for k in range(n):
        via = dist[:, k : k + 1] + dist[k : k + 1, :]
        better = via < dist - 1e-18
        if better.any():
            dist = np.where(better, via, dist)
            pred = np.where(better, pred[k : k + 1, :], pred)
    return dist, pred


def _dijkstra(n: int, direct: dict[tuple[int, int], float]) -> tuple[np.ndarray, np.ndarray]:
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import dijkstra

    uv = np.array(list(direct), dtype=np.int64).reshape(-1, 2)
    w = np.array(list(direct.values()), dtype=float)
    # explicit zeros stay edges in a sparse csgraph input (a free resharding is still a path)
    dist, pred = dijkstra(csr_matrix((w, (uv[:, 0], uv[:, 1])), shape=(n, n)), directed=True,
                          return_predecessors=True)
    pred = np.where(pred < 0, -1, pred).astype(np.int64)
    _lowest_tight_pred(dist, pred, uv, w)
    return dist, pred


def _lowest_tight_pred(dist: np.ndarray, pred: np.ndarray, uv: np.ndarray, w: np.ndarray,
                       cells: int = 1 << 18) -> None:
    """Re-pick, in place, each pred[s, v] as the lowest-numbered u on a tight edge u -> v (one a
    cheapest path to v ends with). Equally cheap reshardings are the rule, and which one scipy's
    heap order leaves is an implementation detail the path-dependent search would inherit (a
    tied-embedding step on 2x2x2x2 cost 1.2% more with it). Only edges of positive price into a
    strictly farther v count, so every chain of picks descends and none can cycle; targets
    reached only through free edges keep Dijkstra's choice."""
    keep = w > 0
    if not keep.any():
        return
    uv, w = uv[keep], w[keep]
    order = np.lexsort((uv[:, 0], uv[:, 1]))  # by target, then source
    u, v, w = uv[order, 0], uv[order, 1], w[order]
    starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    heads = v[starts]
    none = pred.shape[0]
    block = max(1, cells // len(w))  # rows at a time: [rows, edges] temporaries of about `cells`
    for a in range(0, pred.shape[0], block):  # (2 MiB), which stay in cache
        d = dist[a : a + block]
        d = np.where(np.isinf(d), np.nan, d)  # unreached: every comparison below is false
        to_v, to_u = d[:, v], d[:, u]
        tight = (to_u < to_v) & (np.abs(to_u + w - to_v) <= 1e-12 * to_v)
        best = np.minimum.reduceat(np.where(tight, u, none), starts, axis=1)
        rows = pred[a : a + block]
        sub = rows[:, heads]
        found = best < none
        sub[found] = best[found]
        rows[:, heads] = sub


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

    def own(self, grp: int, n: int, targets: frozenset[int]) -> float:
        """A value's seconds produced by n and resharded to `targets` (steiner_cost inlined: the
        moves' hottest call)."""
        lay = self.node_layout[n]
        c = self.cache.cost.get((self.group_pk[grp], lay, targets))
        if c is None:
            c = self.steiner_cost(grp, lay, targets)
        return self.cost_l[n] + self.weight_l[grp] * c
