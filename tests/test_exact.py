"""Exact extraction against brute force, greedy against exact, and determinism.

A *plan* over an exported layout e-graph: every value group the outputs need has one production
(a PLACE node for an input, or one LOCAL node = one strategy of its equation) and a resharding
arborescence rooted at the produced class that reaches every class its consumers' chosen nodes
and the outputs need (an output may take any non-partial layout, or one of its pinned layouts).
Its cost is the sum of the chosen production nodes' costs and of the arborescences' e-node costs,
each node once.

`brute_force` below enumerates that plan space independently of shardsat's extractors, from the
exported arrays and node costs only: every combination of productions for the needed groups
(childless productions, i.e. placements, are chosen per demanded set, which is exact since
nothing depends on them), and for each group the exact minimum arborescence (Dreyfus-Wagner on
the group's resharding e-nodes). It is compared with `solve_exact` (the ILP) and the greedy
`Extractor` on random synthetic e-graphs (built directly as ExportedGraph), on a catalogue of
small programs (1x4 and 2x2 meshes, pinned and free) and on random programs from
test_equivalence's generator; every plan is also checked against the e-graph (its steps are
e-nodes forming an arborescence, its reported cost is its cost), must run and must match the
unsharded function. Last, planning is deterministic: twice in one process, and in a fresh one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from test_equivalence import programs as random_programs

import shardsat
import shardsat.api as api
from shardsat.egraph.export import ExportedGraph, NodeKind
from shardsat.extract import exact
from shardsat.extract.agreement import agreed_bound
from shardsat.extract.exact import solve_exact
from shardsat.extract.greedy import Extractor
from shardsat.extract.plancost import cost_plan
from shardsat.extract.result import Extraction
from shardsat.extract.search import Problem
from shardsat.extract.splitbound import split_bound, split_rounds
from shardsat.rules.reshard import ReshardEdge
from shardsat.runtime.plan import Plan
from shardsat.testing import check_plan

ROOT = Path(__file__).resolve().parents[1]
REL = 1e-9  # relative tolerance between exact optima computed two ways
Roots = Sequence[tuple[int, frozenset[int] | None]]


# ---- brute force -------------------------------------------------------------------------------


def _is_reshard(kind: int) -> bool:
    return NodeKind(kind).is_reshard


class BruteForce:
    """The minimum plan cost by enumeration (see the module docstring)."""

    def __init__(self, g: ExportedGraph, node_cost: np.ndarray, roots: Roots, partial: set[int],
                 place_pins: dict[int, frozenset[int]] | None = None) -> None:
        """place_pins: input group -> the layouts it may be placed in."""
        self.g = g
        self.cost = node_cost
        self.roots = list(roots)
        self.partial = partial
        G = g.num_groups
        self.classes: list[list[int]] = [[] for _ in range(G)]
        for c in range(g.num_classes):
            self.classes[int(g.class_group[c])].append(c)
        self.local = {c: i for cs in self.classes for i, c in enumerate(cs)}
        # productions: nodes with children (enumerated) and childless ones (chosen per demand)
        self.prods: list[list[int]] = [[] for _ in range(G)]
        self.leaves: list[list[int]] = [[] for _ in range(G)]
        # per group: all-pairs cheapest resharding between its classes (Floyd-Warshall)
        self.dist: list[np.ndarray] = [np.full((len(cs), len(cs)), math.inf) for cs in self.classes]
        for d in self.dist:
            np.fill_diagonal(d, 0.0)
        for n in range(g.num_nodes):
            if not math.isfinite(node_cost[n]):
                continue
            c = int(g.node_class[n])
            grp = int(g.class_group[c])
            kind = int(g.node_kind[n])
            kids = [int(k) for k in g.children(n)]
            if _is_reshard(kind):
                (k,) = kids
                assert int(g.class_group[k]) == grp
                u, v = self.local[k], self.local[c]
                self.dist[grp][u, v] = min(self.dist[grp][u, v], float(node_cost[n]))
            elif kind in (NodeKind.PLACE, NodeKind.LOCAL):
                if kind == NodeKind.PLACE and grp in (place_pins or {}) and int(g.node_b[n]) not in place_pins[grp]:
                    continue
                if any(int(g.class_group[k]) == grp for k in kids):
                    continue  # would need the value to compute itself
                (self.prods if kids else self.leaves)[grp].append(n)
        for d in self.dist:
            for k in range(len(d)):
                np.minimum(d, d[:, k : k + 1] + d[k : k + 1, :], out=d)
        self._steiner: dict[tuple[int, int, frozenset[int]], float] = {}
        self._tree: dict[tuple[int, int, frozenset[int]], float] = {}
        self.plans = 0
        self.root_options: dict[int, list[list[int]]] = {}
        for grp, allowed in self.roots:
            ok = [c for c in self.classes[grp] if int(g.class_layout[c]) not in partial
                  and (allowed is None or int(g.class_layout[c]) in allowed)]
            self.root_options.setdefault(grp, []).append(ok)

    def steiner(self, grp: int, src: int, terms: frozenset[int]) -> float:
        """Cheapest arborescence from class src reaching the classes terms (Dreyfus-Wagner)."""
        key = (grp, src, terms)
        hit = self._steiner.get(key)
        if hit is not None:
            return hit
        d = self.dist[grp]
        s = self.local[src]
        ts = sorted(self.local[t] for t in terms if t != src)
        if not ts:
            out = 0.0
        elif len(ts) == 1:
            out = float(d[s, ts[0]])
        else:
            k = len(ts)
            dp: dict[int, np.ndarray] = {1 << i: d[:, t].copy() for i, t in enumerate(ts)}
            for mask in sorted(range(1, 1 << k), key=lambda m: bin(m).count("1")):
                if mask in dp:
                    continue
                merge = np.full(len(d), math.inf)
                sub = (mask - 1) & mask
                while sub:
                    if sub < mask ^ sub:  # each split once
                        merge = np.minimum(merge, dp[sub] + dp[mask ^ sub])
                    sub = (sub - 1) & mask
                dp[mask] = np.min(d + merge[None, :], axis=1)
            out = float(dp[(1 << k) - 1][s])
        self._steiner[key] = out
        return out

    def tree(self, grp: int, src: int, demand: frozenset[int]) -> float:
        """Cheapest arborescence for the consumers' demand plus one allowed class per output."""
        key = (grp, src, demand)
        hit = self._tree.get(key)
        if hit is not None:
            return hit
        best = math.inf
        for pick in itertools.product(*self.root_options.get(grp, [])):
            best = min(best, self.steiner(grp, src, demand | frozenset(pick)))
        self._tree[key] = best
        return best

    def leaf_cost(self, grp: int, demand: frozenset[int]) -> float:
        return min((float(self.cost[n]) + self.tree(grp, int(self.g.node_class[n]), demand)
                    for n in self.leaves[grp]), default=math.inf)

    def solve(self, max_plans: int = 200_000) -> float:
        g = self.g
        best = math.inf
        root_groups = sorted({grp for grp, _ in self.roots})

        def acyclic(choice: dict[int, int]) -> bool:
            state: dict[int, int] = {}

            def visit(x: int) -> bool:
                state[x] = 1
                n = choice[x]
                if n >= 0:
                    for k in g.children(n):
                        h = int(g.class_group[k])
                        if state.get(h) == 1 or (h not in state and not visit(h)):
                            return False
                state[x] = 2
                return True

            return all(x in state or visit(x) for x in choice)

        def finish(choice: dict[int, int]) -> float:
            if not acyclic(choice):
                return math.inf
            demand: dict[int, set[int]] = {grp: set() for grp in choice}
            for n in choice.values():
                if n >= 0:
                    for k in g.children(n):
                        demand[int(g.class_group[k])].add(int(k))
            total = 0.0
            for grp, n in choice.items():
                dem = frozenset(demand[grp])
                if n < 0:
                    total += self.leaf_cost(grp, dem)
                else:
                    total += float(self.cost[n]) + self.tree(grp, int(g.node_class[n]), dem)
                if total >= best:
                    return math.inf
            return total

        def rec(choice: dict[int, int], pending: list[int]) -> None:
            nonlocal best
            if not pending:
                self.plans += 1
                assert self.plans <= max_plans, "brute force: too many plans"
                best = min(best, finish(choice))
                return
            grp = pending[-1]
            rest = pending[:-1]
            options = list(self.prods[grp]) + ([-1] if self.leaves[grp] else [])
            for n in options:
                choice[grp] = n
                new = sorted({int(g.class_group[k]) for k in g.children(n)} - set(choice) - set(rest)) if n >= 0 else []
                rec(choice, sorted(rest + new))
                del choice[grp]

        rec({}, root_groups)
        return best

    def count(self) -> int:
        """How many production combinations `solve` would enumerate, at most (all groups)."""
        return math.prod(max(1, len(self.prods[grp]) + (1 if self.leaves[grp] else 0))
                         for grp in range(self.g.num_groups))


