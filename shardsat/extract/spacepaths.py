"""All-pairs cheapest resharding between the layouts of one tensor space.

Each space's resharding edges (rules/reshard.py), priced by the cost model, become a distance
matrix and a predecessor matrix: Floyd-Warshall for the spaces of up to FLOYD_MAX_LAYOUTS
layouts, Dijkstra from every source beyond (a rank-4 value on a 4-axis mesh has over a thousand).
`SpacePaths` walks them into resharding trees, one source at a time or a whole row at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..egraph.layout import SpaceTable
from ..rules.reshard import ReshardEdge
from .cost import CostModel


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
    # per source row, dist's row as a Python list (None where it holds a NaN), made on first use
    dist_rows: dict[int, list[float] | None] = field(default_factory=dict)

    def lists(self, s: int) -> tuple[list[int], list[bool]]:
        hit = self.row_lists.get(s)
        if hit is None:
            hit = self.row_lists[s] = (self.pred[s].tolist(), np.isfinite(self.dist[s]).tolist())
        return hit

    def dist_list(self, r: int) -> list[float] | None:
        """dist's row r as a Python list, for the values a start's estimate reaches one class at
        a time (extract/start.py); None where it holds a NaN (numpy's min propagates one, a
        Python comparison would not)."""
        hit = self.dist_rows.get(r, False)
        if hit is False:
            row = self.dist[r]
            hit = self.dist_rows[r] = None if np.isnan(row).any() else row.tolist()
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
