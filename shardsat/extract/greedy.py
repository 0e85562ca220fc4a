"""DAG-aware greedy extraction with exact local improvement.

The e-graph groups classes by value: `At(v, l)` for the layouts l of v. A plan produces each used
value once (a placed input, or one local strategy of its equation) and reaches every layout its
consumers need through the cheapest resharding tree from the produced layout.

1. Bottom-up estimate: est(class) = cheapest way to obtain it, where an operand's estimate is
   shared among the value's consumers (divided by their count) so that values used many times
   (residual streams, weights read forward and backward) are not paid once per use as tree-cost
   extraction would (egglog-notes.md).
2. Top-down choice, consumers before producers: each value picks the production that minimises
   its own cost plus the resharding tree to its *actual* demanded layouts plus its operands'
   estimates.
3. Improvement: sweeps of exact single-value moves on the true DAG cost (its own node, its
   resharding tree, and the change in its operands' resharding trees) until none improves.

Resharding trees are unions of shortest paths in the per-space layout graph (all-pairs shortest
paths computed once per (shape, dtype)), a close upper bound of the Steiner tree.
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..egraph.collectives import reshard_mask
from ..egraph.export import ExportedGraph, NodeKind
from ..egraph.layout import SpaceTable
from ..errors import NoPlanError
from ..rules.reshard import ReshardEdge
from .cost import CostModel
from .result import Extraction, GroupChoice, ReshardStep

# A move must save more than this many seconds (plus a relative 1e-9) to be taken: float noise
# must never make two plans look better than each other in turn.
EPS = 1e-12
# space moves: rounds per run, and the heaviest tensor spaces tried in each
MAX_SPACE_ROUNDS = 4
MAX_SPACES = 16


@dataclass
class SpacePaths:
    """All-pairs cheapest resharding between the layouts of one space."""

    index: dict[int, int]  # layout id -> row
    layouts: tuple[int, ...]
    dist: np.ndarray  # [n, n]
    pred: np.ndarray  # [n, n] row of the node before t on the path s -> t (-1: none)
    edge: dict[tuple[int, int], tuple[ReshardEdge, float]]  # cheapest direct edge (u, v) rows


def space_paths(space_id: int, spaces: SpaceTable, edges: Sequence[ReshardEdge], model: CostModel,
                combinable: bool = False) -> SpacePaths:
    sp = spaces.spaces[space_id]
    index = {lid: i for i, lid in enumerate(sp.layouts)}
    n = len(sp.layouts)
    dist = np.full((n, n), math.inf)
    np.fill_diagonal(dist, 0.0)
    pred = np.full((n, n), -1, dtype=np.int64)
    best: dict[tuple[int, int], tuple[ReshardEdge, float]] = {}
    for e in edges:
        u, v = index[e.src], index[e.dst]
        c = model.collective(e.kind, e.axes, space_id, e.src, e.dst, combinable).seconds
        if (u, v) not in best or c < best[(u, v)][1]:
            best[(u, v)] = (e, c)
            if c < dist[u, v]:
                dist[u, v] = c
                pred[u, v] = u
    for k in range(n):
        via = dist[:, k : k + 1] + dist[k : k + 1, :]
        better = via < dist - 1e-18
        if better.any():
            dist = np.where(better, via, dist)
            pred = np.where(better, pred[k : k + 1, :], pred)
    return SpacePaths(index, sp.layouts, dist, pred, best)


class Extractor:
    def __init__(
        self,
        g: ExportedGraph,
        node_cost: np.ndarray,
        value_space: list[int],
        spaces: SpaceTable,
        edges: dict[int, list[ReshardEdge]],
        model: CostModel,
        describe: Callable[[int], str] | None = None,
        combinable: frozenset[int] = frozenset(),
        weight: np.ndarray | None = None,
    ) -> None:
        """node_cost: seconds per e-node, already multiplied by its value's `weight` (how often it
        runs per step: a scan body's values run once per iteration); resharding trees are
        weighted here."""
        # moves tried by every search on this graph (copies share it): a budget measured in
        # work, not seconds, keeps plans the same on a loaded machine
        self.work: list[int] = [0]
        self.g = g
        self.weight = weight if weight is not None else np.ones(g.num_groups)
        self.describe = describe or (lambda grp: f"value group {grp}")
        self.cost = node_cost
        self.spaces = spaces
        self.model = model
        G = g.num_groups
        self.group_space = [value_space[vs[0]] if vs else -1 for vs in g.group_values]
        self.combinable = combinable
        # resharding prices depend on the space and on whether XLA can combine the collectives
        self.group_key = [(sp, grp in combinable) for grp, sp in enumerate(self.group_space)]
        self.paths: dict[tuple[int, bool], SpacePaths] = {}
        for key in sorted(set(self.group_key)):
            if key[0] >= 0:
                self.paths[key] = space_paths(key[0], spaces, edges.get(key[0], []), model, key[1])
        # production nodes per group, with their child classes
        self.prod: list[list[int]] = [[] for _ in range(G)]
        self.kids: dict[int, tuple[int, ...]] = {}
        kind = np.asarray(g.node_kind)
        usable = ~reshard_mask(kind) & np.isfinite(self.cost)
        ptr = g.child_ptr.tolist()
        child = g.child_idx.tolist()
        node_group = g.class_group[g.node_class].tolist()
        for n in np.flatnonzero(usable).tolist():
            self.prod[node_group[n]].append(n)
            self.kids[n] = tuple(child[ptr[n]:ptr[n + 1]])
        self._prod_any = list(self.prod)  # before acyclicity narrows them: for lower_bound
        self._order()
        # hot loops index Python lists: numpy scalar indexing costs ~10x a list lookup
        self.node_layout: list[int] = g.class_layout[g.node_class].tolist()
        self.cost_l: list[float] = np.asarray(self.cost, dtype=float).tolist()
        self.weight_l: list[float] = np.asarray(self.weight, dtype=float).tolist()
        cg, cl = g.class_group.tolist(), g.class_layout.tolist()
        self.kid_gl: dict[int, tuple[tuple[int, int], ...]] = {
            n: tuple((cg[c], cl[c]) for c in kids) for n, kids in self.kids.items()}
        self.group_pk: list[int] = [0] * G
        pk_index: dict[tuple[int, bool], int] = {}
        for grp, key in enumerate(self.group_key):
            self.group_pk[grp] = pk_index.setdefault(key, len(pk_index))
        self._demand_memo: dict[int, dict[int, tuple[int, ...]]] = {}
        self._class_at = {(int(grp), int(lay)) for grp, lay in zip(g.class_group, g.class_layout, strict=True)}
        self.class_group_l: list[int] = g.class_group.tolist()
        self.class_layout_l: list[int] = g.class_layout.tolist()
        self.group_classes: list[list[int]] = [[] for _ in range(G)]
        for c, grp in enumerate(g.class_group.tolist()):
            self.group_classes[grp].append(c)
        self.place_of = {}
        self._steiner_memo: dict[tuple[int, int, frozenset[int]], tuple[float, tuple[tuple[int, int], ...]]] = {}
        self._row_memo: dict[tuple[int, frozenset[int]], list[float | None]] = {}
        # per tensor space: neighbourhoods in which a space move was tried and found nothing
        self._space_seen: dict[tuple[int, bool, bool], set[tuple]] = {}

    def with_costs(self, node_cost: np.ndarray, weight: np.ndarray) -> Extractor:
        """This extractor over the same graph with other node costs and value weights (both
        finite where the originals are): the structure and resharding paths are reused."""
        other = copy.copy(self)
        other.cost, other.weight = node_cost, weight
        other._space_seen = {}  # outcomes depend on the costs
        other.cost_l = np.asarray(node_cost, dtype=float).tolist()
        other.weight_l = np.asarray(weight, dtype=float).tolist()
        return other

    # -- structure -------------------------------------------------------------------------------
    def _order(self) -> None:
        g = self.g
        G = g.num_groups
        parents: list[set[int]] = [set() for _ in range(G)]
        indeg = [0] * G
        child_groups: list[set[int]] = [set() for _ in range(G)]
        cg = g.class_group.tolist()
        for grp in range(G):
            for n in self.prod[grp]:
                for c in self.kids[n]:
                    h = cg[c]
                    if h != grp:
                        child_groups[grp].add(h)
        for grp in range(G):
            for h in child_groups[grp]:
                parents[h].add(grp)
            indeg[grp] = len(child_groups[grp])
        ready = sorted(x for x in range(G) if indeg[x] == 0)
        order: list[int] = []
        import heapq

        heapq.heapify(ready)
        while ready:
            x = heapq.heappop(ready)
            order.append(x)
            for p in parents[x]:
                indeg[p] -= 1
                if indeg[p] == 0:
                    heapq.heappush(ready, p)
        if len(order) < G:  # cycles (only through user rewrites): break by group number
            seen = set(order)
            order += [x for x in range(G) if x not in seen]
        self.order = order
        self.rank = np.empty(G, dtype=np.int64)
        self.rank[order] = np.arange(G)
        self.parents = parents
        # a production is usable only if its operands come strictly earlier (acyclic plans)
        rank = self.rank.tolist()
        for grp in range(G):
            r = rank[grp]
            self.prod[grp] = [n for n in self.prod[grp] if all(rank[cg[c]] < r for c in self.kids[n])]

    # -- a bound -------------------------------------------------------------------------------
    def lower_bound(self, roots: Sequence[tuple[int, frozenset[int] | None]]) -> float:
        """Seconds no plan can beat. A value is needed by every plan if it is an output or an
        operand of every production of a needed value. Each needed value costs at least its
        cheapest production plus the cheapest resharding from that production's layout to a
        layout some consumer reads it in (an output: to its allowed layouts), so a gradient
        produced as a pending sum pays at least one reduction. Operand layouts are not linked
        across values, so the bound is loose where communication dominates."""
        layouts = self.spaces.layouts
        read_in: dict[int, set[int]] = {}
        for prods in self._prod_any:
            for n in prods:
                for h, lay in self.kid_gl[n]:
                    read_in.setdefault(h, set()).add(lay)
        needed = {grp for grp, _ in roots}
        stack = list(needed)
        while stack:
            grp = stack.pop()
            common: set[int] | None = None
            for n in self._prod_any[grp]:
                ops = {h for h, _ in self.kid_gl[n]}
                common = ops if common is None else common & ops
            for h in (common or ()):
                if h not in needed:
                    needed.add(h)
                    stack.append(h)
        allowed: dict[int, list[frozenset[int] | None]] = {}
        for grp, lays in roots:
            allowed.setdefault(grp, []).append(lays)
        total = 0.0
        for grp in sorted(needed):
            prods = self._prod_any[grp]
            if not prods:
                return 0.0  # an input with no placement: no bound
            sp = self.paths[self.group_key[grp]]
            w = self.weight_l[grp]
            reads = read_in.get(grp, set())
            # per source layout: the cheapest resharding to a layout it must reach
            need = np.zeros(len(sp.layouts))
            if reads and grp not in allowed:  # an output may be read by no one else
                need = sp.dist[:, [sp.index[lay] for lay in reads]].min(axis=1)
            for lays in allowed.get(grp, ()):
                ok = [sp.index[lay] for lay in (lays if lays is not None else sp.layouts) if not layouts[lay].partial]
                need = np.maximum(need, sp.dist[:, ok].min(axis=1) if ok else math.inf)
            need_l = need.tolist()
            index = sp.index
            total += min(self.cost_l[n] + w * need_l[index[self.node_layout[n]]] for n in prods)
        return float(total) if math.isfinite(total) else 0.0

    # -- resharding trees -----------------------------------------------------------------------
    def steiner(self, grp: int, src_layout: int, targets: frozenset[int]) -> tuple[float, tuple[tuple[int, int], ...]]:
        """Cost and edges (row pairs) of the union of cheapest paths src -> each target."""
        key = (self.group_pk[grp], src_layout, targets)
        hit = self._steiner_memo.get(key)
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
        out = (total, tuple(sorted(used)))
        self._steiner_memo[key] = out
        return out

    def _steiner_row(self, grp: int, targets: frozenset[int]) -> list[float | None]:
        """steiner()'s costs to these targets by source row (None until the caller fills it in):
        a chain's dynamic program prices every predecessor layout against the same target set,
        and a list lookup costs a fraction of steiner()'s keyed one."""
        key = (self.group_pk[grp], targets)
        row = self._row_memo.get(key)
        if row is None:
            row = self._row_memo[key] = [None] * len(self.paths[self.group_key[grp]].layouts)
        return row

    # -- extraction ------------------------------------------------------------------------------
    def run(
        self,
        roots: Sequence[tuple[int, frozenset[int] | None]],
        deadline: float,
        max_sweeps: int = 500,
        place_pins: dict[int, frozenset[int]] | None = None,
        ties: Sequence[tuple[int, int]] = (),
        seed: dict[int, int] | None = None,
        explain: bool = True,
        chains: bool = True,
    ) -> Extraction:
        """roots: (group, allowed layouts or None for any non-partial) per output.
        place_pins: group -> the layouts an input may be placed in.
        ties: (input group, root index): loop-carried state, placed in the layout it is returned in.
        seed: input group -> the layout the first plan places it in (released for the
          improvement phase): the search is local, so callers try a few global starting points
          (data parallel, fully sharded state) besides the estimate."""
        t0 = time.perf_counter()
        g = self.g
        self._pin(place_pins, ties)
        released: dict[int, list[int]] = {}
        for h, lay in (seed or {}).items():
            nodes = [n for n in self.prod[h]
                     if NodeKind(int(g.node_kind[n])) == NodeKind.PLACE and int(g.node_b[n]) == lay]
            if nodes:
                released[h] = self.prod[h]
                self.prod[h] = nodes
        tied_root = {r: h for h, r in ties}
        self.roots_of: dict[int, list[int]] = {}
        for h, r in ties:
            self.roots_of.setdefault(h, []).append(r)
        forced: dict[int, int] = {}  # tied input group -> the layout its first root chose
        G = g.num_groups
        C = g.num_classes
        cls_layout = g.class_layout
        uses = [float(max(1, len(ps))) for ps in self.parents]
        for grp, _ in roots:
            uses[grp] += 1
        # 1. bottom-up estimates (an operand's estimate is shared among its value's consumers)
        self.work[0] += 2 * len(self.order)  # this pass and the top-down one
        est = [math.inf] * C
        cls_group_l, cls_layout_l = self.class_group_l, self.class_layout_l
        cost_l, node_layout, kids = self.cost_l, self.node_layout, self.kids
        group_classes = self.group_classes
        for grp in self.order:
            if not group_classes[grp]:
                continue
            sp = self.paths[self.group_key[grp]]
            prod_est = np.full(len(sp.layouts), math.inf)
            for n in self.prod[grp]:
                v = cost_l[n] + sum(est[c] / uses[cls_group_l[c]] for c in kids[n])
                r = sp.index[node_layout[n]]
                if v < prod_est[r]:
                    prod_est[r] = v
            finite = np.isfinite(prod_est)
            if not finite.any():
                continue
            reach = np.min(prod_est[finite][:, None] + self.weight_l[grp] * sp.dist[finite], axis=0).tolist()
            for c in group_classes[grp]:
                est[c] = reach[sp.index[cls_layout_l[c]]]
        # 2. top-down choice
        demand: list[Counter[int]] = [Counter() for _ in range(G)]
        root_layouts: list[int] = []
        for r, (grp, allowed) in enumerate(roots):
            best_c, best_v = -1, math.inf
            tied = self.place_of.get(tied_root[r]) if r in tied_root else None
            if tied is not None:
                h = tied_root[r]
                lay = forced.get(h, seed.get(h, -1) if seed else -1)
                if lay in tied and (allowed is None or lay in allowed) and (grp, lay) in self._class_at:
                    demand[grp][lay] += 1
                    root_layouts.append(lay)
                    self.prod[h] = [tied[lay]]
                    forced[h] = lay
                    continue
            for c in group_classes[grp]:
                lay = int(cls_layout[c])
                if self.spaces.layouts[lay].partial:
                    continue
                if allowed is not None and lay not in allowed:
                    continue
                if tied is not None and lay not in tied:
                    continue
                if est[c] < best_v:
                    best_c, best_v = c, est[c]
            if best_c < 0:
                raise NoPlanError(
                    f"No layout of {self.describe(grp)} can be produced"
                    + (" within its pinned layout." if allowed is not None else ".")
                )
            demand[grp][int(cls_layout[best_c])] += 1
            root_layouts.append(int(cls_layout[best_c]))
            if tied is not None:
                h = tied_root[r]
                self.prod[h] = [tied[int(cls_layout[best_c])]]
                forced[h] = int(cls_layout[best_c])
        choice: dict[int, int] = {}
        for grp in reversed(self.order):
            if not demand[grp]:
                continue
            targets = frozenset(demand[grp])
            best_n, best_v = -1, math.inf
            w = self.weight_l[grp]
            for n in self.prod[grp]:
                v = cost_l[n] + sum(est[c] / uses[cls_group_l[c]] for c in kids[n])
                if v >= best_v:
                    continue
                v += w * self.steiner(grp, node_layout[n], targets)[0]
                if v < best_v:
                    best_n, best_v = n, v
            if best_n < 0:
                raise NoPlanError(f"No way to produce {self.describe(grp)} in the layouts its consumers need.")
            choice[grp] = best_n
            for h, lay in self.kid_gl[best_n]:
                demand[h][lay] += 1
        for h, nodes in released.items():
            if h not in self.place_of:
                self.prod[h] = nodes
        return self._finish(roots, root_layouts, choice, demand, deadline, max_sweeps, explain, chains, t0)

    def _pin(self, place_pins: dict[int, frozenset[int]] | None, ties: Sequence[tuple[int, int]]) -> None:
        """Productions narrowed to the pinned placements, and the place nodes of tied inputs by
        layout: every layout its pins allow (a seed picks the first plan's; the search may move it)."""
        g = self.g
        if not hasattr(self, "_prod_full"):
            self._prod_full = list(self.prod)
        # production lists are rebound, never mutated, so copying the outer list is enough
        self.prod = list(self._prod_full)
        for grp, lays in (place_pins or {}).items():
            self.prod[grp] = [
                n for n in self.prod[grp]
                if NodeKind(int(g.node_kind[n])) != NodeKind.PLACE or int(g.node_b[n]) in lays
            ]
        self.place_of: dict[int, dict[int, int]] = {}
        for h, _ in ties:
            self.place_of[h] = {int(g.node_b[n]): n for n in self.prod[h]
                                if NodeKind(int(g.node_kind[n])) == NodeKind.PLACE}

    def release(self, ex: Extraction, roots: Sequence[tuple[int, frozenset[int] | None]], deadline: float,
                place_pins: dict[int, frozenset[int]] | None, ties: Sequence[tuple[int, int]],
                chains: bool = True) -> Extraction:
        """Continue a plan found under tighter pins (a layout family's) with only `place_pins`:
        its inputs may move from there."""
        t0 = time.perf_counter()
        choice, demand, _, _, root_layouts, roots_of, _ = ex.state
        self._pin(place_pins, ties)
        self.roots_of = roots_of
        for h, rs in roots_of.items():  # a tied input stays placed as its roots are, until moved
            self.prod[h] = [self.place_of[h][root_layouts[rs[0]]]]
        out = self._finish(roots, list(root_layouts), dict(choice), [c.copy() for c in demand], deadline,
                           500, False, chains, t0)
        out.sweeps += ex.sweeps
        return out

    def resume(self, ex: Extraction, roots: Sequence[tuple[int, frozenset[int] | None]], deadline: float,
               max_sweeps: int = 500, explain: bool = True, chains: bool = True) -> Extraction:
        """Continue improving a plan this extractor found (same roots and ties), e.g. with the
        chain moves a cheap first run left out."""
        t0 = time.perf_counter()
        choice, demand, prod, place_of, root_layouts, roots_of, _ = ex.state
        self.prod, self.place_of, self.roots_of = list(prod), dict(place_of), roots_of
        out = self._finish(roots, list(root_layouts), dict(choice), [c.copy() for c in demand], deadline,
                           max_sweeps, explain, chains, t0)
        out.sweeps += ex.sweeps
        return out

    def _finish(self, roots: Sequence[tuple[int, frozenset[int] | None]], root_layouts: list[int],
                choice: dict[int, int], demand: list[Counter[int]], deadline: float, max_sweeps: int,
                explain: bool, chains: bool, t0: float) -> Extraction:
        g = self.g
        cls_layout = g.class_layout
        # 3. improvement: exact single-value moves, then exact chain re-labelling (Viterbi)
        sweeps = 0
        space_rounds = 0
        chain_list = self._chains(choice, demand) if chains else []
        dirty = set(choice)
        while dirty and sweeps < max_sweeps and time.perf_counter() < deadline:
            sweeps += 1
            changed: set[int] = set()
            for grp in self.order:
                if grp not in dirty or grp not in choice or len(self.prod[grp]) < 2:
                    continue
                self.work[0] += 1
                if self._improve(grp, choice, demand):
                    changed.add(grp)
            for chain in chain_list:
                if time.perf_counter() >= deadline:
                    break
                if dirty.isdisjoint(chain):
                    continue
                self.work[0] += len(chain)
                if self._relabel_chain(chain, choice, demand):
                    changed.update(chain)
            for h, rs in self.roots_of.items():
                outs = {roots[r][0] for r in rs}
                if (h in dirty or not dirty.isdisjoint(outs)) and self._move_tie(h, rs, roots, root_layouts, choice,
                                                                                  demand):
                    changed.update({h} | outs)
            if not changed and space_rounds < MAX_SPACE_ROUNDS and time.perf_counter() < deadline:
                # a local optimum: try moving whole tensor spaces (a residual stream) at once
                space_rounds += 1
                changed = self._space_moves(roots, root_layouts, choice, demand, deadline, every_layout=chains)
            dirty = set()
            for grp in changed:
                dirty.add(grp)
                dirty.update(self._demands(choice[grp]))
                dirty.update(self.parents[grp])
        # 4. result, and for each value the cheapest plan that differs in its layout ("why this")
        # the next run rebinds (never mutates) these: the state needs no copy
        state = (choice, demand, self.prod, self.place_of, root_layouts, self.roots_of, tuple(roots))
        alternatives = self._alternatives(state) if explain else {}
        choices: dict[int, GroupChoice] = {}
        total = 0.0
        for grp, n in choice.items():
            lay = int(cls_layout[g.node_class[n]])
            targets = frozenset(demand[grp])
            st_cost, rows = self.steiner(grp, lay, targets)
            sp = self.paths[self.group_key[grp]]
            steps = []
            for u, v in rows:
                e, _ = sp.edge[(u, v)]
                cc = self.model.collective(e.kind, e.axes, self.group_space[grp], e.src, e.dst, self.group_key[grp][1])
                steps.append(ReshardStep(e.kind, e.src, e.dst, e.axes, e.dim, e.dim2, cc.seconds, cc.moved_bytes, cc.buffer_bytes))
            steps.sort(key=lambda s: (sp.dist[sp.index[lay], sp.index[s.src]], s.src, s.dst))
            choices[grp] = GroupChoice(grp, n, lay, tuple(sorted(targets)), steps, float(self.cost[n]),
                                       weight=float(self.weight[grp]))
            total += float(self.cost[n]) + self.weight[grp] * st_cost
        return Extraction(
            choices=choices,
            root_layouts=list(root_layouts),
            total_s=total,
            method="greedy-dag",
            seconds=time.perf_counter() - t0,
            sweeps=sweeps,
            alternatives=alternatives,
            state=state,
        )

    # -- loop-carried state ----------------------------------------------------------------------
    def _tie_options(self, h: int, rs: list[int], roots: Sequence[tuple[int, frozenset[int] | None]],
                     root_layouts: list[int], choice: dict[int, int],
                     demand: list[Counter[int]]) -> tuple[float, list[tuple[int, float]]] | None:
        """The exact cost of a state leaf (its placement and every root tied to it) as it is, and
        with all of them moved to each other layout they allow; None if a root is unplanned."""
        outs = [roots[r][0] for r in rs]
        if any(o not in choice for o in outs):
            return None
        cur = root_layouts[rs[0]]
        touched = set(outs) | {h}
        before = self._cost_of(touched, choice, demand)
        options = []
        for lay, node in sorted(self.place_of[h].items()):
            if lay == cur or any(roots[r][1] is not None and lay not in roots[r][1] for r in rs):
                continue
            if any((o, lay) not in self._class_at for o in outs):
                continue
            self._retie(h, rs, roots, lay, node, root_layouts, choice, demand)
            options.append((lay, self._cost_of(touched, choice, demand)))
            self._retie(h, rs, roots, cur, self.place_of[h][cur], root_layouts, choice, demand)
        return before, options

    def _move_tie(self, h: int, rs: list[int], roots: Sequence[tuple[int, frozenset[int] | None]],
                  root_layouts: list[int], choice: dict[int, int], demand: list[Counter[int]]) -> bool:
        """Move a state leaf's layout (input placement and every root tied to it together) to the
        layout that minimises the exact cost of all of them."""
        costed = self._tie_options(h, rs, roots, root_layouts, choice, demand)
        if costed is None:
            return False
        before, options = costed
        best, best_lay = before - EPS - 1e-9 * before, -1
        for lay, after in options:
            if after < best:
                best, best_lay = after, lay
        if best_lay < 0:
            return False
        self._retie(h, rs, roots, best_lay, self.place_of[h][best_lay], root_layouts, choice, demand)
        return True

    def _retie(self, h: int, rs: list[int], roots: Sequence[tuple[int, frozenset[int] | None]], lay: int, node: int,
               root_layouts: list[int], choice: dict[int, int], demand: list[Counter[int]]) -> None:
        for r in rs:
            o = roots[r][0]
            old = root_layouts[r]
            demand[o][old] -= 1
            if demand[o][old] <= 0:
                del demand[o][old]
            demand[o][lay] += 1
            root_layouts[r] = lay
        self.prod[h] = [node]
        if h in choice:
            choice[h] = node

    # -- space moves -----------------------------------------------------------------------------
    def _space_moves(self, roots: Sequence[tuple[int, frozenset[int] | None]], root_layouts: list[int],
                     choice: dict[int, int], demand: list[Counter[int]], deadline: float,
                     every_layout: bool = True) -> set[int]:
        """Move every complete value of one tensor space (shape, dtype) to one layout at once,
        heaviest spaces first, keeping each move that lowers the exact DAG cost. Single-value and
        chain moves cannot leave a local optimum where a whole residual stream (and the loop
        carry that holds it) sits in a poor layout: each value alone would pay resharding on
        both sides. every_layout=False tries only the layouts the space's values are produced or
        read in now (a quick pass for starting points; the polishing pass tries every one)."""
        g = self.g
        by_space: dict[tuple[int, bool], list[int]] = {}
        for grp in choice:
            if self.group_space[grp] >= 0:
                by_space.setdefault(self.group_key[grp], []).append(grp)
        size = {key: float(np.prod(self.spaces.spaces[key[0]].shape or (1,))) for key in by_space}
        ranked = sorted((key for key, grps in by_space.items() if len(grps) >= 2),
                        key=lambda key: (-size[key] * sum(self.weight[x] for x in by_space[key]), key))
        tie_roots: dict[int, list[int]] = {h: rs for h, rs in self.roots_of.items() if h in self.place_of}
        layout_of = lambda n: int(g.class_layout[g.node_class[n]])  # noqa: E731
        changed: set[int] = set()
        for key in ranked[:MAX_SPACES]:
            if time.perf_counter() >= deadline:
                break
            groups = sorted((x for x in by_space[key] if not self.spaces.layouts[layout_of(choice[x])].partial),
                            key=lambda x: self.rank[x])
            if len(groups) < 2:
                continue
            # the outcome depends only on the choices around these values: skip a space whose
            # neighbourhood is as it was when it last found no move (the common case in later
            # rounds and when a plan is resumed)
            snap = self._space_snapshot(groups, roots, root_layouts, tie_roots, choice)
            seen = self._space_seen.setdefault((*key, every_layout), set())
            if snap in seen:
                continue
            candidates = ({layout_of(n) for x in groups for n in self.prod[x]} if every_layout else
                          {layout_of(choice[x]) for x in groups} | {lay for x in groups for lay in demand[x]})
            targets = sorted(lay for lay in candidates if not self.spaces.layouts[lay].partial)
            at: dict[int, dict[int, list[int]]] = {}  # group -> layout -> productions
            for x in groups:
                for n in self.prod[x]:
                    at.setdefault(x, {}).setdefault(layout_of(n), []).append(n)
            best_gain, best_plan = EPS, None
            for b in targets:
                if time.perf_counter() >= deadline:
                    break
                plan = self._space_plan(groups, b, roots, tie_roots, choice, at)
                self.work[0] += len(groups)
                if not plan:
                    continue
                gain = self._try_moves(plan, roots, root_layouts, tie_roots, choice, demand, keep=False)
                if gain > best_gain:
                    best_gain, best_plan = gain, plan
            if best_plan is not None:
                self._try_moves(best_plan, roots, root_layouts, tie_roots, choice, demand, keep=True)
                changed.update(best_plan)
            else:
                seen.add(snap)
        return changed

    def _space_snapshot(self, groups: list[int], roots: Sequence[tuple[int, frozenset[int] | None]],
                        root_layouts: list[int], tie_roots: dict[int, list[int]],
                        choice: dict[int, int]) -> tuple:
        """Everything a space move's outcome reads: the productions chosen for the space's
        values, their possible operands, tied outputs, and every consumer of those (which make
        up their demands), plus the layouts of the roots among them."""
        base = set(groups)
        for grp in groups:
            for n in (self.place_of[grp].values() if grp in self.place_of else self.prod[grp]):
                base.update(self._demands(n))
            base.update(roots[r][0] for r in tie_roots.get(grp, ()))
        deps = set(base)
        for x in base:
            deps.update(self.parents[x])
        ordered = sorted(deps)
        return (tuple(choice.get(x, -1) for x in ordered),
                tuple(root_layouts[r] for r, (grp, _) in enumerate(roots) if grp in base))

    def _space_plan(self, groups: list[int], b: int, roots: Sequence[tuple[int, frozenset[int] | None]],
                    tie_roots: dict[int, list[int]], choice: dict[int, int],
                    at: dict[int, dict[int, list[int]]]) -> dict[int, int]:
        """For each group (in order), the production in layout b that is cheapest given the
        groups before it already moved; groups with none in b stay."""
        g = self.g
        moved: dict[int, int] = {}
        for grp in groups:
            if grp in self.place_of:
                node = self.place_of[grp].get(b)
                rs = tie_roots.get(grp, [])
                if node is None or any(roots[r][1] is not None and b not in roots[r][1] for r in rs) or any(
                        (roots[r][0], b) not in self._class_at for r in rs):
                    continue
                if node != choice.get(grp):
                    moved[grp] = node
                continue
            best_n, best_v = -1, math.inf
            for n in at.get(grp, {}).get(b, ()):
                v = float(self.cost[n])
                for h, lays in self._demands(n).items():
                    if h not in choice:
                        v = math.inf
                        break
                    src = moved.get(h, choice[h])
                    v += self.weight[h] * self.steiner(h, int(g.class_layout[g.node_class[src]]), frozenset(lays))[0]
                if v < best_v:
                    best_n, best_v = n, v
            if best_n >= 0 and best_n != choice[grp]:
                moved[grp] = best_n
        return moved

    def _try_moves(self, plan: dict[int, int], roots: Sequence[tuple[int, frozenset[int] | None]],
                   root_layouts: list[int], tie_roots: dict[int, list[int]], choice: dict[int, int],
                   demand: list[Counter[int]], keep: bool) -> float:
        """Apply the moves, return the exact saving; undo them unless `keep`."""
        g = self.g
        touched = set(plan)
        for grp, n in plan.items():
            touched |= set(self._demands(choice[grp])) | set(self._demands(n))
            touched |= {roots[r][0] for r in tie_roots.get(grp, [])}
        touched = {x for x in touched if x in choice}
        before = self._cost_of(touched, choice, demand)
        old = {grp: choice[grp] for grp in plan}

        def put(nodes: dict[int, int]) -> None:
            for grp, n in nodes.items():
                if grp in self.place_of:
                    self._retie(grp, tie_roots.get(grp, []), roots, int(g.node_b[n]), n, root_layouts, choice, demand)
                else:
                    self._set([grp], [n], choice, demand)

        put(plan)
        after = self._cost_of(touched, choice, demand)
        gain = before - after - 1e-9 * before
        if not keep or not (gain > EPS):
            put(old)  # re-tying an input restores its roots' layouts too
        return gain

    # -- chain moves -----------------------------------------------------------------------------
    def _demands(self, n: int) -> dict[int, tuple[int, ...]]:
        """Layouts node n needs of each operand group."""
        hit = self._demand_memo.get(n)
        if hit is None:
            out: dict[int, list[int]] = {}
            for c in self.kids[n]:
                out.setdefault(int(self.g.class_group[c]), []).append(int(self.g.class_layout[c]))
            hit = self._demand_memo[n] = {h: tuple(sorted(v)) for h, v in out.items()}
        return hit

    def _chains(self, choice: dict[int, int], demand: list[Counter[int]]) -> list[list[int]]:
        """A path cover of the used values along producer -> consumer edges, heaviest tensors
        first: the chains whose layouts must switch together (a forward pass, a backward pass)."""
        edges = []
        for grp, n in choice.items():
            for h in self._demands(n):
                if h in choice:
                    vids = self.g.group_values[h]
                    size = self.spaces.spaces[self.group_space[h]].shape if vids else ()
                    edges.append((-float(np.prod(size)) if size else 0.0, h, grp))
        edges.sort()
        succ: dict[int, int] = {}
        pred: dict[int, int] = {}
        for _, h, grp in edges:
            if h not in succ and grp not in pred:
                succ[h] = grp
                pred[grp] = h
        chains = []
        for start in sorted(choice, key=lambda x: self.rank[x]):
            if start in pred:
                continue
            chain = [start]
            while chain[-1] in succ:
                chain.append(succ[chain[-1]])
            if len(chain) > 1:
                chains.append(chain)
        return chains

    def _relabel_chain(self, chain: list[int], choice: dict[int, int], demand: list[Counter[int]]) -> bool:
        """Re-choose the productions of a chain jointly (exact dynamic programming along the
        chain, the rest of the plan fixed); keep the result if the true DAG cost drops."""
        g = self.g
        on_chain = set(chain)
        # demands on each chain value from everyone except its chain successor
        fixed: list[Counter[int]] = []
        for i, grp in enumerate(chain):
            d = demand[grp].copy()
            if i + 1 < len(chain):
                for lay in self._demands(choice[chain[i + 1]]).get(grp, ()):
                    d[lay] -= 1
            fixed.append(Counter({k: v for k, v in d.items() if v > 0}))
        # demands on off-chain operands, without the chain's own current demands
        off: dict[int, Counter[int]] = {}
        for grp in chain:
            for h, lays in self._demands(choice[grp]).items():
                if h in on_chain:
                    continue
                d = off.setdefault(h, demand[h].copy())
                for lay in lays:
                    d[lay] -= 1
        off = {h: Counter({k: v for k, v in d.items() if v > 0}) for h, d in off.items()}

        off_sets = {h: frozenset(d) for h, d in off.items()}
        empty: frozenset[int] = frozenset()
        # an off-chain operand's extra cost for one set of demanded layouts: the same for every
        # production that asks for them
        op_memo: dict[tuple[int, tuple[int, ...]], float] = {}
        cost_l = self.cost_l

        def unary(i: int, n: int) -> float:
            v = cost_l[n]
            for h, lays in self._demands(n).items():
                if h in on_chain:
                    if i == 0 or h != chain[i - 1]:
                        return math.inf  # keep chain links the only on-chain dependencies
                    continue
                if h not in choice:
                    return math.inf
                d = op_memo.get((h, lays))
                if d is None:
                    base = off_sets.get(h, empty)
                    ph = choice[h]
                    d = op_memo[(h, lays)] = self._own(h, ph, base | frozenset(lays)) - (
                        self._own(h, ph, base) if base else cost_l[ph])
                v += d
            return v

        layout_of = lambda n: int(g.class_layout[g.node_class[n]])  # noqa: E731
        steiner = self.steiner
        fixed_sets = [frozenset(f) for f in fixed]
        best: list[dict[int, tuple[float, int]]] = []  # per position: layout -> (value, node)
        back: list[dict[int, int]] = []  # per position: node -> predecessor node
        for i, grp in enumerate(chain):
            cur: dict[int, tuple[float, int]] = {}
            links: dict[int, int] = {}
            w_memo: dict[tuple[int, ...], tuple[float, int]] = {}
            prev_rows: list[tuple[int, float, int]] | None = None
            for n in self.prod[grp]:
                u = unary(i, n)
                if not math.isfinite(u):
                    continue
                if i > 0:
                    need = self._demands(n).get(chain[i - 1], ())
                    if need not in w_memo:
                        prev = chain[i - 1]
                        bv, bn = math.inf, -1
                        t = fixed_sets[i - 1] | frozenset(need)
                        wp = float(self.weight[prev])
                        if prev_rows is None:
                            index = self.paths[self.group_key[prev]].index
                            layouts_prev = self.paths[self.group_key[prev]].layouts
                            # cheapest first: resharding costs are >= 0, so once a layout's own
                            # value exceeds the best total no later one can win (ties go to the
                            # earlier layout, as in a scan of all of them)
                            prev_rows = sorted(((val, k, index[lay], pn) for k, (lay, (val, pn))
                                                in enumerate(best[i - 1].items())))
                        row = self._steiner_row(prev, t) if t else None
                        bk = -1
                        for val, k, r, pn in prev_rows:
                            if val > bv:
                                break
                            if row is None:
                                tot = val
                            else:
                                c = row[r]
                                if c is None:
                                    c = row[r] = steiner(prev, layouts_prev[r], t)[0]
                                tot = val + wp * c
                            if tot < bv or (tot == bv and k < bk):
                                bv, bn, bk = tot, pn, k
                        w_memo[need] = (bv, bn)
                    w, pn = w_memo[need]
                    u += w
                    links[n] = pn
                lay = layout_of(n)
                if lay not in cur or u < cur[lay][0]:
                    cur[lay] = (u, n)
            if not cur:
                return False
            best.append(cur)
            back.append(links)
        last = chain[-1]
        bv, bn = math.inf, -1
        for lay, (val, n) in best[-1].items():
            t = frozenset(fixed[-1])
            tot = val + (self.weight[last] * self.steiner(last, lay, t)[0] if t else 0.0)
            if tot < bv:
                bv, bn = tot, n
        new = [bn]
        for i in range(len(chain) - 1, 0, -1):
            new.append(back[i][new[-1]])
        new.reverse()
        if all(choice[grp] == n for grp, n in zip(chain, new, strict=True)):
            return False
        # exact comparison on every value whose cost can change
        touched = set(chain)
        for grp, n in zip(chain, new, strict=True):
            touched |= set(self._demands(choice[grp])) | set(self._demands(n))
        before = self._cost_of(touched, choice, demand)
        old = {grp: choice[grp] for grp in chain}
        self._set(chain, new, choice, demand)
        after = self._cost_of(touched, choice, demand)
        if after < before - EPS - 1e-9 * before:
            return True
        self._set(chain, [old[grp] for grp in chain], choice, demand)
        return False

    def _set(self, groups: list[int], nodes: list[int], choice: dict[int, int], demand: list[Counter[int]]) -> None:
        kid_gl = self.kid_gl
        for grp, n in zip(groups, nodes, strict=True):
            for h, lay in kid_gl[choice[grp]]:
                d = demand[h]
                d[lay] -= 1
                if d[lay] <= 0:
                    del d[lay]
            choice[grp] = n
            for h, lay in kid_gl[n]:
                demand[h][lay] += 1

    def _cost_of(self, groups: set[int], choice: dict[int, int], demand: list[Counter[int]]) -> float:
        total = 0.0
        for grp in groups:
            if grp in choice:
                t = frozenset(demand[grp])
                total += self._own(grp, choice[grp], t) if t else math.inf
        return total

    def _own(self, grp: int, n: int, targets: frozenset[int]) -> float:
        return self.cost_l[n] + self.weight_l[grp] * self.steiner(grp, self.node_layout[n], targets)[0]

    def _alternatives(self, state: Any) -> dict[int, tuple[int, float]]:
        choice, demand, prod, place_of, root_layouts, roots_of, roots = state
        self.prod, self.place_of = list(prod), dict(place_of)
        choice, demand, root_layouts = dict(choice), [d.copy() for d in demand], list(root_layouts)
        out = {}
        for grp in choice:
            if grp in place_of and roots_of.get(grp):
                alt = self._tied_alternative(grp, roots_of[grp], roots, root_layouts, choice, demand)
            else:
                alt = self._alternative(grp, choice, demand)
            if alt is not None:
                out[grp] = alt
        return out

    def _tied_alternative(self, h: int, rs: list[int], roots: Sequence[tuple[int, frozenset[int] | None]],
                          root_layouts: list[int], choice: dict[int, int],
                          demand: list[Counter[int]]) -> tuple[int, float] | None:
        """(layout, extra seconds) of loop-carried state placed and returned in another layout:
        the input and every output tied to it move together, as `_move_tie` moves them."""
        costed = self._tie_options(h, rs, roots, root_layouts, choice, demand)
        if costed is None:
            return None
        before, options = costed
        deltas = [(lay, after - before) for lay, after in options if math.isfinite(after - before)]
        return min(deltas, key=lambda x: x[1]) if deltas else None

    def forget_search(self) -> None:
        """Drop what only the search reads (a plan keeps its extractor for explain())."""
        self._space_seen.clear()

    def explain(self, ex: Extraction) -> None:
        """Fill in the "why this" alternatives of a plan this extractor found."""
        if ex.state is not None and not ex.alternatives:
            ex.alternatives = self._alternatives(ex.state)

    def _alternative(self, grp: int, choice: dict[int, int], demand: list[Counter[int]]) -> tuple[int, float] | None:
        """(layout, extra seconds) of the best production of this value in another layout, the
        rest of the plan fixed (operands' resharding priced exactly)."""
        g = self.g
        cur = choice[grp]
        cur_lay = int(g.class_layout[g.node_class[cur]])
        targets = frozenset(demand[grp])
        base = self._own(grp, cur, targets)
        cur_d = self._demands(cur)
        best: tuple[int, float] | None = None
        for n in self.prod[grp] if grp not in self.place_of else self.place_of[grp].values():
            lay = int(g.class_layout[g.node_class[n]])
            if lay == cur_lay:
                continue
            delta = self._own(grp, n, targets) - base
            new_d = self._demands(n)
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
                delta += self._own(h, choice[h], after) - self._own(h, choice[h], frozenset(demand[h]))
            if math.isfinite(delta) and (best is None or delta < best[1]):
                best = (lay, delta)
        return best

    def _improve(self, grp: int, choice: dict[int, int], demand: list[Counter[int]]) -> bool:
        """Best single change of this value's production, priced exactly on the DAG: its own
        node and resharding tree, and its operands' resharding trees."""
        cur = choice[grp]
        targets = frozenset(demand[grp])
        base = self._own(grp, cur, targets)
        cur_d = self._demands(cur)
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
            before[h] = self._own(h, choice[h], frozenset(d))
            saving += self._own(h, choice[h], rest[h]) - before[h]
        best_delta, best_n = -EPS - 1e-9 * base, -1
        slack = EPS + 1e-9 * abs(base)  # the bound sums in another order than delta below
        for n in self.prod[grp]:
            if n == cur:
                continue
            delta = self._own(grp, n, targets) - base
            if delta + saving > best_delta + slack:
                continue
            new_d = self._demands(n)
            ok = True
            for h in cur_d.keys() | new_d.keys():
                if h not in choice:
                    ok = False  # operand not produced in the current plan
                    break
                if h not in rest:
                    d = demand[h]
                    mine = cur_d.get(h, ())
                    rest[h] = frozenset(k for k, v in d.items() if v > mine.count(k)) if mine else frozenset(d)
                    before[h] = self._own(h, choice[h], frozenset(d))
                lays = new_d.get(h)
                after = rest[h].union(lays) if lays else rest[h]
                if not after:
                    ok = False
                    break
                delta += self._own(h, choice[h], after) - before[h]
                if delta >= best_delta and h not in new_d:
                    break
            if ok and delta < best_delta:
                best_delta, best_n = delta, n
        if best_n < 0:
            return False
        self._set([grp], [best_n], choice, demand)
        return True
