"""DAG-aware greedy extraction with exact local improvement.

The e-graph groups classes by value: `At(v, l)` for the layouts l of v. A plan produces each used
value once (a placed input, or one local strategy of its equation) and reaches every layout its
consumers need through the cheapest resharding tree from the produced layout.

1. Bottom-up estimate and top-down choice make a first plan (extract/start.py): an operand's
   estimate is shared among its value's consumers, so values used many times (residual streams,
   weights read forward and backward) are not paid once per use as tree-cost extraction would.
2. Improvement: sweeps of exact moves on the true DAG cost until none improves: single values
   (moves_value.py), chains by dynamic programming (moves_chain.py), loop-carried state
   (moves_tie.py), whole tensor spaces at a local optimum (moves_space.py); last, the plan the
   search returns, regions propagated forward from a resharded value (moves_region.py).

Resharding trees are unions of shortest paths in the per-space layout graph (all-pairs shortest
paths computed once per (shape, dtype)), a close upper bound of the Steiner tree.

`Extractor` is the facade over one read-only `SearchGraph` (extract/searchgraph.py): each run
builds a `PlanState` (extract/planstate.py) that the moves change and the `Extraction` carries.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from ..egraph.export import ExportedGraph, NodeKind
from ..egraph.layout import SpaceTable
from ..rules.reshard import ReshardEdge
from .bound import value_bound
from .cost import CostModel
from .moves_chain import ChainSeen, chains, relabel_chain
from .moves_region import MAX_REGION_ROUNDS, region_moves
from .moves_space import MAX_SPACE_ROUNDS, SpaceSeen, space_moves
from .moves_tie import move_tie
from .moves_value import alternatives, improve
from .planstate import PlanState
from .result import Extraction, GroupChoice, ReshardStep
from .searchgraph import EPS, SearchGraph, Tree
from .spacepaths import SpacePaths, space_paths
from .start import choose_roots, choose_top_down, estimates

Roots = Sequence[tuple[int, frozenset[int] | None]]


class Extractor:
    """The local search over one graph and one costing of it. Copies made by `with_costs` share
    the graph's structure and cache and the `work` count; each has its own costs and its own
    memory of tensor-space moves that found nothing and of chain moves' proposals (their outcome
    depends on the costs)."""

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
        graph = SearchGraph.build(g, node_cost, value_space, spaces, edges, model, describe, combinable, weight)
        # moves tried by every search on this graph (copies share it): a budget measured in
        # work, not seconds, keeps plans the same on a loaded machine
        self._attach(graph, [0])

    def _attach(self, graph: SearchGraph, work: list[int]) -> None:
        """Set the facade's fields; shared with a `with_costs` copy: the graph's structure and
        cache (through `graph`) and the `work` count."""
        self.graph = graph
        self.work = work
        self._space_seen: SpaceSeen = {}
        self._chain_seen: ChainSeen = {}

    def with_costs(self, node_cost: np.ndarray, weight: np.ndarray) -> Extractor:
        """This extractor over the same graph with other node costs and value weights (both
        finite where the originals are): the structure and resharding paths are reused."""
        other = Extractor.__new__(Extractor)
        other._attach(self.graph.with_costs(node_cost, weight), self.work)
        return other

    def lower_bound(self, roots: Roots) -> float:
        """Seconds no plan can beat (bound.value_bound)."""
        return value_bound(self.graph, roots)

    def steiner(self, grp: int, src_layout: int, targets: frozenset[int]) -> Tree:
        """Cost and edges (row pairs) of the union of cheapest paths src -> each target."""
        return self.graph.steiner(grp, src_layout, targets)

    # -- extraction ------------------------------------------------------------------------------
    def run(
        self,
        roots: Roots,
        deadline: float,
        max_sweeps: int = 500,
        place_pins: dict[int, frozenset[int]] | None = None,
        ties: Sequence[tuple[int, int]] = (),
        seed: dict[int, int] | None = None,
        explain: bool = True,
        chains: bool = True,
        whole: bool = False,
    ) -> Extraction:
        """roots: (group, allowed layouts or None for any non-partial) per output.
        place_pins: group -> the layouts an input may be placed in.
        ties: (input group, root index): loop-carried state, placed in the layout it is returned in.
        seed: input group -> the layout the first plan places it in (released for the
          improvement phase): the search is local, so callers try a few global starting points
          (data parallel, fully sharded state) besides the estimate.
        whole: the first plan computes every value whole where it can (whole_productions), a
          start no sequence of local moves from split plans reaches."""
        t0 = time.perf_counter()
        sg = self.graph
        g = sg.g
        prod, place_of = self._pin(place_pins, ties)
        released: dict[int, list[int]] = {}
        if whole:
            for h, nodes in sg.whole_productions().items():
                if h not in place_of and (place_pins is None or h not in place_pins):
                    released[h] = prod[h]
                    prod[h] = nodes
        for h, lay in (seed or {}).items():
            nodes = [n for n in prod[h]
                     if NodeKind(int(g.node_kind[n])) == NodeKind.PLACE and int(g.node_b[n]) == lay]
            if nodes:
                released[h] = prod[h]
                prod[h] = nodes
        roots_of: dict[int, list[int]] = {}
        for h, r in ties:
            roots_of.setdefault(h, []).append(r)
        st = PlanState(tuple(roots), {}, [Counter() for _ in range(g.num_groups)], prod, place_of, [], roots_of)
        self.work[0] += 2 * len(sg.order)  # the estimate and the top-down choice
        est, uses, node_v = estimates(sg, st)
        choose_roots(sg, st, est, {r: h for h, r in ties}, seed)
        choose_top_down(sg, st, est, uses, node_v)
        for h, nodes in released.items():
            if h not in place_of:
                prod[h] = nodes
        return self._finish(st, deadline, max_sweeps, explain, chains, t0)

    def _pin(self, place_pins: dict[int, frozenset[int]] | None, ties: Sequence[tuple[int, int]]
             ) -> tuple[list[list[int]], dict[int, dict[int, int]]]:
        """Productions narrowed to the pinned placements, and the place nodes of tied inputs by
        layout: every layout its pins allow (a seed picks the first plan's; the search may move it).
        Always the graph's own lists narrowed: not a plan's, which its pins and ties narrowed
        (tests/test_invariant.py::test_release_starts_from_every_placement)."""
        g = self.graph.g
        # production lists are rebound, never mutated, so copying the outer list is enough
        prod = list(self.graph.prod)
        for grp, lays in (place_pins or {}).items():
            prod[grp] = [
                n for n in prod[grp]
                if NodeKind(int(g.node_kind[n])) != NodeKind.PLACE or int(g.node_b[n]) in lays
            ]
        place_of: dict[int, dict[int, int]] = {}
        for h, _ in ties:
            place_of[h] = {int(g.node_b[n]): n for n in prod[h] if NodeKind(int(g.node_kind[n])) == NodeKind.PLACE}
        return prod, place_of

    def release(self, ex: Extraction, roots: Roots, deadline: float,
                place_pins: dict[int, frozenset[int]] | None, ties: Sequence[tuple[int, int]],
                chains: bool = True) -> Extraction:
        """Continue a plan found under tighter pins (a layout family's) with only `place_pins`:
        its inputs may move from there."""
        t0 = time.perf_counter()
        old = ex.state  # a plan found by run(), resume() or release()
        prod, place_of = self._pin(place_pins, ties)
        for h, rs in old.roots_of.items():  # a tied input stays placed as its roots are, until moved
            prod[h] = [place_of[h][old.root_layouts[rs[0]]]]
        st = PlanState(tuple(roots), dict(old.choice), [c.copy() for c in old.demand], prod, place_of,
                       list(old.root_layouts), old.roots_of)
        out = self._finish(st, deadline, 500, False, chains, t0)
        out.sweeps += ex.sweeps
        return out

    def resume(self, ex: Extraction, roots: Roots, deadline: float,
               max_sweeps: int = 500, explain: bool = True, chains: bool = True) -> Extraction:
        """Continue improving a plan this extractor found (same roots and ties), e.g. with the
        chain moves a cheap first run left out."""
        t0 = time.perf_counter()
        st = ex.state.copy()
        st.roots = tuple(roots)
        out = self._finish(st, deadline, max_sweeps, explain, chains, t0)
        out.sweeps += ex.sweeps
        return out

    def regions(self, ex: Extraction, roots: Roots, deadline: float) -> Extraction | None:
        """The plan after region moves (extract/moves_region.py) and the sweeps they open, a few
        rounds; None where no region move lowers its cost."""
        t0 = time.perf_counter()
        st = ex.state.copy()
        st.roots = tuple(roots)
        out = None
        for _ in range(MAX_REGION_ROUNDS):
            if time.perf_counter() >= deadline or not region_moves(self.graph, st, self.work, deadline):
                break
            out = self._finish(st, deadline, 500, False, True, t0)  # the result holds `st`: go on from it
        if out is not None:
            out.sweeps += ex.sweeps
        return out

    def _finish(self, st: PlanState, deadline: float, max_sweeps: int, explain: bool, chains: bool,
                t0: float) -> Extraction:
        """3. improvement, 4. the result; with `explain`, for each value the cheapest plan that
        differs in its layout ("why this")."""
        sweeps = _sweep(self.graph, st, self.work, (self._space_seen, self._chain_seen), deadline, max_sweeps,
                        chains)
        # the next run rebinds (never mutates) the state's lists: the result needs no copy
        alts = self._alternatives(st) if explain else {}
        return _extraction(self.graph, st, alts, sweeps, t0)

    def _alternatives(self, state: PlanState) -> dict[int, tuple[int, float]]:
        work = state.copy()
        return alternatives(self.graph, work)

    def forget_search(self, everything: bool = True) -> None:
        """Drop what only the search reads (a plan keeps its extractor for explain()): the space
        moves' memory, and with `everything` the chain moves' proposals too (a nested search,
        a family's pinned completion, leaves them to the search it is part of: they hold for
        any plan on these costs)."""
        self._space_seen.clear()
        if everything:
            self._chain_seen.clear()

    def explain(self, ex: Extraction) -> None:
        """Fill in the "why this" alternatives of a plan this extractor found."""
        if ex.state is not None and not ex.alternatives:
            ex.alternatives = self._alternatives(ex.state)


def _sweep(sg: SearchGraph, st: PlanState, work: list[int], seen: tuple[SpaceSeen, ChainSeen], deadline: float,
           max_sweeps: int, with_chains: bool) -> int:
    """Exact single-value moves, then exact chain re-labelling (Viterbi) and tie moves, on the
    values near the last sweep's changes; tensor-space moves at a local optimum. Returns the
    number of sweeps. `seen`: the extractor's memories of space and chain moves."""
    choice, roots = st.choice, st.roots
    space_seen, chain_seen = seen
    sweeps = 0
    space_rounds = 0
    chain_list = chains(sg, st) if with_chains else []
    dirty = set(choice)
    while dirty and sweeps < max_sweeps and time.perf_counter() < deadline:
        sweeps += 1
        changed: set[int] = set()
        for grp in sg.order:
            if grp not in dirty or grp not in choice or len(st.prod[grp]) < 2:
                continue
            work[0] += 1
            if improve(sg, st, grp):
                changed.add(grp)
        for chain in chain_list:
            if time.perf_counter() >= deadline:
                break
            if dirty.isdisjoint(chain):
                continue
            work[0] += len(chain)
            if relabel_chain(sg, st, chain, chain_seen):
                changed.update(chain)
        for h, rs in st.roots_of.items():
            outs = {roots[r][0] for r in rs}
            if (h in dirty or not dirty.isdisjoint(outs)) and move_tie(sg, st, h, rs):
                changed.update({h} | outs)
        if not changed and space_rounds < MAX_SPACE_ROUNDS and time.perf_counter() < deadline:
            # a local optimum: try moving whole tensor spaces (a residual stream) at once
            space_rounds += 1
            changed = space_moves(sg, st, space_seen, work, deadline, every_layout=with_chains)
        dirty = set()
        for grp in changed:
            dirty.add(grp)
            if grp in choice:  # a tied input the program never reads has no production to follow
                dirty.update(sg.demands(choice[grp]))
            dirty.update(sg.parents[grp])
    return sweeps


def _extraction(sg: SearchGraph, st: PlanState, alts: dict[int, tuple[int, float]], sweeps: int,
                t0: float) -> Extraction:
    """The plan as an `Extraction`: per used value its production and resharding steps."""
    g = sg.g
    cls_layout = g.class_layout
    choices: dict[int, GroupChoice] = {}
    total = 0.0
    for grp, n in st.choice.items():
        lay = int(cls_layout[g.node_class[n]])
        targets = frozenset(st.demand[grp])
        st_cost, rows = sg.steiner(grp, lay, targets)
        sp = sg.paths[sg.group_key[grp]]
        steps = []
        for u, v in rows:
            e, _ = sp.edge[(u, v)]
            cc = sg.model.collective(e.kind, e.axes, sg.group_space[grp], e.src, e.dst, sg.group_key[grp][1])
            steps.append(ReshardStep(e.kind, e.src, e.dst, e.axes, e.dim, e.dim2, cc.seconds, cc.moved_bytes,
                                     cc.buffer_bytes))
        steps.sort(key=lambda s: (sp.dist[sp.index[lay], sp.index[s.src]], s.src, s.dst))
        choices[grp] = GroupChoice(grp, n, lay, tuple(sorted(targets)), steps, float(sg.cost[n]),
                                   weight=float(sg.weight[grp]))
        total += float(sg.cost[n]) + sg.weight[grp] * st_cost
    return Extraction(
        choices=choices,
        root_layouts=list(st.root_layouts),
        total_s=total,
        method="greedy-dag",
        seconds=time.perf_counter() - t0,
        sweeps=sweeps,
        alternatives=alts,
        state=st,
    )


__all__ = ["EPS", "Extractor", "SpacePaths", "space_paths"]