def brute_force(g: ExportedGraph, node_cost: np.ndarray, roots: Roots, partial: set[int]) -> float:
    return BruteForce(g, node_cost, roots, partial).solve()


# ---- checking an extraction against the e-graph --------------------------------------------------


def plan_cost(g: ExportedGraph, node_cost: np.ndarray, ex: Extraction, roots: Roots, partial: set[int]) -> float:
    """The cost of an extractor's plan, recomputed from the e-graph after checking that it is a
    plan: productions are PLACE/LOCAL nodes of their groups, every operand group is produced,
    resharding steps are e-nodes of the group forming an arborescence from the produced layout
    that reaches every demanded layout, outputs sit in allowed non-partial layouts."""
    at = {(int(g.class_group[c]), int(g.class_layout[c])): c for c in range(g.num_classes)}
    # cheapest reshard e-node per (class, kind, axes mask, src layout)
    edge: dict[tuple[int, int, int, int], float] = {}
    for n in range(g.num_nodes):
        if _is_reshard(int(g.node_kind[n])):
            c = int(g.node_class[n])
            key = (c, int(g.node_kind[n]), int(g.node_a[n]), int(g.class_layout[g.children(n)[0]]))
            edge[key] = min(edge.get(key, math.inf), float(node_cost[n]))
    demand: dict[int, set[int]] = {grp: set() for grp in ex.choices}
    for grp, ch in ex.choices.items():
        assert int(g.class_group[g.node_class[ch.node]]) == grp
        assert int(g.node_kind[ch.node]) in (NodeKind.PLACE, NodeKind.LOCAL)
        assert int(g.class_layout[g.node_class[ch.node]]) == ch.layout
        for k in g.children(ch.node):
            h = int(g.class_group[k])
            assert h in ex.choices, f"operand group {h} of group {grp} is not produced"
            demand[h].add(int(g.class_layout[k]))
    for (grp, allowed), lay in zip(roots, ex.root_layouts, strict=False):
        assert lay is not None and lay not in partial and (allowed is None or lay in allowed)
        demand[grp].add(lay)
    total = 0.0
    for grp, ch in ex.choices.items():
        total += float(node_cost[ch.node])
        reached = {ch.layout}
        dsts = [s.dst for s in ch.steps]
        assert len(set(dsts)) == len(dsts) and ch.layout not in dsts, "steps are not an arborescence"
        for s in ch.steps:  # in order from the produced layout outwards
            assert s.src in reached, f"group {grp}: step {s.src}->{s.dst} from an unreached layout"
            reached.add(s.dst)
            key = (at[(grp, s.dst)], int(s.kind), sum(1 << a for a in s.axes), s.src)
            assert key in edge, f"group {grp}: step {s} is not an e-node of the e-graph"
            total += edge[key]
        assert demand[grp] <= reached, f"group {grp}: demanded {demand[grp]} but reached {reached}"
    return total


