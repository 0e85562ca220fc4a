"""The plan a search is improving: what the moves read and change, and what a continued search
(`Extractor.resume`, `Extractor.release`, `explain`) starts from."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .searchgraph import SearchGraph

Roots = tuple[tuple[int, frozenset[int] | None], ...]  # per output: group, allowed layouts (None: any)


@dataclass
class PlanState:
    """One production per used value and the layouts its consumers demand of it.

    `prod` and `place_of` are this run's productions (narrowed by pins and ties; a tied input's
    list is its one place node); their inner lists are rebound, never mutated, so copying the
    outer containers is enough. `roots_of` is never changed once built and is shared by copies."""

    roots: Roots
    choice: dict[int, int]  # used group -> production node
    demand: list[Counter[int]]  # group -> layout -> how many consumers (and outputs) read it so
    prod: list[list[int]]  # group -> the productions the search may choose
    place_of: dict[int, dict[int, int]]  # tied input group -> layout -> its place node
    root_layouts: list[int]  # per output: the layout it is returned in
    roots_of: dict[int, list[int]]  # tied input group -> the outputs (root indices) tied to it

    def copy(self) -> PlanState:
        """A state the moves may change without touching this one."""
        return PlanState(self.roots, dict(self.choice), [d.copy() for d in self.demand], list(self.prod),
                         dict(self.place_of), list(self.root_layouts), self.roots_of)

    def set(self, sg: SearchGraph, groups: list[int], nodes: list[int]) -> None:
        """Produce each group by its node instead, moving the demands on their operands."""
        kid_gl = sg.kid_gl
        choice, demand = self.choice, self.demand
        # dict's own get and pop: Counter's missing-key and delete hooks are Python calls, and the
        # keys' insertion order (which frozenset(demand) iterates in) comes out the same
        for grp, n in zip(groups, nodes, strict=True):
            for h, lay in kid_gl[choice[grp]]:
                d = demand[h]
                v = d.get(lay, 0) - 1
                if v <= 0:
                    d.pop(lay, None)
                else:
                    d[lay] = v
            choice[grp] = n
            for h, lay in kid_gl[n]:
                d = demand[h]
                d[lay] = d.get(lay, 0) + 1

    def cost_of(self, sg: SearchGraph, groups: set[int]) -> float:
        """The exact seconds of these values in the plan (inf for one nothing reads)."""
        total = 0.0
        choice, demand, own = self.choice, self.demand, sg.own
        for grp in groups:
            n = choice.get(grp)
            if n is not None:
                t = frozenset(demand[grp])
                total += own(grp, n, t) if t else math.inf
        return total

    def retie(self, h: int, rs: list[int], lay: int, node: int) -> None:
        """Place tied input h by `node` in layout `lay` and return its tied outputs `rs` there."""
        demand, root_layouts = self.demand, self.root_layouts
        for r in rs:
            o = self.roots[r][0]
            old = root_layouts[r]
            demand[o][old] -= 1
            if demand[o][old] <= 0:
                del demand[o][old]
            demand[o][lay] += 1
            root_layouts[r] = lay
        self.prod[h] = [node]
        if h in self.choice:
            self.choice[h] = node
