"""The split bound: a lower bound on every plan's cost that links each operand's layout to its
reader, prices loop-carried state as returned, and shares a placed state input's resharding
among its readers the way the plan in hand does.

A value in layout l costs, in a dynamic program over the value groups in topological order,

    B_g(l) = min over productions n of g of  cost(n) + w_g dist(layout(n), l)
                                             + sum over operands (h, l_h) of n of B_h(l_h) / k_h

where k_h counts the places a plan can read h: per parent group the most times one of its
productions reads h, plus the root entries of h. In any plan each group's share of the sum is
then at most 1 (by induction from the roots down: a group's share is the sum of its readers'
shares times their reads over k_h), its production is at least the cheapest one, and its
resharding tree at least the longest of the paths it serves: the bound is at most the plan's
cost. Starting every B at 0 keeps that true after any number of passes (each pass is a
monotone map and the plan's own values are a fixed point above 0), so cycles through user
rewrites only cost precision, not validity.

Two refinements keep it valid and make it see what training steps pay:
- *Ties* (loop-carried state: the input is placed in the layout it is returned in). A
  multiplier lam(l) >= 0 per tied input adds lam(l) to the input placed in l and takes lam(l)
  from its root returned in l. A plan that keeps the tie pays both or neither, so every lam
  gives a bound (a Lagrangian relaxation of the tie), and the bound's costs stay >= 0. Without
  it the bound places state where its readers like it and returns it where its update is
  cheapest, for free: a ZeRO plan's gathers look avoidable.
- *Shares per source layout.* The 1/k_h above is one way to split h's cost among the places
  that read it; any split whose shares sum to at most 1 per source layout (a cost and a
  resharding share) is as valid. For a tied input, once lam prices its layouts, the plan's own
  readers say a better one: a source layout's cost goes to the reader that reads it (nearest),
  and its resharding to the reader farthest from it (the tree is at least its longest path).
  It is used where, at the plan's reads, it is worth more than 1/k_h.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..egraph.export import NodeKind
from .result import Extraction
from .searchgraph import SearchGraph

if TYPE_CHECKING:
    from .greedy import Extractor

Roots = list[tuple[int, frozenset[int] | None]]
CopyValues = dict[int, dict[int, np.ndarray]]  # group -> copy -> the value of one read per layout
Prices = dict[int, dict[int, np.ndarray]]  # group -> copy -> price per source layout
ROUNDS = 3  # multiplier vectors tried when there is loop-carried state
_PLACE = int(NodeKind.PLACE)


@dataclass
class Reads:
    """Who reads each group: k_h, and per (reader group, group) the most reads by one production."""

    k: list[int]
    pair: dict[tuple[int, int], int]
    readers: dict[int, list[int]]

    @classmethod
    def of(cls, sg: SearchGraph, roots: Roots) -> Reads:
        k = [0] * sg.g.num_groups
        pair: dict[tuple[int, int], int] = {}
        for p, prods in enumerate(sg.prod_any):
            most: Counter[int] = Counter()
            for n in prods:
                for h, c in Counter(h for h, _ in sg.kid_gl[n]).items():
                    most[h] = max(most[h], c)
            for h, c in most.items():
                k[h] += c
                pair[(p, h)] = c
        for grp, _ in roots:
            k[grp] += 1
        readers: dict[int, list[int]] = {}
        for p, h in pair:
            readers.setdefault(h, []).append(p)
        return cls(k, pair, readers)


@dataclass
class _Shares:
    """Per-source-layout shares of one group among its copies: readers (group ids) and roots
    (encoded -1 - root index); gamma splits its production's cost, beta its resharding."""

    copies: list[int]
    reads: list[int]  # per copy: the most reads by one production (1 for a root)
    gamma: np.ndarray  # [copies, layouts]
    beta: np.ndarray
    value: dict[int, np.ndarray] = field(default_factory=dict)  # copy -> its share per layout


def split_bound(ex: Extractor, roots: Roots, passes: int = 2, ties: Sequence[tuple[int, int]] = (),
                pins: dict[int, frozenset[int]] | None = None, plan: Extraction | None = None,
                rounds: int = ROUNDS) -> float:
    """The split bound (0.0 where a group's space is unknown), every plan's placements within
    `pins`; with `ties` (input group, root index), the best of `rounds` multiplier vectors, each
    round's set from the last (_next_multipliers), and from the second round on the plan's
    shares for the tied inputs where they are worth more (_plan_shares)."""
    return split_rounds(ex.graph, roots, ties, pins or {}, plan, rounds, passes).bound


@dataclass
class SplitRounds:
    """The best round of split_bound: its bound and the prices it was found at."""

    bound: float
    reads: Reads
    tied: dict[int, int]
    lam: dict[int, np.ndarray]
    shares: dict[int, _Shares]
    passes: int