# ---- random synthetic e-graphs -------------------------------------------------------------------

RESHARD_KINDS = (NodeKind.ALL_GATHER, NodeKind.DYN_SLICE, NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER,
                 NodeKind.ALL_TO_ALL)
N_LAYOUTS = 8
PARTIAL = {6, 7}  # layout ids of pending sums: never an output


class FakeModel:
    """What the extractors ask of a CostModel: `mesh.unmask` and `collective(...)` prices."""

    def __init__(self, prices: dict[tuple[int, tuple[int, ...], int, int, int], float]) -> None:
        self.prices = prices
        self.mesh = SimpleNamespace(unmask=lambda m: tuple(a for a in range(3) if m >> a & 1))

    def collective(self, kind: int, axes: tuple[int, ...], space: int, src: int, dst: int,
                   combinable: bool = False) -> Any:
        return SimpleNamespace(seconds=self.prices[(int(kind), tuple(axes), space, src, dst)],
                               moved_bytes=0.0, buffer_bytes=0)


@dataclass
class Synthetic:
    """A hand-built e-graph (one value per group, one space per group) with what the extractors
    need besides it, derived from the graph: prices, spaces and resharding edges."""

    graph: ExportedGraph
    node_cost: np.ndarray
    roots: list[tuple[int, frozenset[int] | None]]

    def tables(self) -> tuple[FakeModel, Any, dict[int, list[ReshardEdge]]]:
        g = self.graph
        prices: dict[tuple[int, tuple[int, ...], int, int, int], float] = {}
        for n in range(g.num_nodes):
            if _is_reshard(int(g.node_kind[n])):
                c = int(g.node_class[n])
                axes = tuple(a for a in range(3) if int(g.node_a[n]) >> a & 1)
                key = (int(g.node_kind[n]), axes, int(g.class_group[c]), int(g.class_layout[g.children(n)[0]]),
                       int(g.class_layout[c]))
                assert key not in prices, "parallel e-nodes need different kinds or axes"
                prices[key] = float(self.node_cost[n])
        edges: dict[int, list[ReshardEdge]] = {}
        for (kind, axes, grp, u, v) in sorted(prices):
            edges.setdefault(grp, []).append(ReshardEdge(NodeKind(kind), u, v, axes))
        spaces = SimpleNamespace(
            spaces=[SimpleNamespace(layouts=tuple(sorted(int(g.class_layout[c]) for c in range(g.num_classes)
                                                         if g.class_group[c] == grp)), shape=(4, 4))
                    for grp in range(g.num_groups)],
            layouts=[SimpleNamespace(partial=(0,) if lay in PARTIAL else ()) for lay in range(N_LAYOUTS)],
        )
        return FakeModel(prices), spaces, edges

    def exact(self) -> Extraction:
        model, _, _ = self.tables()
        res = solve_exact(self.graph, self.node_cost, list(range(self.graph.num_groups)), model, frozenset(),
                          self.roots, {}, [], PARTIAL, time_limit=30.0)
        assert res.status == "optimal" and res.extraction is not None, res.status
        return res.extraction

    def greedy(self) -> Extraction:
        model, spaces, edges = self.tables()
        ex = Extractor(self.graph, self.node_cost, list(range(self.graph.num_groups)), spaces, edges, model)
        return ex.run(self.roots, deadline=time.perf_counter() + 30.0)

    def lower_bound(self) -> float:
        model, spaces, edges = self.tables()
        ex = Extractor(self.graph, self.node_cost, list(range(self.graph.num_groups)), spaces, edges, model)
        return ex.lower_bound(self.roots)

    def split_bound(self) -> float:
        model, spaces, edges = self.tables()
        ex = Extractor(self.graph, self.node_cost, list(range(self.graph.num_groups)), spaces, edges, model)
        return split_bound(ex, self.roots)

    def agreed_bound(self, target: float) -> float:
        """The split bound raised by agreement prices, stepping towards `target` (a plan's cost)."""
        model, spaces, edges = self.tables()
        ex = Extractor(self.graph, self.node_cost, list(range(self.graph.num_groups)), spaces, edges, model)
        rounds = split_rounds(ex.graph, self.roots, (), {}, None)
        return agreed_bound(ex.graph, self.roots, rounds, target, evaluations=float("inf"), max_rounds=40)

    def brute_force(self) -> float:
        return brute_force(self.graph, self.node_cost, self.roots, PARTIAL)

    def check(self, ex: Extraction) -> float:
        """The extraction is a plan of this e-graph and its reported cost is its cost."""
        cost = plan_cost(self.graph, self.node_cost, ex, self.roots, PARTIAL)
        assert close(cost, ex.total_s), (cost, ex.total_s)
        return cost


