"""Region moves: the readers of a resharded value, and their readers in turn, re-chosen forward
from the layout the value is produced in, as GSPMD's propagation would (each the production
cheapest given its operands' layouts as they now are); the plan's exact cost then decides.
Single-value and chain moves cannot drop a gather whose readers branch: a vision
transformer's head (a layer norm's diamond, a softmax cross-entropy and their backward pass)
gathered its batch to compute it replicated, where each reader alone would pay a gather of its
own to move (a ViT step on 1x8: 128.3 us, 124.8 with that region split)."""

from __future__ import annotations

import heapq
import math
import time

from .planstate import PlanState
from .searchgraph import EPS, SearchGraph, improvement_bar

# per round: the values with the costliest resharding trees tried as seeds, and the values one
# move may re-choose at most (a region is a head, a loss, a block's tail, not a whole program)
MAX_SEEDS = 16
MAX_REGION = 4096
MAX_REGION_ROUNDS = 2


def region_moves(sg: SearchGraph, st: PlanState, work: list[int], deadline: float) -> set[int]:
    """Try each seed's region, costliest resharding first; keep every move that lowers the
    plan's exact cost. Returns the values changed. No memory of moves that found nothing: a
    region reads the choices of every value it reaches (a tenth of a second in a planning of
    seconds where measured)."""
    changed: set[int] = set()
    for h in _seeds(sg, st):
        if time.perf_counter() >= deadline:
            break
        changed |= _region(sg, st, [h], work)
    # then every seed's region at once: a loss reads both the batch and its labels, each
    # gathered; moved apart, each region meets the other's gather and costs more
    seeds = _seeds(sg, st)
    if len(seeds) > 1 and time.perf_counter() < deadline:
        changed |= _region(sg, st, seeds, work)
    return changed


def _seeds(sg: SearchGraph, st: PlanState) -> list[int]:
    """Used values read in a layout other than the one they are produced in, their resharding
    trees costliest first (ties by program order)."""
    out = []
    for h, n in st.choice.items():
        lay = sg.node_layout[n]
        d = st.demand[h]
        if not d or (len(d) == 1 and lay in d):
            continue
        tree = sg.weight_l[h] * sg.steiner_cost(h, lay, frozenset(d))
        if math.isfinite(tree) and tree > EPS:
            out.append((-tree, int(sg.rank[h]), h))
    out.sort()
    return [h for _, _, h in out[:MAX_SEEDS]]


def _region(sg: SearchGraph, st: PlanState, seeds: list[int], work: list[int]) -> set[int]:
    """Propagate forward from the seeds' readers that reshard them; keep the region if the
    plan's exact cost drops, else put it back. Returns the values changed (empty if none kept)."""
    choice = st.choice
    old: dict[int, int] = {}
    touched: set[int] = set()
    queued: set[int] = set()
    for h in seeds:
        lay_h = sg.node_layout[choice[h]]
        queued |= {v for v in sg.parents[h] if v in choice and any(x != lay_h for x in sg.demands(choice[v]).get(h, ()))}
    heap = [(int(sg.rank[v]), v) for v in queued]
    heapq.heapify(heap)
    region = set(seeds)  # the seeds and the values moved: what the region's values may follow
    while heap and len(old) < MAX_REGION:
        _, v = heapq.heappop(heap)
        if v in st.roots_of or len(st.prod[v]) < 2:
            continue
        work[0] += 1
        n = _forward_choice(sg, st, v, region)
        if n == choice[v]:
            continue
        touched |= set(sg.demands(choice[v])) | set(sg.demands(n)) | {v}
        old.setdefault(v, choice[v])
        region.add(v)
        st.set(sg, [v], [n])
        for u in sorted(sg.parents[v], key=lambda x: sg.rank[x]):
            if u in choice and u not in queued:
                queued.add(u)
                heapq.heappush(heap, (int(sg.rank[u]), u))
    if not old:
        return set()
    groups = list(old)
    new = [choice[v] for v in groups]
    after = st.cost_of(sg, touched)
    st.set(sg, groups, [old[v] for v in groups])
    if after < improvement_bar(st.cost_of(sg, touched)):
        st.set(sg, groups, new)
        return set(groups)
    return set()


def _forward_choice(sg: SearchGraph, st: PlanState, v: int, region: set[int]) -> int:
    """v's production cheapest given its operands as they are produced now (each operand's
    resharding priced alone, as a propagation would); its own readers are not asked. A new
    layout only where it follows the region: every operand moved by it read as it is produced
    (an optimizer's update of a gradient now a pending sum is not split by a reduce-scatter
    that its pinned output then gathers again). Ties keep the current one."""
    choice, node_layout, cost_l, weight_l = st.choice, sg.node_layout, sg.cost_l, sg.weight_l
    cur = choice[v]
    here = node_layout[cur]
    best_n, best = cur, math.inf
    for n in [cur, *st.prod[v]]:
        dm = sg.demands(n)
        if node_layout[n] != here and any(
                lays != (node_layout[choice[g]],) for g, lays in dm.items() if g in region):
            continue
        c = cost_l[n]
        for g, lays in dm.items():
            p = choice.get(g)
            if p is None:
                c = math.inf
                break
            c += weight_l[g] * sg.steiner_cost(g, node_layout[p], frozenset(lays))
            if c >= best:
                break
        if c < best - EPS:
            best_n, best = n, c
    return best_n