def split_rounds(sg: SearchGraph, roots: Roots, ties: Sequence[tuple[int, int]], pins: dict[int, frozenset[int]],
                 plan: Extraction | None, rounds: int = ROUNDS, passes: int = 2) -> SplitRounds:
    """split_bound's rounds, keeping the prices of the best one."""
    reads = Reads.of(sg, roots)
    tied = _tied_inputs(sg, roots, ties)
    if all(len(a) == len(b) for a, b in zip(sg.prod, sg.prod_any, strict=True)):
        passes = 1  # no production reads a later group: a second pass changes nothing
    lam: dict[int, np.ndarray] = {}
    shares: dict[int, _Shares] = {}
    best = SplitRounds(0.0, reads, tied, {}, {}, passes)
    for _ in range(max(1, rounds if tied else 1)):
        value, cv = split_values(sg, reads, passes, pins, lam, shares)
        total, root_share, _ = split_total(sg, roots, reads.k, value, tied, lam, cv)
        if total > best.bound:
            best = SplitRounds(total, reads, tied, lam, shares, passes)
        lam = _next_multipliers(sg, tied, root_share, plan)
        shares = _plan_shares(sg, roots, reads, tied, lam, pins, plan) if plan is not None else {}
    return best


def _tied_inputs(sg: SearchGraph, roots: Roots, ties: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Root index -> tied input group, for inputs only placed (a placement's layout is the one
    the tie fixes) in the root's tensor space; one root per input, its multiplier taken once."""
    kinds = sg.g.node_kind
    out: dict[int, int] = {}
    for h, r in ties:
        grp = roots[r][0]
        placed = bool(sg.prod_any[h]) and all(int(kinds[n]) == _PLACE for n in sg.prod_any[h])
        same_space = sg.group_key[h] == sg.group_key[grp] and sg.group_key[h] in sg.paths
        if placed and same_space and h not in out.values() and r not in out:
            out[r] = h
    return out


def split_values(sg: SearchGraph, reads: Reads, passes: int, pins: dict[int, frozenset[int]],
                 lam: dict[int, np.ndarray], shares: dict[int, _Shares]) -> tuple[list[np.ndarray | None], CopyValues]:
    """B_g per group (module docstring) and the copies' values of the groups in `shares`."""
    dp = SplitDP(sg, reads, pins, lam, shares)
    for _ in range(passes):
        for grp in sg.order:
            dp.group(grp)
    return dp.value, dp.cval


@dataclass
class SplitDP:
    """The dynamic program's values, one group at a time: B_g, placements outside a group's pins
    left out, lam[g] added to group g's productions by their layout; and per group in `shares`
    or `nu` the value of one read by each copy: under its shares, or B_g / k_g plus the copy's
    price of the source layout it reads from (nu: extract/agreement.py). `trace` records what
    the minima chose."""

    sg: SearchGraph
    reads: Reads
    pins: dict[int, frozenset[int]]
    lam: dict[int, np.ndarray]
    shares: dict[int, _Shares]
    nu: Prices = field(default_factory=dict)
    trace: Trace | None = None
    value: list[np.ndarray | None] = field(default_factory=list)
    cval: CopyValues = field(default_factory=dict)
    kids: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # node -> (group, layout index)

    def __post_init__(self) -> None:
        self.value = [None] * self.sg.g.num_groups

    def group(self, grp: int) -> None:
        sg = self.sg
        key = sg.group_key[grp]
        if not sg.prod_any[grp] or key not in sg.paths:
            return
        sp = sg.paths[key]
        best, nodes = _sources(sg, grp, len(sp.layouts), self.pins.get(grp), self.value, self.reads, self.cval,
                               self.kids)
        if grp in self.lam:
            best += self.lam[grp]
        src = np.flatnonzero(np.isfinite(best))
        if not len(src):
            self.value[grp] = None
            return
        base = best[src, None] + sg.weight_l[grp] * sp.dist[src, :]
        if grp in self.shares:
            sh = self.shares[grp]
            _copy_values(sh, best, src, sg.weight_l[grp] * sp.dist[src, :])
            self.cval[grp] = {c: sh.value[c] / m for c, m in zip(sh.copies, sh.reads, strict=True)}
        self.price(grp, src, base)
        arg = base.argmin(axis=0)
        self.value[grp] = base[arg, np.arange(base.shape[1])]
        if self.trace is not None:
            self.trace.record(grp, nodes, src, arg, base)

    def price(self, grp: int, src: np.ndarray, base: np.ndarray) -> None:
        """The copies' values of a group with prices, from its sources' totals per layout, and
        (traced) the source each copy reads each layout from."""
        prices = self.nu.get(grp)
        if not prices:
            return
        k = self.reads.k[grp]
        vals, picks = {}, {}
        with np.errstate(invalid="ignore"):
            for c, m in prices.items():
                tot = base / k + m[src, None]
                arg = tot.argmin(axis=0)
                vals[c] = tot[arg, np.arange(tot.shape[1])]
                picks[c] = src[arg]
        self.cval[grp] = vals
        if self.trace is not None:
            self.trace.picks[grp] = picks


@dataclass
class Trace:
    """What the dynamic program chose, for walking its solution down from the roots: per group
    the production of each source layout and the cheapest source per layout; for the groups in
    `keep`, every source's total per layout."""

    keep: frozenset[int]
    nodes: dict[int, dict[int, int]] = field(default_factory=dict)
    arg: dict[int, np.ndarray] = field(default_factory=dict)  # layout index -> source index
    base: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # (sources, totals)
    picks: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # priced: copy -> layout -> source

    def record(self, grp: int, nodes: dict[int, int], src: np.ndarray, arg: np.ndarray, base: np.ndarray) -> None:
        self.nodes[grp] = nodes
        self.arg[grp] = src[arg]
        if grp in self.keep:
            self.base[grp] = (src, base)


def _sources(sg: SearchGraph, grp: int, size: int, pin: frozenset[int] | None, value: list[np.ndarray | None],
             reads: Reads, cval: CopyValues, kids: dict[int, tuple[tuple[int, int], ...]] | None = None
             ) -> tuple[np.ndarray, dict[int, int]]:
    """Per source layout of `grp`: its cheapest production with its operands' shares, and that
    production (by source layout index). `kids`: each node's operands with their layouts' row
    indices, filled on first use (for repeated evaluations)."""
    best = np.full(size, np.inf)
    nodes: dict[int, int] = {}
    index = sg.paths[sg.group_key[grp]].index
    kinds, node_b = sg.g.node_kind, sg.g.node_b
    k = reads.k
    kids = {} if kids is None else kids
    for n in sg.prod_any[grp]:
        if pin is not None and int(kinds[n]) == _PLACE and int(node_b[n]) not in pin:
            continue
        s = sg.cost_l[n]
        ops = kids.get(n)
        if ops is None:
            ops = kids[n] = tuple((h, sg.paths[sg.group_key[h]].index[lay]) for h, lay in sg.kid_gl[n])
        for h, j in ops:
            if h in cval:
                vc = cval[h].get(grp)
                if vc is not None:
                    s += vc[j]
                continue
            vh = value[h]
            if vh is not None and k[h]:
                s += vh[j] / k[h]
        i = index[sg.node_layout[n]]
        if s < best[i]:
            best[i] = s
            nodes[i] = n
    return best, nodes


def _copy_values(sh: _Shares, best: np.ndarray, src: np.ndarray, dist: np.ndarray) -> None:
    """Each copy's share per layout l: min over sources s of gamma(s) best(s) + beta(s) dist(s, l)."""
    g, b = sh.gamma[:, src], sh.beta[:, src]
    with np.errstate(invalid="ignore"):  # a zero share of an unreachable layout: 0, not nan
        cost = np.where(g > 0, g * best[src], 0.0)[:, :, None]
        move = np.where(b[:, :, None] > 0, b[:, :, None] * dist[None], 0.0)
    sh.value = dict(zip(sh.copies, (cost + move).min(axis=1), strict=True))


def split_total(sg: SearchGraph, roots: Roots, k: list[int], value: list[np.ndarray | None],
                 tied: dict[int, int], lam: dict[int, np.ndarray], cval: CopyValues
                 ) -> tuple[float, dict[int, np.ndarray], list[int | None]]:
    """The bound: each root's share in its cheapest allowed layout, less the multiplier of a
    tied input there; each tied root's share per layout (inf where not allowed); and each
    root's layout index there (None where it adds nothing)."""
    total = 0.0
    root_share: dict[int, np.ndarray] = {}
    picks: list[int | None] = []
    for r, (grp, lays) in enumerate(roots):
        picks.append(None)
        vg = cval[grp].get(-1 - r) if grp in cval else value[grp]
        if vg is None or not k[grp]:
            continue
        sp = sg.paths[sg.group_key[grp]]
        ok = _allowed(sg, grp, lays)
        if not ok:
            continue
        share = np.full(len(sp.layouts), np.inf)
        share[ok] = vg[ok] if grp in cval else vg[ok] / k[grp]
        h = tied.get(r)
        if h is not None:
            root_share[r] = share
        priced = share - lam[h] if h is not None and h in lam else share
        picks[-1] = int(np.argmin(priced))
        total += float(priced[picks[-1]])
    return (total, root_share, picks) if np.isfinite(total) else (0.0, root_share, picks)


def _allowed(sg: SearchGraph, grp: int, lays: frozenset[int] | None) -> list[int]:
    """Indices of the layouts a root may be returned in (not pending sums)."""
    sp = sg.paths[sg.group_key[grp]]
    return [sp.index[lay] for lay in (lays if lays is not None else sp.layouts)
            if not sg.spaces.layouts[lay].partial and lay in sp.index]


def _next_multipliers(sg: SearchGraph, tied: dict[int, int], root_share: dict[int, np.ndarray],
                      plan: Extraction | None) -> dict[int, np.ndarray]:
    """lam per tied input: what its root's share costs more (or less) per layout than at the
    plan's layout of the input (else at the root's cheapest), so that returning the state
    anywhere else stops paying; shifted to be >= 0 (a constant added to both sides of a tie
    changes nothing), and the shift where the root cannot be."""
    lam: dict[int, np.ndarray] = {}
    for r, h in tied.items():
        share = root_share.get(r)
        if share is None or not np.isfinite(share).any():
            continue
        sp = sg.paths[sg.group_key[h]]
        at = plan.choices[h].layout if plan is not None and h in plan.choices else None
        ref = share[sp.index[at]] if at is not None and at in sp.index else np.nan
        if not np.isfinite(ref):
            ref = float(np.min(share))
        diff = np.where(np.isfinite(share), share - ref, 0.0)
        lam[h] = diff - min(0.0, float(diff.min()))
    return lam


def _plan_shares(sg: SearchGraph, roots: Roots, reads: Reads, tied: dict[int, int], lam: dict[int, np.ndarray],
                 pins: dict[int, frozenset[int]], plan: Extraction) -> dict[int, _Shares]:
    """Shares for the tied inputs where the plan's reads are worth more under them than 1/k_h."""
    out: dict[int, _Shares] = {}
    for h in tied.values():
        if h not in lam or h not in plan.choices:
            continue
        sp = sg.paths[sg.group_key[h]]
        cost = _sources(sg, h, len(sp.layouts), pins.get(h), [], reads, {})[0] + lam[h]
        copies = reads.readers.get(h, []) + [-1 - r for r, (grp, _) in enumerate(roots) if grp == h]
        demand = [_plan_reads(sg, roots, plan, h, c) for c in copies]
        if not any(demand) or not np.isfinite(cost).any():
            continue
        counts = [reads.pair[(c, h)] if c >= 0 else 1 for c in copies]
        even = np.outer(np.asarray(counts, float) / reads.k[h], np.ones(len(sp.layouts)))
        guided = _Shares(copies, counts, *_nearest_farthest(sp.dist, demand))
        dist = sg.weight_l[h] * sp.dist
        if _worth(guided, cost, dist, demand) > _worth(_Shares(copies, counts, even, even), cost, dist, demand):
            out[h] = guided
    return out


def _plan_reads(sg: SearchGraph, roots: Roots, plan: Extraction, h: int, copy: int) -> list[int]:
    """Layout indices the plan reads group h in at one copy (a reader group or a root)."""
    sp = sg.paths[sg.group_key[h]]
    if copy >= 0:
        ch = plan.choices.get(copy)
        return [sp.index[lay] for g, lay in sg.kid_gl.get(ch.node, ()) if g == h] if ch is not None else []
    ok = _allowed(sg, h, roots[-1 - copy][1])
    at = sp.index[plan.choices[h].layout]
    return [min(ok, key=lambda j: sp.dist[at, j])] if ok else []


def _nearest_farthest(dist: np.ndarray, demand: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """gamma: each source layout's cost to the copy reading nearest it; beta: its resharding to
    the copy reading farthest from it (copies the plan does not read through get neither)."""
    active = [i for i, d in enumerate(demand) if d]
    near = np.stack([dist[:, demand[i]].min(axis=1) for i in active])
    far = np.stack([dist[:, demand[i]].max(axis=1) for i in active])
    far[~np.isfinite(far)] = -1.0  # a copy no resharding from there serves reads it elsewhere
    gamma = np.zeros((len(demand), dist.shape[0]))
    beta = np.zeros_like(gamma)
    cols = np.arange(dist.shape[0])
    gamma[np.asarray(active)[near.argmin(axis=0)], cols] = 1.0
    beta[np.asarray(active)[far.argmax(axis=0)], cols] = 1.0
    return gamma, beta


def _worth(sh: _Shares, cost: np.ndarray, dist: np.ndarray, demand: list[list[int]]) -> float:
    """The copies' shares summed at the plan's reads."""
    src = np.flatnonzero(np.isfinite(cost))
    _copy_values(sh, cost, src, dist[src, :])
    return sum(sh.value[c][j] / m for c, m, d in zip(sh.copies, sh.reads, demand, strict=True) for j in d)