def tiny_graph(cls: list[tuple[int, int]], nodes: list[tuple[tuple[int, int], NodeKind, list[tuple[int, int]], float]]
               ) -> tuple[ExportedGraph, np.ndarray]:
    """An ExportedGraph from (group, layout) classes and (class, kind, child classes, cost) nodes;
    resharding nodes get axes mask 1, placements their class's layout."""
    c = {k: i for i, k in enumerate(cls)}
    G = max(grp for grp, _ in cls) + 1
    ptr = np.cumsum([0] + [len(n[2]) for n in nodes])
    g = ExportedGraph(
        class_group=np.asarray([grp for grp, _ in cls], dtype=np.int32),
        class_layout=np.asarray([lay for _, lay in cls], dtype=np.int32),
        group_values=[[grp] for grp in range(G)],
        node_class=np.asarray([c[n[0]] for n in nodes], dtype=np.int32),
        node_kind=np.asarray([int(n[1]) for n in nodes], dtype=np.int8),
        node_key=["op" if n[1] == NodeKind.LOCAL else None for n in nodes],
        node_a=np.ones(len(nodes), dtype=np.int64),
        node_b=np.asarray([n[0][1] for n in nodes], dtype=np.int64),
        node_c=np.zeros(len(nodes), dtype=np.int64),
        child_ptr=ptr.astype(np.int64),
        child_idx=np.asarray([c[k] for n in nodes for k in n[2]], dtype=np.int32),
        value_group={grp: grp for grp in range(G)},
    )
    return g, np.asarray([n[3] for n in nodes], dtype=float)


def synthetic(seed: int, scale: float = 1.0) -> Synthetic:
    """A random layout e-graph: input groups with placements, op groups with strategies reading
    earlier groups (sometimes one operand group in two layouts), random resharding edges (a ring,
    so every layout is reachable, plus extras, sometimes two parallel e-nodes of different kinds)
    with random positive costs (times `scale`), one or two outputs (sometimes pinned)."""
    rnd = random.Random(seed)
    G = rnd.randint(3, 6)
    n_in = rnd.randint(1, 2)
    group_layouts = []
    for _ in range(G):
        lays = sorted(rnd.sample(range(N_LAYOUTS), rnd.randint(2, 5)))
        if all(x in PARTIAL for x in lays):
            lays = sorted({0, *lays})
        group_layouts.append(lays)
    cls = [(grp, lay) for grp, lays in enumerate(group_layouts) for lay in lays]
    nodes: list[tuple[tuple[int, int], NodeKind, list[tuple[int, int]], float]] = []
    for grp, lays in enumerate(group_layouts):
        if grp < n_in:
            for lay in rnd.sample(lays, rnd.randint(1, len(lays))):
                nodes.append(((grp, lay), NodeKind.PLACE, [], rnd.choice([0.0, rnd.random()])))
        else:
            for _ in range(rnd.randint(1, 4)):
                kids = [(h, rnd.choice(group_layouts[h])) for h in (rnd.randrange(grp) for _ in range(rnd.randint(1, 3)))]
                nodes.append(((grp, rnd.choice(lays)), NodeKind.LOCAL, kids, rnd.uniform(0.1, 3.0)))
        ring = rnd.sample(lays, len(lays))
        pairs = {(ring[i - 1], ring[i]) for i in range(len(ring))}
        pairs |= {(u, v) for u in lays for v in lays if u != v and rnd.random() < 0.35}
        for u, v in sorted(pairs):
            for kind in rnd.sample(RESHARD_KINDS, 2 if rnd.random() < 0.2 else 1):
                nodes.append(((grp, v), kind, [(grp, u)], rnd.uniform(0.05, 2.0)))
    rnd.shuffle(nodes)
    g, cost = tiny_graph(cls, nodes)
    roots: list[tuple[int, frozenset[int] | None]] = [(G - 1, None)]
    if rnd.random() < 0.5:  # a second output, sometimes pinned to a subset of its layouts
        h = rnd.randrange(G - 1)
        ok = [lay for lay in group_layouts[h] if lay not in PARTIAL]
        if ok:
            roots.append((h, frozenset(rnd.sample(ok, rnd.randint(1, len(ok)))) if rnd.random() < 0.5 else None))
    return Synthetic(g, cost * scale, roots)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-300)


