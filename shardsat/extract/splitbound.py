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

The dynamic program itself is extract/splitdp.py; extract/agreement.py raises the bound further
by pricing the readers of a shared value until they agree on the layout it is made in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..egraph.export import NodeKind
from .result import Extraction
from .searchgraph import SearchGraph
from .splitdp import Reads, Roots, Shares, SplitDP, SplitTables

if TYPE_CHECKING:
    from .greedy import Extractor

ROUNDS = 3  # multiplier vectors tried when there is loop-carried state
_PLACE = int(NodeKind.PLACE)


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
    shares: dict[int, Shares]
    passes: int
    tables: SplitTables


def split_rounds(sg: SearchGraph, roots: Roots, ties: Sequence[tuple[int, int]], pins: dict[int, frozenset[int]],
                 plan: Extraction | None, rounds: int = ROUNDS, passes: int = 2) -> SplitRounds:
    """split_bound's rounds, keeping the prices of the best one."""
    reads = Reads.of(sg, roots)
    tied = _tied_inputs(sg, roots, ties)
    if all(len(a) == len(b) for a, b in zip(sg.prod, sg.prod_any, strict=True)):
        passes = 1  # no production reads a later group: a second pass changes nothing
    lam: dict[int, np.ndarray] = {}
    shares: dict[int, Shares] = {}
    tables = SplitTables(sg, reads, roots, pins, tied.values())
    best = SplitRounds(0.0, reads, tied, {}, {}, passes, tables)
    for _ in range(max(1, rounds if tied else 1)):
        dp = SplitDP(tables, lam, shares)
        for _ in range(passes):
            for grp in sg.order:
                dp.group(grp)
        total, root_share, _ = split_total(sg, roots, reads.k, dp, tied, lam)
        if total > best.bound:
            best = SplitRounds(total, reads, tied, lam, shares, passes, tables)
        lam = _next_multipliers(sg, tied, root_share, plan)
        shares = _plan_shares(sg, roots, dp, tied, lam, plan) if plan is not None else {}
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


def split_total(sg: SearchGraph, roots: Roots, k: list[int], dp: SplitDP, tied: dict[int, int],
                lam: dict[int, np.ndarray]) -> tuple[float, dict[int, np.ndarray], list[int | None]]:
    """The bound: each root's share in its cheapest allowed layout, less the multiplier of a
    tied input there; each tied root's share per layout (inf where not allowed); and each
    root's layout index there (None where it adds nothing)."""
    total = 0.0
    root_share: dict[int, np.ndarray] = {}
    picks: list[int | None] = []
    for r, (grp, lays) in enumerate(roots):
        picks.append(None)
        copied = grp in dp.tables.copy_off
        vg = dp.copy_value(grp, -1 - r) if copied else dp.value[grp]
        if vg is None or not k[grp]:
            continue
        sp = sg.paths[sg.group_key[grp]]
        ok = _allowed(sg, grp, lays)
        if not ok:
            continue
        share = np.full(len(sp.layouts), np.inf)
        share[ok] = vg[ok] if copied else vg[ok] / k[grp]
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


def _plan_shares(sg: SearchGraph, roots: Roots, dp: SplitDP, tied: dict[int, int], lam: dict[int, np.ndarray],
                 plan: Extraction) -> dict[int, Shares]:
    """Shares for the tied inputs where the plan's reads are worth more under them than 1/k_h
    (a tied input is placed: its sources' costs are its placements', the same in every round)."""
    out: dict[int, Shares] = {}
    reads = dp.tables.reads
    for h in tied.values():
        if h not in lam or h not in plan.choices:
            continue
        sp = sg.paths[sg.group_key[h]]
        cost = dp.sources(h)[0] + lam[h]
        copies = reads.copies(h, roots)
        demand = [_plan_reads(sg, roots, plan, h, c) for c in copies]
        if not any(demand) or not np.isfinite(cost).any():
            continue
        counts = [reads.pair[(c, h)] if c >= 0 else 1 for c in copies]
        even = np.outer(np.asarray(counts, float) / reads.k[h], np.ones(len(sp.layouts)))
        guided = Shares(copies, counts, *_nearest_farthest(sp.dist, demand))
        dist = sg.weight_l[h] * sp.dist
        if _worth(guided, cost, dist, demand) > _worth(Shares(copies, counts, even, even), cost, dist, demand):
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


def _worth(sh: Shares, cost: np.ndarray, dist: np.ndarray, demand: list[list[int]]) -> float:
    """The copies' shares summed at the plan's reads."""
    src = np.flatnonzero(np.isfinite(cost))
    sh.compute(cost, src, dist[src, :])
    return sum(sh.value[c][j] / m for c, m, d in zip(sh.copies, sh.reads, demand, strict=True) for j in d)
