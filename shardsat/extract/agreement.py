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

The same steps move two more sets of multipliers of the same relaxation:
- the tied inputs' lam (extract/splitbound.py), where the solution places state in one layout
  and returns it in another (kept >= 0: a tied input read by less than its whole share would
  count a negative one less than fully);
- each priced value's resharding shares beta_c(s) (>= 0, summing to at most 1 per source
  layout): its resharding tree is at least its longest path, and 1/k_h shares count a path one
  copy of k_h takes at 1/k_h of its price. The bound is concave in the shares, so they move
  along its supergradient (what each copy's reads move from s) and are projected back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .searchgraph import SearchGraph
from .splitbound import SplitRounds, split_total
from .splitdp import Prices, Reads, Roots, Shares, SplitDP, Trace

STALL = 3  # rounds without a better bound before the step halves
# the first step's share of Polyak's. With shares and ties moving, 1 climbed all 60 rounds
# without a stall; 2 closed more in the same rounds on all 9 steps measured (GPT 2x4 13.2% ->
# 10.5%, MLP6 2x4 6.7% -> 4.1%), 4 on 7 of 9, and 8 lost most of the bound in 60 rounds
THETA = 2.0
MAX_ROUNDS = 60
MIN_ROUNDS = 4  # rounds however small the budget
NOISE = 1e-9  # a projected use below this is rounding
# a priced group's resharding shares move where its copies x layouts^2 stay below this (the
# shared values are a [copies, layouts, layouts] array per evaluation)
SHARE_CELLS = 2_000_000


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
    """The copies of each value that gets prices, and the prices; and the tied inputs'
    multipliers (extract/splitbound.py's lam), moved by the same steps."""

    copies: dict[int, list[tuple[int, int]]]  # group -> (copy, reads by one production)
    scale: dict[int, float]  # group -> the size of its prices' steps (its resharding's typical cost)
    lam: dict[int, np.ndarray]  # tied input -> multiplier per layout (>= 0)
    tied: dict[int, int]  # root index -> tied input, where the input has multipliers
    shares: dict[int, Shares]  # every group's shares the dynamic program reads
    moving: set[int]  # priced groups whose resharding shares (beta) move
    nu: Prices = field(default_factory=dict)
    _operands: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    _per_read: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def operands(self, sg: SearchGraph, n: int) -> tuple[tuple[int, int], ...]:
        """A production's operands as (group, layout index in the group's space)."""
        out = self._operands.get(n)
        if out is None:
            out = self._operands[n] = tuple((h, sg.paths[sg.group_key[h]].index[lay]) for h, lay in sg.kid_gl[n])
        return out

    def move_per_read(self, sg: SearchGraph, h: int, copy: int) -> np.ndarray:
        """What one read by `copy` moves from each source to each layout, per unit of its share;
        where no resharding leads there, twice the farthest that one does. A copy with no share
        of s reads an unreachable layout from it for free (0 x inf is 0 in Shares.totals): the
        step must push its share up, but by a finite amount (inf x 0 would make it nan)."""
        out = self._per_read.get((h, copy))
        if out is None:
            d = sg.paths[sg.group_key[h]].dist
            fin = np.isfinite(d)
            far = 2.0 * float(d[fin].max()) if fin.any() else 0.0
            m = dict(self.copies[h])[copy]
            out = self._per_read[(h, copy)] = sg.weight_l[h] * np.where(fin, d, far) / m
        return out

    @classmethod
    def of(cls, sg: SearchGraph, roots: Roots, rounds: SplitRounds) -> Agreement:
        """Exact groups with two copies or more, but the roots a tie subtracts its multiplier at;
        the best round's multipliers, zero where it had none."""
        reads = rounds.reads
        skip = {roots[r][0] for r in rounds.tied}
        copies: dict[int, list[tuple[int, int]]] = {}
        for h in exact_groups(sg, reads, roots) - skip:
            cs = [(c, reads.pair[(c, h)] if c >= 0 else 1) for c in reads.copies(h, roots)]
            if len(cs) >= 2 and sg.group_key[h] in sg.paths:
                copies[h] = cs
        tied = {r: h for r, h in rounds.tied.items() if sg.group_key[h] in sg.paths}
        lam = {h: rounds.lam[h].copy() if h in rounds.lam else np.zeros(len(sg.paths[sg.group_key[h]].layouts))
               for h in tied.values()}
        scale = {h: _scale(sg, h) for h in {*copies, *lam}}
        shares, moving = _moving_shares(sg, rounds, copies)
        return cls(copies, scale, lam, tied, shares, moving)


def _moving_shares(sg: SearchGraph, rounds: SplitRounds, copies: dict[int, list[tuple[int, int]]]
                   ) -> tuple[dict[int, Shares], set[int]]:
    """Shares whose resharding part the subgradient moves, per priced group (from its round's
    shares, else 1/k_h each): a resharding tree costs at least its longest path, which shares
    that sum to 1 per source layout can reach where 1/k_h gives a path read once in k_h reads
    1/k_h of itself (a weight read sharded by its update and gathered by the forward pass)."""
    shares = dict(rounds.shares)
    moving: set[int] = set()
    for h, cs in copies.items():
        size = len(sg.paths[sg.group_key[h]].layouts)
        if len(cs) * size * size > SHARE_CELLS:
            continue
        old = shares.get(h)
        counts = [m for _, m in cs]
        if old is None:
            even = np.outer(np.asarray(counts, float) / rounds.reads.k[h], np.ones(size))
            old = Shares([c for c, _ in cs], counts, even, even)
        shares[h] = Shares(old.copies, old.reads, old.gamma, old.beta.copy())
        moving.add(h)
    return shares, moving


def agreed_bound(sg: SearchGraph, roots: Roots, rounds: SplitRounds, target: float, evaluations: float,
                 max_rounds: int = MAX_ROUNDS) -> float:
    """The best of rounds.bound and the agreement-priced bounds of the rounds that fit in
    `evaluations` group evaluations of the dynamic program (at least MIN_ROUNDS rounds), the
    steps aimed at `target` (the plan's cost). A count, not seconds, so that the bound and the
    gap of a plan are the same on a loaded machine (issue 17: 13.2% and 14.9% for one plan)."""
    if rounds.passes != 1:  # a cycle: values read before they are made count 0, which a negative price breaks
        return rounds.bound
    ag = Agreement.of(sg, roots, rounds)
    if not ag.copies and not ag.lam:
        return rounds.bound
    dep = _priced_readers(sg, ag)
    dp = SplitDP(rounds.tables.with_copied(ag.copies), ag.lam, ag.shares, ag.nu, Trace(frozenset(ag.copies)))
    best, theta, stall, spent = rounds.bound, THETA, 0, 0
    for i in range(max_rounds):
        if i >= MIN_ROUNDS and spent >= evaluations:
            break
        spent += _evaluate(sg, ag, dp, dep if i else None)
        total, _, picks = split_total(sg, roots, rounds.reads.k, dp, rounds.tied, ag.lam)
        if total > best * (1 + 1e-12):
            best, stall = total, 0
        else:
            stall += 1
            if stall >= STALL:
                theta, stall = theta / 2, 0
        sol = _solution(sg, roots, rounds.reads, ag, dp.trace, dp.value, picks)
        step = {h: _projected(sg, h, ag.copies[h], sol.used[h]) for h in ag.copies}
        ties = _tie_steps(ag, sol.weight, picks)
        moves = _share_steps(sg, ag, sol.moved)
        norm2 = sum(ag.scale[h] * float((g * g).sum()) for h, d in step.items() for g in d.values())
        norm2 += sum(ag.scale[h] * float((g * g).sum()) for h, g in ties.items())
        norm2 += sum(float((g * g).sum()) / ag.scale[h] for h, g in moves.items() if ag.scale[h] > 0)
        if norm2 <= 0.0 or target <= total:
            break
        alpha = theta * (target - total) / norm2
        _move(ag, step, ties, alpha, target)
        _move_shares(ag, moves, alpha)
    return best


def _priced_readers(sg: SearchGraph, ag: Agreement) -> set[int]:
    """Groups whose values the prices change: the tied inputs, the readers of a priced group or
    a tied input, and theirs."""
    dep: set[int] = set(ag.lam)
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


@dataclass
class Solution:
    """The dynamic program's solution, walked down from the roots."""

    weight: dict[int, dict[int, float]]  # group -> source index -> weight of its production there
    used: dict[int, dict[int, dict[int, float]]]  # priced group -> copy -> source -> weight of its reads
    moved: dict[int, dict[int, dict[int, float]]]  # moving group -> copy -> source -> its resharding per share


def _solution(sg: SearchGraph, roots: Roots, reads: Reads, ag: Agreement, trace: Trace,
              value: list[np.ndarray | None], picks: list[int | None]) -> Solution:
    """Per group the weight of its production in each source layout; per priced group and copy
    the weight of the copy's reads from each source, and per moving group what the copy's
    reads move from each source per unit of its resharding share. (Once a round, over every
    read of the solution: plain dicts and cached lookups, as it was 40% of a round.)"""
    k = reads.k
    sol = Solution({}, {h: {} for h in ag.copies}, {h: {} for h in ag.moving})
    weight, used, moved = sol.weight, sol.used, sol.moved
    tpicks, targ = trace.picks, trace.arg

    def read(h: int, copy: int, j: int, w: float) -> None:
        if h in used:
            pick = tpicks.get(h, {}).get(copy)
            s = pick.item(j) if pick is not None else targ[h].item(j)
            at = used[h].setdefault(copy, {})
            at[s] = at.get(s, 0.0) + w
            if h in moved:
                d = ag.move_per_read(sg, h, copy)
                if (m := d.item(s, j)) > 0:
                    mv = moved[h].setdefault(copy, {})
                    mv[s] = mv.get(s, 0.0) + w * m
        elif h in targ:
            s = targ[h].item(j)
        else:
            return
        at = weight.setdefault(h, {})
        at[s] = at.get(s, 0.0) + w / k[h]

    for r, (grp, _) in enumerate(roots):
        if picks[r] is not None:
            read(grp, -1 - r, picks[r], 1.0)
    for grp in reversed(sg.order):
        if grp not in weight or grp not in trace.totals:
            continue
        for s, w in weight[grp].items():
            n = trace.node(grp, s)
            for h, j in ag.operands(sg, n) if n is not None else ():
                if value[h] is not None and k[h]:
                    read(h, grp, j, w)
    return sol


def _share_steps(sg: SearchGraph, ag: Agreement, moved: dict[int, dict[int, dict[int, float]]]) -> dict[int, np.ndarray]:
    """Per moving group, the supergradient of the bound in its resharding shares beta[copy, s]:
    what each copy's reads move from s. Groups whose copies move nothing are left out."""
    out: dict[int, np.ndarray] = {}
    for h, per in moved.items():
        sh = ag.shares[h]
        g = np.zeros_like(sh.beta)
        for i, c in enumerate(sh.copies):
            for s, v in per.get(c, {}).items():
                g[i, s] = v
        if g.any():
            out[h] = g
    return out


def _move_shares(ag: Agreement, moves: dict[int, np.ndarray], alpha: float) -> None:
    """beta += alpha x its step / the group's scale (the step is in seconds, a share is not),
    then each source layout's shares projected back onto >= 0, summing to at most 1."""
    for h, g in moves.items():
        if ag.scale[h] > 0:
            sh = ag.shares[h]
            sh.beta = _capped(sh.beta + alpha * g / ag.scale[h])


def _capped(b: np.ndarray) -> np.ndarray:
    """Each column's Euclidean projection onto {x >= 0, sum x <= 1}."""
    out = np.maximum(b, 0.0)
    over = out.sum(axis=0) > 1.0
    if over.any():
        v = b[:, over]
        u = -np.sort(-v, axis=0)
        css = np.cumsum(u, axis=0) - 1.0
        ind = np.arange(1, v.shape[0] + 1)[:, None]
        rho = (u - css / ind > 0).sum(axis=0)
        theta = css[rho - 1, np.arange(v.shape[1])] / rho
        out[:, over] = np.maximum(v - theta, 0.0)
    return out


def _tie_steps(ag: Agreement, weight: dict[int, dict[int, float]], picks: list[int | None]) -> dict[int, np.ndarray]:
    """Per tied input, where the solution places it less where it returns it: lam rises where
    the input is placed but not returned, and falls where it is returned but not placed."""
    steps: dict[int, np.ndarray] = {}
    for r, h in ag.tied.items():
        g = steps.setdefault(h, np.zeros(len(ag.lam[h])))
        for s, w in weight.get(h, {}).items():
            g[s] += w
        if picks[r] is not None:
            g[picks[r]] -= 1.0
    for g in steps.values():
        g[np.abs(g) < NOISE] = 0.0
    return steps


def _projected(sg: SearchGraph, h: int, copies: list[tuple[int, int]], used: dict[int, dict[int, float]]
               ) -> dict[int, np.ndarray]:
    """The copies' use of each source, projected onto sum_c reads_c nu_c(s) = 0; rounding
    noise (|g| < NOISE: the uses are weights of order 1) set to 0, so agreement reads as 0."""
    size = len(sg.paths[sg.group_key[h]].layouts)
    g = np.zeros((len(copies), size))
    for i, (c, _) in enumerate(copies):
        for s, w in used.get(c, {}).items():
            g[i, s] = w
    a = np.asarray([m for _, m in copies], dtype=float)
    g -= np.outer(a, a @ g) / float(a @ a)
    g[np.abs(g) < NOISE] = 0.0
    g -= np.outer(a, a @ g) / float(a @ a)  # the zeroing moved the sums by at most NOISE
    return {c: g[i] for i, (c, _) in enumerate(copies)}


def _move(ag: Agreement, step: dict[int, dict[int, np.ndarray]], ties: dict[int, np.ndarray], alpha: float,
          target: float) -> None:
    """Prices += alpha x each group's scale x its projected step (the sums stay 0), the
    multipliers likewise but kept >= 0 (a tied input read by less than its whole share would
    count a negative one less than fully); the step shrunk so that nothing moves by more than
    `target`: larger prices cannot raise a bound below it, and only cost the sums' precision."""
    moves = [ag.scale[h] * float(np.abs(g).max()) for h, d in step.items() for g in d.values()]
    moves += [ag.scale[h] * float(np.abs(g).max()) for h, g in ties.items()]
    largest = max(moves, default=0.0)
    if largest * alpha > target:
        alpha = target / largest
    for h, d in step.items():
        prices = ag.nu.setdefault(h, {})
        for c, g in d.items():
            g = alpha * ag.scale[h] * g
            prices[c] = prices[c] + g if c in prices else g
    for h, g in ties.items():
        ag.lam[h] = np.maximum(ag.lam[h] + alpha * ag.scale[h] * g, 0.0)