def test_brute_force_on_hand_made_graph():
    """The enumerator itself: a shared operand pays one arborescence (a Steiner tree, cheaper
    than the union of shortest paths), outputs take a non-partial layout."""
    # group 0: an input placed at layout 0; edges 0->3 (1.0), 3->1 and 3->2 (0.1 each), 0->1 and
    # 0->2 (0.7 each): reaching {1, 2} costs 1.2 through 3, 1.4 directly.
    # group 1: an op reading 0@1 and 0@2 (cost 1), produced at partial layout 6, edge 6->0 (0.5).
    cls = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 6)]
    g, cost = tiny_graph(cls, [
        ((0, 0), NodeKind.PLACE, [], 0.0),
        ((0, 3), NodeKind.ALL_GATHER, [(0, 0)], 1.0),
        ((0, 1), NodeKind.DYN_SLICE, [(0, 3)], 0.1),
        ((0, 2), NodeKind.DYN_SLICE, [(0, 3)], 0.1),
        ((0, 1), NodeKind.ALL_TO_ALL, [(0, 0)], 0.7),
        ((0, 2), NodeKind.ALL_TO_ALL, [(0, 0)], 0.7),
        ((1, 6), NodeKind.LOCAL, [(0, 1), (0, 2)], 1.0),
        ((1, 0), NodeKind.ALL_REDUCE, [(1, 6)], 0.5),
    ])
    assert brute_force(g, cost, [(1, None)], PARTIAL) == pytest.approx(1.0 + 0.5 + 1.2)
    cost[4] = cost[5] = 0.5  # now two direct edges (1.0) beat the tree through 3 (1.2)
    assert brute_force(g, cost, [(1, None)], PARTIAL) == pytest.approx(1.0 + 0.5 + 1.0)
    assert brute_force(g, cost, [(1, frozenset({6}))], PARTIAL) == math.inf  # only partial allowed


# ---- synthetic e-graphs: brute force == exact <= greedy -------------------------------------------


@pytest.mark.parametrize("seed", range(120))
def test_synthetic_exact_matches_brute_force_and_bounds_greedy(seed):
    s = synthetic(seed)
    best = s.brute_force()
    assert math.isfinite(best)
    exact = s.exact()
    s.check(exact)
    assert close(exact.total_s, best), f"seed {seed}: exact {exact.total_s!r}, brute force {best!r}"
    greedy = s.greedy()
    s.check(greedy)
    assert greedy.total_s >= exact.total_s * (1 - REL), f"seed {seed}: greedy {greedy.total_s!r} < exact"
    lb = s.lower_bound()
    assert 0.0 <= lb <= best * (1 + REL), f"seed {seed}: lower bound {lb!r} > optimum {best!r}"
    split = s.split_bound()  # operands' layouts linked to their readers (extract/splitbound.py)
    assert 0.0 <= split <= best * (1 + REL), f"seed {seed}: split bound {split!r} > optimum {best!r}"
    agreed = s.agreed_bound(greedy.total_s)  # readers priced to agree on a source (extract/agreement.py)
    assert split * (1 - REL) <= agreed <= best * (1 + REL), f"seed {seed}: agreed {agreed!r} > optimum {best!r}"


@pytest.mark.parametrize("seed", [49, 101, 253, 255])
def test_resharding_shares_lift_the_agreed_bound_to_the_optimum(seed, monkeypatch):
    """A value read where it is made by one copy and resharded for another: the plan pays the
    whole path, 1/k shares half of it. Shares moved by the subgradient (extract/agreement.py
    _moving_shares) give the path to the copy that pays it; on these graphs the bound then
    reaches the optimum (it read 0.61-0.76 of it with 1/k shares)."""
    from shardsat.extract import agreement

    s = synthetic(seed)
    best = s.brute_force()
    target = s.greedy().total_s
    assert best * (1 - 1e-3) <= s.agreed_bound(target) <= best * (1 + REL)
    monkeypatch.setattr(agreement, "SHARE_CELLS", 0)  # no group's shares move
    assert s.agreed_bound(target) <= 0.8 * best


# Regression: the objective was scaled by a fixed 1e6, so HiGHS's absolute tolerances accepted
# plans tens of percent above the optimum at picosecond node costs; it is now normalised.
@pytest.mark.parametrize(("seed", "scale"), [(239, 1e-12), (269, 1e-12), (248, 1e-10)])
def test_synthetic_exact_at_small_cost_scale(seed, scale):
    """The optimum does not depend on the unit of cost: costs of tiny ops on fast devices are
    1e-12..1e-9 s."""
    s = synthetic(seed, scale)
    assert close(s.check(s.exact()), s.brute_force())


# Plans must be acyclic: a value cannot be computed from itself. Value e-classes only form cycles
# through user rewrites (a rule making f(g(x)) equal to x), which the exporter keeps.
CYCLIC = {
    # group 1 = op(input) for 5, or op(group 2) for 0.1; group 2 = op(group 1) for 0.1
    "across groups": (
        [(0, 0), (1, 0), (2, 0)],
        [((0, 0), NodeKind.PLACE, [], 0.0), ((1, 0), NodeKind.LOCAL, [(0, 0)], 5.0),
         ((1, 0), NodeKind.LOCAL, [(2, 0)], 0.1), ((2, 0), NodeKind.LOCAL, [(1, 0)], 0.1)],
        [(2, None)], 5.1),
    # group 1 at layout 0 = op(input) for 5, or op(itself at layout 1) for 0.1; 0 -> 1 costs 0.1
    "inside a group": (
        [(0, 0), (1, 0), (1, 1)],
        [((0, 0), NodeKind.PLACE, [], 0.0), ((1, 0), NodeKind.LOCAL, [(0, 0)], 5.0),
         ((1, 0), NodeKind.LOCAL, [(1, 1)], 0.1), ((1, 1), NodeKind.ALL_GATHER, [(1, 0)], 0.1)],
        [(1, None)], 5.0),
}


