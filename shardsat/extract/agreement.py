"""Agreement prices: the split bound (extract/splitbound.py) raised by making the readers of a
value agree on the layout it is made in.

The split bound lets every reader of a shared value pick its own source layout and pay its
1/k share there. On a training step the readers of the logits' gradient then live in two
worlds at once: the weight gradient reads it split by vocabulary (no reduce-scatter) and the
input gradient split by batch, each paying half of a production that costs the same in both.
The plan pays the collective that reconciles them; the bound did not (12-17% gaps on GPT steps).

A price nu_c(s) per copy c (a reader group or a root) and source layout s of a value h, added to
each read of h from s, with sum_c reads_c nu_c(s) = 0 for every s, changes nothing in a plan:
all of h's reads there come from the one layout h is made in. So any prices give a bound
(a Lagrangian relaxation of the agreement), provided each copy's reads count exactly once in
every plan: h's readers must be *exact* (extract/splitbound.py's share is 1 in every plan: each
production of every reader reads h the same number of times, and the readers are exact in turn
or roots), else a negative price could be counted less than fully. Subgradient steps (Polyak's,
towards the plan's cost) move the prices so the copies' choices agree; the best round is kept.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .searchgraph import SearchGraph
from .splitbound import SplitRounds, split_total
from .splitdp import Prices, Reads, Roots, SplitDP, Trace

STALL = 3  # rounds without a better bound before the step halves
THETA = 1.0  # the first step's share of Polyak's
MAX_ROUNDS = 60
MIN_ROUNDS = 4  # rounds however small the budget
NOISE = 1e-9  # a projected use below this is rounding


def exact_groups(sg: SearchGraph, reads: Reads, roots: Roots) -> set[int]:
    """Groups whose share of every plan is exactly 1: read by roots or exact groups only, by
    every production of each reader the same number of times (readers before their operands);
    and valued by the dynamic program (a known space, productions): a value it leaves out adds
    0 where it holds prices, which would then not sum to 0."""
    root_count = Counter(g for g, _ in roots)
    exact: set[int] = set()
    for g in reversed(sg.order):
        readers = reads.readers.get(g, [])
        if (not readers and not root_count[g]) or not sg.prod_any[g] or sg.group_key[g] not in sg.paths:
            continue
        if all(p != g and p in exact and _reads_alike(sg, p, g, reads.pair[(p, g)]) for p in readers):
            exact.add(g)
    return exact


def _scale(sg: SearchGraph, h: int) -> float:
    """A group's step size: its typical resharding's cost, so big tensors' prices move as far
    as their collectives cost (one step size for all converged slower, 7.6% against 4.9%)."""
    d = sg.paths[sg.group_key[h]].dist
    fin = d[np.isfinite(d) & (d > 0)]
    return float(sg.weight_l[h] * fin.mean()) if len(fin) else 0.0


def _reads_alike(sg: SearchGraph, p: int, g: int, count: int) -> bool:
    """Every production of `p` reads `g` exactly `count` times."""
    return all(sum(1 for h, _ in sg.kid_gl[n] if h == g) == count for n in sg.prod_any[p])


@dataclass
class Agreement:
    """The copies of each value that gets prices, and the prices."""

    copies: dict[int, list[tuple[int, int]]]  # group -> (copy, reads by one production)
    scale: dict[int, float]  # group -> the size of its prices' steps (its resharding's typical cost)
    nu: Prices = field(default_factory=dict)

    @classmethod
    def of(cls, sg: SearchGraph, roots: Roots, rounds: SplitRounds) -> Agreement:
        """Exact groups with two copies or more, but the roots a tie subtracts its multiplier at."""
        reads = rounds.reads
        skip = {roots[r][0] for r in rounds.tied}
        copies: dict[int, list[tuple[int, int]]] = {}
        for h in exact_groups(sg, reads, roots) - skip:
            cs = [(c, reads.pair[(c, h)] if c >= 0 else 1) for c in reads.copies(h, roots)]
            if len(cs) >= 2 and sg.group_key[h] in sg.paths:
                copies[h] = cs
        return cls(copies, {h: _scale(sg, h) for h in copies})


def agreed_bound(sg: SearchGraph, roots: Roots, rounds: SplitRounds, target: float, evaluations: float,
                 max_rounds: int = MAX_ROUNDS) -> float:
    """The best of rounds.bound and the agreement-priced bounds of the rounds that fit in
    `evaluations` group evaluations of the dynamic program (at least MIN_ROUNDS rounds), the
    steps aimed at `target` (the plan's cost). A count, not seconds, so that the bound and the
    gap of a plan are the same on a loaded machine (issue 17: 13.2% and 14.9% for one plan)."""
    if rounds.passes != 1:  # a cycle: values read before they are made count 0, which a negative price breaks
        return rounds.bound
    ag = Agreement.of(sg, roots, rounds)
    if not ag.copies:
        return rounds.bound
    dep = _priced_readers(sg, ag)
    dp = SplitDP(rounds.tables.with_copied(ag.copies), rounds.lam, rounds.shares, ag.nu, Trace(frozenset(ag.copies)))
    best, theta, stall, spent = rounds.bound, THETA, 0, 0
    for i in range(max_rounds):
        if i >= MIN_ROUNDS and spent >= evaluations:
            break
        spent += _evaluate(sg, ag, dp, dep if i else None)
        total, _, picks = split_total(sg, roots, rounds.reads.k, dp, rounds.tied, rounds.lam)
        if total > best * (1 + 1e-12):
            best, stall = total, 0
        else:
            stall += 1
            if stall >= STALL:
                theta, stall = theta / 2, 0
        step = _subgradient(sg, roots, rounds.reads, ag, dp.trace, dp.value, picks)
        norm2 = sum(ag.scale[h] * float((g * g).sum()) for h, d in step.items() for g in d.values())
        if norm2 <= 0.0 or target <= total:
            break
        _move(sg, ag, step, theta * (target - total) / norm2, target)
    return best


def _priced_readers(sg: SearchGraph, ag: Agreement) -> set[int]:
    """Groups whose values the prices change: the readers of a priced group, and theirs."""
    dep: set[int] = set()
    for grp in sg.order:
        if any(h in ag.copies or h in dep for n in sg.prod_any[grp] for h, _ in sg.kid_gl[n]):
            dep.add(grp)
    return dep


def _evaluate(sg: SearchGraph, ag: Agreement, dp: SplitDP, dep: set[int] | None) -> int:
    """The dynamic program under the current prices: every group (dep None), else only those
    the prices change, and the priced groups' copy values; how many groups it evaluated."""
    done = 0
    for grp in sg.order:
        if dep is None or grp in dep:
            dp.group(grp)
            done += 1
        elif grp in ag.copies and dp.trace is not None and grp in dp.trace.base:
            dp.copies(grp, *dp.trace.base[grp])
            done += 1
    return done


def _subgradient(sg: SearchGraph, roots: Roots, reads: Reads, ag: Agreement, trace: Trace,
                 value: list[np.ndarray | None], picks: list[int | None]) -> dict[int, dict[int, np.ndarray]]:
    """Per priced group and copy, the weight of the copy's reads from each source layout in the
    dynamic program's solution (walked down from the roots), less its part of their mean."""
    k = reads.k
    weight: dict[int, Counter[int]] = {}  # group -> source index -> weight of its production there
    used: dict[int, dict[int, Counter[int]]] = {h: {c: Counter() for c, _ in cs} for h, cs in ag.copies.items()}

    def read(h: int, copy: int, j: int, w: float) -> None:
        if h in ag.copies:
            pick = trace.picks.get(h, {}).get(copy)
            s = int(pick[j]) if pick is not None else int(trace.arg[h][j])
            used[h][copy][s] += w
        elif h in trace.arg:
            s = int(trace.arg[h][j])
        else:
            return
        weight.setdefault(h, Counter())[s] += w / k[h]

    for r, (grp, _) in enumerate(roots):
        if picks[r] is not None:
            read(grp, -1 - r, picks[r], 1.0)
    for grp in reversed(sg.order):
        for s, w in weight.get(grp, {}).items():
            n = trace.node(grp, s) if grp in trace.totals else None
            for h, lay in sg.kid_gl[n] if n is not None else ():
                if value[h] is not None and k[h]:
                    read(h, grp, sg.paths[sg.group_key[h]].index[lay], w)
    return {h: _projected(sg, h, ag.copies[h], used[h]) for h in ag.copies}


def _projected(sg: SearchGraph, h: int, copies: list[tuple[int, int]], used: dict[int, Counter[int]]
               ) -> dict[int, np.ndarray]:
    """The copies' use of each source, projected onto sum_c reads_c nu_c(s) = 0; rounding
    noise (|g| < NOISE: the uses are weights of order 1) set to 0, so agreement reads as 0."""
    size = len(sg.paths[sg.group_key[h]].layouts)
    g = np.zeros((len(copies), size))
    for i, (c, _) in enumerate(copies):
        for s, w in used[c].items():
            g[i, s] = w
    a = np.asarray([m for _, m in copies], dtype=float)
    g -= np.outer(a, a @ g) / float(a @ a)
    g[np.abs(g) < NOISE] = 0.0
    g -= np.outer(a, a @ g) / float(a @ a)  # the zeroing moved the sums by at most NOISE
    return {c: g[i] for i, (c, _) in enumerate(copies)}


def _move(sg: SearchGraph, ag: Agreement, step: dict[int, dict[int, np.ndarray]], alpha: float,
          target: float) -> None:
    """Prices += alpha x each group's scale x its projected step (the sums stay 0), the step
    shrunk so that no price moves by more than `target`: larger prices cannot raise a bound
    below it, and only cost the sums' precision."""
    largest = max((ag.scale[h] * float(np.abs(g).max()) for h, d in step.items() for g in d.values()), default=0.0)
    if largest * alpha > target:
        alpha = target / largest
    for h, d in step.items():
        prices = ag.nu.setdefault(h, {})
        for c, g in d.items():
            g = alpha * ag.scale[h] * g
            prices[c] = prices[c] + g if c in prices else g