@pytest.mark.parametrize("case", sorted(CYCLIC))
def test_cyclic_egraph_brute_force_and_greedy(case):
    cls, nodes, roots, want = CYCLIC[case]
    s = Synthetic(*tiny_graph(cls, nodes), roots)
    assert s.brute_force() == pytest.approx(want)
    assert s.check(s.greedy()) == pytest.approx(want)


# Regression: the ILP let a local op read its own value through a rewritten term; productions now
# read only values earlier in the program's order.
@pytest.mark.parametrize("case", sorted(CYCLIC))
def test_cyclic_egraph_exact(case):
    cls, nodes, roots, want = CYCLIC[case]
    s = Synthetic(*tiny_graph(cls, nodes), roots)
    assert s.exact().total_s == pytest.approx(want)


# ---- real programs ------------------------------------------------------------------------------------


def normal(*shape: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.fold_in(jax.random.key(0), seed), shape)


def _shared(x, w):
    a = x @ w
    return (a * a).sum() + (a.T @ a).sum()


def _layernorm(x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)


# name -> (function, arguments); each at most 12 equations
PROGRAMS: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "mlp": (lambda x, w1, w2: jnp.tanh(x @ w1) @ w2, (normal(8, 16), normal(16, 16, seed=1), normal(16, 8, seed=2))),
    "matmul_sum": (lambda x, w: (x @ w).sum(0), (normal(8, 16), normal(16, 8, seed=1))),
    "elementwise": (lambda x, y: jnp.sin(x) * y + x, (normal(8, 16), normal(8, 16, seed=1))),
    "residual": (lambda x, w: x + jax.nn.relu(x @ w), (normal(8, 16), normal(16, 16, seed=1))),
    "transpose_dot": (lambda x, y: x.T @ y, (normal(8, 16), normal(8, 16, seed=1))),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), (normal(8, 16),)),
    "two_outputs": (lambda x, w: (x @ w, x.sum(1)), (normal(8, 16), normal(16, 8, seed=1))),
    "shared": (_shared, (normal(8, 16), normal(16, 8, seed=1))),
    "bias": (lambda x, w, b: x @ w + b, (normal(8, 16), normal(16, 8, seed=1), normal(8, seed=2))),
    "layernorm": (_layernorm, (normal(8, 16),)),
    "gram": (lambda x, y: (x @ x.T) @ y, (normal(8, 16), normal(8, 16, seed=1))),
    "loss": (lambda x, w: jnp.mean((x @ w - 1.0) ** 2), (normal(8, 16), normal(16, 8, seed=1))),
    "pinned_out": (lambda x, w: jnp.tanh(x @ w), (normal(8, 16), normal(16, 8, seed=1))),
    "pinned_in": (lambda x, w: jnp.tanh(x @ w), (normal(8, 16), normal(16, 8, seed=1))),
}
PINS: dict[str, dict[str, Any]] = {
    "pinned_out": {"out_shardings": P(None, "model")},
    "pinned_in": {"in_shardings": (P(None, "model"), None)},
}
# compute-heavy relative to communication, with latency: sharded plans win and ties are rare
BALANCED = shardsat.DeviceProfile(flops_per_s=1e9, hbm_bytes_per_s=1e9, link_bytes_per_s=1e9, latency_s=1e-7,
                                  name="balanced")
PROFILES = {"h100": "h100", "balanced": BALANCED}
# (program, mesh, profile): every program on 1x4; on 2x2 the e-graphs are ~5x larger and HiGHS
# takes seconds to minutes on some with the balanced profile (mlp 8 s, layernorm > 45 s), so those
# are left out to keep this file fast
FAST_ON_2X2_BALANCED = ("matmul_sum", "elementwise", "transpose_dot", "two_outputs", "bias", "loss", "pinned_out",
                        "pinned_in")
CASES = ([(p, "1x4", prof) for prof in PROFILES for p in PROGRAMS]
         + [(p, "2x2", "h100") for p in PROGRAMS if p != "layernorm"]
         + [(p, "2x2", "balanced") for p in FAST_ON_2X2_BALANCED])
BRUTE_FORCE_LIMIT = 25_000  # production combinations


MESHES: dict[str, jax.sharding.Mesh] = {}


def mesh_of(name: str) -> jax.sharding.Mesh:
    if name not in MESHES:
        shape = tuple(int(x) for x in name.split("x"))
        MESHES[name] = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[: math.prod(shape)])
    return MESHES[name]


@dataclass
class Captured:
    problems: list[Problem]
    ilps: list[Any]


@contextlib.contextmanager
def capturing() -> Iterator[Captured]:
    """Records the extraction Problem of each planning, and the exact solver's own result."""
    import shardsat.extract.search as search

    cap = Captured([], [])
    best_plan, exact = api.best_plan, search.solve_exact

    def record_problem(p, *a, **k):
        cap.problems.append(p)
        return best_plan(p, *a, **k)

    def record_ilp(*a, **k):
        res = exact(*a, **k)
        cap.ilps.append(res)
        return res

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "best_plan", record_problem)
        mp.setattr(search, "solve_exact", record_ilp)
        yield cap


def partial_layouts(p: Problem) -> set[int]:
    return {i for i, lay in enumerate(p.spaces.layouts.layouts) if lay.partial}


def same_extraction(a: Extraction, b: Extraction) -> bool:
    key = lambda ex: ({grp: (ch.node, tuple((s.src, s.dst, int(s.kind), s.axes) for s in ch.steps))  # noqa: E731
                       for grp, ch in ex.choices.items()}, list(ex.root_layouts))
    return key(a) == key(b)


def renumbered(ex: Extraction, node_ids: np.ndarray) -> Extraction:
    """An extraction of a graph exported without resharding e-nodes, in the node ids of the
    full export (`node_ids[n]`: the full id of node n)."""
    choices = {grp: dataclasses.replace(ch, node=int(node_ids[ch.node])) for grp, ch in ex.choices.items()}
    return dataclasses.replace(ex, choices=choices)


def with_extraction(plan: Plan, ex: Extraction) -> Plan:
    """The same planning problem lowered with another extraction (the ILP's own plan)."""
    assert len(ex.root_layouts) == len(plan.program.outputs)  # no literal outputs, no scans
    costed = cost_plan(plan.program, plan.graph, plan.spaces, plan.tables, ex, model=plan.model,
                       arg_pins=plan.arg_pins, ties=plan.ties)
    return Plan(fn=plan.fn, program=plan.program, mesh=plan.mesh, spaces=plan.spaces, tables=plan.tables,
                graph=plan.graph, costed=costed, profile=plan.profile, report=plan.report,
                arg_pins=plan.arg_pins, ties=plan.ties, state_argnums=list(plan.state_argnums))


def compare_extractors(fn: Any, mesh: jax.sharding.Mesh, args: tuple[Any, ...], brute: bool = True,
                       **kw: Any) -> str:
    """Plan with extraction="greedy" and "exact"; check both plans against the e-graph, the
    ILP's optimum, brute force (when `brute` and small enough) and the unsharded function.
    Returns what was compared, for hypothesis statistics."""
    with capturing() as captured:
        greedy = shardsat.saturate_and_extract(fn, mesh, *args, extraction="greedy", **kw)
        exact = shardsat.saturate_and_extract(fn, mesh, *args, extraction="exact", **kw)
    assert len(captured.problems) == 2
    pg, p = captured.problems
    # the same e-graph and costs both times (the planning is deterministic); the greedy search
    # gets it without the resharding e-nodes (it prices resharding from the layout graph)
    productions = np.asarray([not NodeKind(int(k)).is_reshard for k in p.graph.node_kind], dtype=bool)
    assert pg.graph.size == p.graph.size and pg.graph.unbuilt_nodes == int((~productions).sum())
    assert np.array_equal(pg.node_cost, p.node_cost[productions])
    greedy_ex = renumbered(greedy.extraction, np.flatnonzero(productions))  # in the exact graph's ids
    assert not p.ties
    assert bool(p.place_pins) == (kw.get("in_shardings") is not None)
    for plan in (greedy, exact):
        for grp, lays in p.place_pins.items():
            assert grp not in plan.extraction.choices or plan.extraction.choices[grp].layout in lays
    partial = partial_layouts(p)
    # the extractions are plans of the e-graph, priced as they say, and predicted as priced
    for plan, ex in ((greedy, greedy_ex), (exact, exact.extraction)):
        assert close(plan_cost(p.graph, p.node_cost, ex, p.roots, partial), ex.total_s)
        assert close(plan.cost.total_s, ex.total_s)
    assert exact.extraction.total_s <= greedy.extraction.total_s * (1 + 1e-12)
    compared = "no optimum"
    ilp = captured.ilps[0] if captured.ilps else None
    if ilp is not None and ilp.extraction is not None:
        assert close(plan_cost(p.graph, p.node_cost, ilp.extraction, p.roots, partial), ilp.extraction.total_s)
    if ilp is not None and ilp.status == "optimal":
        # greedy is never below the optimum; "exact" returns the optimum (the ILP seeks plans
        # cheaper than the greedy one: none found, the greedy plan is the optimum)
        opt = ilp.extraction.total_s if ilp.extraction is not None else greedy.extraction.total_s
        assert greedy.extraction.total_s >= opt * (1 - REL)
        # the greedy plan's gap is against a lower bound of every plan: below the optimum
        lb = greedy.extraction.lower_bound_s
        assert lb is not None and lb <= opt * (1 + REL) and greedy.report.lower_bound_s == lb
        assert abs(greedy.report.gap - max(0.0, 1 - lb / greedy.extraction.total_s)) <= 1e-9
        assert close(exact.extraction.total_s, opt)
        compared = "exact vs greedy"
        bf = BruteForce(p.graph, p.node_cost, p.roots, partial, p.place_pins)
        if brute and bf.count() <= BRUTE_FORCE_LIMIT:
            best = bf.solve()
            assert close(best, opt), f"brute force {best!r}, exact {opt!r}"
            compared = "exact vs greedy vs brute force"
    # every plan runs and computes what the unsharded function does
    check_plan(greedy, *args)
    if not same_extraction(exact.extraction, greedy_ex):
        check_plan(exact, *args)
    if ilp is not None and ilp.extraction is not None and not same_extraction(ilp.extraction, exact.extraction):
        check_plan(with_extraction(exact, ilp.extraction), *args)
    return compared


@pytest.mark.parametrize(("name", "mesh_name", "profile"), CASES)
def test_program_exact_vs_greedy_vs_brute_force(name, mesh_name, profile):
    fn, args = PROGRAMS[name]
    # the ILP's own time: the catalogue's programs finish in seconds, but not on a loaded machine
    compared = compare_extractors(fn, mesh_of(mesh_name), args, profile=PROFILES[profile],
                                  limits=shardsat.Limits(exact_seconds=60), **PINS.get(name, {}))
    # the catalogue is chosen so that the ILP finishes; brute force is feasible on 1x4 (~all)
    assert compared != "no optimum"


@pytest.mark.parametrize("mesh_name", ["1x4", "2x2"])
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_program_exact_vs_greedy(mesh_name, data):
    """Random programs of test_equivalence's generator (at most 5 ops), both extractions; the ILP
    gets a short time limit (plans it cannot prove optimal are still checked for validity)."""
    prog = data.draw(random_programs(max_ops=5), label="program")
    profile = data.draw(st.sampled_from(sorted(PROFILES)), label="profile")
    fn = prog.function()
    args = prog.example_args()
    event(compare_extractors(fn, mesh_of(mesh_name), args, profile=PROFILES[profile],
                             limits=shardsat.Limits(seconds=10)))


# ---- determinism --------------------------------------------------------------------------------

# A two-layer MLP with bias, residual and a loss, planned on 2x2 with shapes large enough that
# the plan shards weights and has collectives: a plan that depended on hash or e-graph order
# would show here.
DETERMINISM_SOURCE = """
import jax, jax.numpy as jnp

def step(x, w1, b1, w2):
    h = jnp.tanh(x @ w1 + b1)
    y = h @ w2 + x
    return y, (y * y).mean()

def example_args():
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct((256, 1024), f32), jax.ShapeDtypeStruct((1024, 4096), f32),
            jax.ShapeDtypeStruct((4096,), f32), jax.ShapeDtypeStruct((4096, 1024), f32))
"""
PLAN_SUMMARY = """
def summary(plan):
    specs = lambda tree: [None if s is None else [list(e) if isinstance(e, tuple) else e for e in s.spec]
                          for s in jax.tree.leaves(tree)]
    return {"in": specs(plan.in_shardings), "out": specs(plan.out_shardings), "cost": plan.cost.total_s,
            "collectives": [[c.kind, list(c.axes), c.value, c.src, c.dst] for c in plan.cost.collectives]}
"""


def _namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {}
    exec(DETERMINISM_SOURCE + PLAN_SUMMARY, ns)
    return ns


@pytest.mark.parametrize(("name", "mesh_name", "profile", "extraction"), [
    ("mlp_step", "2x2", "h100", "greedy"),
    ("residual", "2x2", "h100", "exact"),  # the ILP beat greedy here when written
    ("two_outputs", "1x4", "balanced", "exact"),  # and here
])
def test_same_plan_twice_in_process(name, mesh_name, profile, extraction):
    ns = _namespace()
    fn, args = (ns["step"], ns["example_args"]()) if name == "mlp_step" else PROGRAMS[name]
    mesh = mesh_of(mesh_name)
    a = shardsat.saturate_and_extract(fn, mesh, *args, profile=PROFILES[profile], extraction=extraction)
    b = shardsat.saturate_and_extract(fn, mesh, *args, profile=PROFILES[profile], extraction=extraction)
    assert a.in_shardings == b.in_shardings
    assert a.out_shardings == b.out_shardings
    assert a.cost.collectives == b.cost.collectives
    assert a.cost.total_s == b.cost.total_s
    assert a.extraction.total_s == b.extraction.total_s
    assert same_extraction(a.extraction, b.extraction)
    assert ns["summary"](a) == ns["summary"](b)
    if name == "mlp_step":
        assert a.cost.collectives  # a plan with something to get wrong


def test_same_plan_in_a_fresh_process():
    """Another interpreter (another string hash seed) plans the same program identically."""
    script = DETERMINISM_SOURCE + PLAN_SUMMARY + """
import json
import shardsat
mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
plan = shardsat.saturate_and_extract(step, mesh, *example_args(), profile="h100", extraction="greedy")
print("SUMMARY " + json.dumps(summary(plan)))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", RAYON_NUM_THREADS="1",
               PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("SUMMARY "))
    theirs = json.loads(line[len("SUMMARY "):])
    ns = _namespace()
    plan = shardsat.saturate_and_extract(ns["step"], mesh_of("2x2"), *ns["example_args"](), profile="h100",
                                         extraction="greedy")
    mine = json.loads(json.dumps(ns["summary"](plan)))
    assert theirs["in"] == mine["in"]
    assert theirs["out"] == mine["out"]
    assert theirs["collectives"] == mine["collectives"]
    assert theirs["cost"] == mine["cost"]


def test_the_solvers_own_prints_do_not_reach_the_console(monkeypatch, capfd):
    """HiGHS prints some lines with printf whatever its log options (a helper's robustness hunt
    saw `HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();` on pinned
    plans): file descriptor 1 is silenced while it solves; what Python printed before stays."""
    real = exact.milp

    def noisy(*args, **kwargs):
        os.write(1, b"solver noise\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(exact, "milp", noisy)
    print("before the plan")
    plan = shardsat.saturate_and_extract(lambda w, x: jnp.tanh(x @ w), jax.make_mesh((2, 4), ("data", "model")),
                                         jnp.ones((16, 16)), jnp.ones((32, 16)), extraction="exact")
    assert plan.report.exact_status is not None  # the solver ran
    out = capfd.readouterr().out
    assert "before the plan" in out and "solver noise" not in out
    os.write(1, b"after\n")
    assert "after" in capfd.readouterr().out  # the descriptor is restored
