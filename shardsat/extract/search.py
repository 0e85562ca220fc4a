"""The extraction driver: starting points, and the memory budget.

A memory limit is met by Lagrangian relaxation: every argument byte and (at a quarter weight)
every intermediate byte a node produces is priced at lambda seconds, and lambda grows until the
plan's memory estimate fits; a few bisection steps then take the cheapest plan that fits.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..egraph.export import ExportedGraph, NodeKind
from ..egraph.layout import SpaceTable
from ..errors import NoPlanError
from .agreement import agreed_bound
from .cost import CostModel
from .exact import solve_exact
from .families import Family
from .greedy import EPS, Extractor
from .memory import MemoryEstimate
from .policy import AGREEMENT_GROUP_WORK, SearchPolicy
from .result import Extraction
from .splitbound import split_rounds

ACTIVATION_WEIGHT = 0.25
POLISHED = 2
# a runner-up start is polished if it is within this factor of the best start: a scanned GPT's
# runner-up, 0.6% behind, ends 8% ahead; the 11% and 24% behind ones measured never came first
POLISH_WITHIN = 1.05
DEEP_WEIGHT = 16  # a loop this deep also starts from its shallow copy's plan
SHALLOW_WEIGHT = 8
# restarts under memory pressure: every byte a plan holds is priced so that the best plan's
# bytes cost this many times its seconds (see _pressure_restarts)
PRESSURE = 2.0
@dataclass
class Problem:
    graph: ExportedGraph
    node_cost: np.ndarray
    value_space: list[int]
    spaces: SpaceTable
    edges: dict
    model: CostModel
    combinable: frozenset[int]
    describe: Callable[[int], str]
    roots: list[tuple[int, frozenset[int] | None]]
    place_pins: dict[int, frozenset[int]]
    ties: list[tuple[int, int]]
    seeds: list[dict[int, int]]
    weight: np.ndarray  # per value group: executions per step (scan bodies: iterations)
    families: list[Family] = field(default_factory=list)  # standard layouts to start from
    # where data parallelism cannot use every device, the mesh axis whose tensor-parallel family
    # is completed in full (families.data_parallel_fills and tensor_axis, _tensor_parallel)
    tensor_axis: str | None = None
    # where it does, the name of data parallelism over every axis, also completed in full
    data_parallel: str | None = None
    # node_bytes by `per_run`: the same for every copy (a family's pins) of one problem
    held_bytes: dict[bool, np.ndarray] = field(default_factory=dict, repr=False, compare=False)


def _reprice(ex: Extraction, cost: np.ndarray) -> Extraction:
    """True seconds of a plan found under penalised node costs."""
    total = 0.0
    for ch in ex.choices.values():
        ch.node_seconds = float(cost[ch.node])
        total += ch.node_seconds + ch.weight * sum(s.seconds for s in ch.steps)
    ex.total_s = total
    ex.gap = ex.lower_bound_s = None  # they were of the penalised costs
    return ex


def best_plan(p: Problem, node_cost: np.ndarray, deadline: float, policy: SearchPolicy,
              extractor: Extractor | None = None) -> Extraction:
    """The cheapest plan over the starting points (the estimate, or for deep loops the plan of
    their shallow copy, then each seed), and the same starts again under memory pressure; then the
    exact integer program where the policy runs it; then, unless that proved the plan optimal,
    the standard layout families (p.families) completed as a pinned plan would be, and released,
    within the policy's budget (see _family_starts). `extractor`: reuse one built for the same
    graph and costs."""
    if not p.roots:  # nothing to compute: no array results, no effects
        empty = Extraction(choices={}, root_layouts=[], total_s=0.0, method=policy.method, seconds=0.0)
        empty.gap = 0.0
        return empty
    t0 = time.perf_counter()
    ex = extractor or Extractor(p.graph, node_cost, p.value_space, p.spaces, p.edges, p.model,
                                describe=p.describe, combinable=p.combinable, weight=p.weight)
    work = ex.work[0]
    best = _local_search(p, ex, node_cost, deadline, policy)
    if policy.exact:
        best = _exact(p, node_cost, best, deadline, policy.exact_seconds)
    if policy.families and p.families and best.exact_status != "optimal":
        budget = float("inf") if policy.family_share is None else policy.family_share * (ex.work[0] - work)
        best = _family_starts(p, ex, node_cost, best, policy, deadline, budget)
    if policy.regions:
        best = _regions(p, ex, best, deadline)
    best.explainer = ex.explain
    ex.forget_search(everything=extractor is None)
    if best.gap is None and policy.bound:
        best.bound.defer(functools.partial(_lower_bound, p, ex, _frozen(best), policy, ex.work[0] - work), best.total_s)
    best.seconds = time.perf_counter() - t0
    return best


def _regions(p: Problem, ex: Extractor, best: Extraction, deadline: float) -> Extraction:
    """The plan polished by region moves (extract/moves_region.py): where a gathered value's
    readers branch, moving them one at a time or by chains pays a collective at each step (a
    ViT step with data parallelism pinned gathered its classifier head, 134.5 us, against 125.6
    split). Last, on the plan found: inside the starts and families the same moves led the
    path-dependent search elsewhere, better or worse (pressure prices by the best plan so far;
    a GPT step on 8 devices 285.95 -> 287.03 us, a Soft-MoE step on 2x4 94.7 -> 96.0), where
    here a plan only gets cheaper. The integer program's plans carry no state to go on from."""
    if best.state is None or time.perf_counter() >= deadline:
        return best
    polished = ex.regions(best, p.roots, deadline)
    if polished is None or polished.total_s >= best.total_s - EPS:
        return best
    polished.notes = list(best.notes)
    return polished


def _lower_bound(p: Problem, ex: Extractor, best: Extraction, policy: SearchPolicy, worked: int) -> float:
    """The better of the per-value and the split bound: computed when the plan's gap is first
    read (extract/result.py's Bound), from what the search left (`worked` fixes the agreement
    rounds' budget, so the bound is the same whenever it is read)."""
    return max(ex.lower_bound(p.roots), _split(p, ex, best, policy, worked))


def _frozen(ex: Extraction) -> Extraction:
    """The plan as the search returned it, for a bound computed later: the caller may give it
    more roots (api.py) or reprice its choices."""
    choices = {g: replace(ch, steps=list(ch.steps)) for g, ch in ex.choices.items()}
    return Extraction(choices, list(ex.root_layouts), ex.total_s, ex.method, ex.seconds)


def _local_search(p: Problem, ex: Extractor, node_cost: np.ndarray, deadline: float,
                  policy: SearchPolicy) -> Extraction:
    """The starts (estimate or deep-loop start, seeds), polished, then restarted under pressure."""
    small = policy.chain_every_start
    # every starting point gets single-value and space moves; on big graphs chain moves (the
    # expensive part) then continue the most promising POLISHED of them
    runs, starts = _first_runs(p, ex, node_cost, deadline, small)
    if not small:
        ranked = sorted(range(len(runs)), key=lambda i: (runs[i].total_s, i))
        within = POLISH_WITHIN * runs[ranked[0]].total_s
        for i in ranked[:POLISHED]:
            if time.perf_counter() >= deadline or runs[i].total_s > within:
                break
            runs[i] = ex.resume(runs[i], p.roots, deadline=deadline, explain=False)
    first_best = min(range(len(runs)), key=lambda i: runs[i].total_s)
    best = runs[first_best]
    if policy.restarts:
        # every start where each gets chain moves; on bigger graphs only the best one's, polished
        # with chain moves on 3-axis meshes only (2x2x2 llama step 504 -> 331 us, GPT 514 -> 438,
        # ~+7 s); on 2-axis ones without (a 4-layer GPT step d512 on 4x2 976 -> 630 us, its folded
        # 24-layer step 5456 -> 4080; the folded 24-layer d1024 step of benchmarks/scaling.py
        # gains nothing, in ~0.5 s)
        again = starts if small else [starts[first_best]]
        best, _ = _pressure_restarts(p, ex, node_cost, best, again, deadline, polish=policy.polish_restarts)
    return _whole_start(p, ex, best, deadline, small)


def _first_runs(p: Problem, ex: Extractor, node_cost: np.ndarray, deadline: float, small: bool
                ) -> tuple[list[Extraction], list[dict[int, int] | None]]:
    """Each start's first plan (the estimate or the deep-loop start, then each seed) and its seed.
    A greedy start can fail where two consumers demand pending sums of one value over other axes,
    which no one production makes (fuzz seeds 464, 549): that start is skipped, and where none
    took, the whole start (whole demands never conflict) is the first."""
    deep = bool(p.weight.max() >= DEEP_WEIGHT)  # the deep-loop start replaces the estimate
    runs: list[Extraction] = []
    starts: list[dict[int, int] | None] = []  # each run's seed
    for seed in [None, *p.seeds] if not deep else p.seeds:
        if starts and time.perf_counter() >= deadline:
            break
        try:
            runs.append(ex.run(p.roots, deadline=deadline, place_pins=p.place_pins, ties=p.ties, explain=False,
                               chains=small, **({} if seed is None else {"seed": seed})))
        except NoPlanError:
            continue
        starts.append(seed)
    if deep:
        runs.append(_deep_start(p, ex, node_cost, deadline, small))
        starts.append(None)
    if not runs:
        runs.append(_run_whole(p, ex, deadline, small))
        starts.append(None)
    return runs, starts


def _run_whole(p: Problem, ex: Extractor, deadline: float, small: bool) -> Extraction:
    """The local search from every value computed whole (Extractor.run's `whole`)."""
    return ex.run(p.roots, deadline=deadline, place_pins=p.place_pins, ties=p.ties, explain=False,
                  chains=small, whole=True)


def _whole_start(p: Problem, ex: Extractor, best: Extraction, deadline: float, small: bool) -> Extraction:
    """The cheaper of `best` and the plan started from every value computed whole (pins and ties
    kept). No start above is that plan, and the local search from a split one does not reach it:
    moving one value, chain or space whole adds collectives at its neighbours (a scanned layer's
    gradient on 2x4 stayed at 20.5 us, with two collectives, beside 0.66 us whole). Last, so
    that it changes no start above (pressure prices by the best plan so far)."""
    if time.perf_counter() >= deadline:
        return best
    try:
        run = _run_whole(p, ex, deadline, small)
    except NoPlanError:  # no whole plan within the pins
        return best
    if not small and run.total_s <= POLISH_WITHIN * best.total_s and time.perf_counter() < deadline:
        run = ex.resume(run, p.roots, deadline=deadline, explain=False)
    if run.total_s < best.total_s - EPS:
        run.notes.append("started from every value whole")
        return run
    return best


def _deep_start(p: Problem, ex: Extractor, node_cost: np.ndarray, deadline: float, small: bool) -> Extraction:
    """Deep loops: the body's weight swamps everything else and the estimate settles in a poorer
    body than a shallower copy of the same loop finds: the estimate's starting point is the plan
    of the loop with its repeat counts capped, improved with the true ones."""
    w_node = p.weight[p.graph.class_group[p.graph.node_class]]
    capped = node_cost / w_node * np.minimum(w_node, SHALLOW_WEIGHT)
    shallow = ex.with_costs(capped, np.minimum(p.weight, SHALLOW_WEIGHT))
    first = shallow.run(p.roots, deadline=deadline, place_pins=p.place_pins, ties=p.ties, explain=False,
                        chains=False)
    return ex.resume(first, p.roots, deadline=deadline, explain=False, chains=small)


def _exact(p: Problem, node_cost: np.ndarray, best: Extraction, deadline: float, seconds: float) -> Extraction:
    """The integer program, seeking plans cheaper than `best` (no roots: the empty plan is exact,
    and HiGHS takes no problem of zero variables)."""
    if p.graph.unbuilt_nodes:
        raise ValueError("the exact extractor needs the resharding e-nodes: export(reshard=True)")
    limit = min(seconds, deadline - time.perf_counter())
    if limit <= 0.1:
        return best
    group_space = p.graph.group_spaces(p.value_space)
    partial = {i for i, lay in enumerate(p.spaces.layouts.layouts) if lay.partial}
    res = solve_exact(p.graph, node_cost, group_space, p.model, p.combinable, p.roots, p.place_pins,
                      p.ties, partial, limit, weight=p.weight, incumbent=best.total_s)
    if res.extraction is not None and res.extraction.total_s < best.total_s - 1e-12:
        best = res.extraction
        best.notes.append(f"exact ILP improved the greedy plan; {res.status}")
    best.gap = res.gap if res.extraction is not None and best is res.extraction else (
        0.0 if res.status == "optimal" else None)
    best.exact_status = res.status
    return best


def _family_starts(p: Problem, ex: Extractor, node_cost: np.ndarray, best: Extraction, policy: SearchPolicy,
                   deadline: float, budget: float) -> Extraction:
    """Each standard family (extract/families.py) planned as a user's pinned plan would be (the
    same search with its arguments pinned), then released: moved freely from there. A pinned
    layout lies inside the free search space, yet the local search from the free starts can
    settle in a worse basin (a GPT step on 2x4: 2,746 us free, 1,994 us pinned replicated); from
    a family's completion it reaches plans no free start does (a 2x2x2 MLP step 232 -> 214 us
    from FSDP + TP). Small e-graphs complete and release every family in full (`budget` is
    infinite); bigger ones the replicated family in full, and every family by the cheaper
    completions of _pressed_families within `budget` moves (Extractor.work: a count, so that the
    plan does not depend on the machine's speed), the policy's cheapest few of them then polished
    with chain moves; where data parallelism cannot use every device, the cheapest
    tensor-parallel family by pressure is also completed in full (_tensor_parallel), where it
    can, data parallelism over every axis (pressure ranked it third of four on a 3-layer GPT step
    on 8 devices: 2,590 us released, its full completion 2,475 pinned, the free plan 2,483 without
    it), and where the policy says, tensor parallelism over the whole mesh (pressure ranks it last)."""
    families, origin = p.families, None
    # replicated in full, released whatever its pinned cost: replicated pins cost most and
    # released do best (conv nets, the 4x2 Soft-MoE step); pressure alone would shard what a
    # small program keeps whole
    every = budget == float("inf")
    full = families if every else families[:1]
    for fam in full:
        if time.perf_counter() >= deadline:
            break
        best, origin = _release(p, ex, best, origin, fam, _pinned(p, ex, node_cost, fam, policy, deadline), deadline)
    if not every:
        # the whole-mesh TP family is not ranked by pressure: ranked first, it took the one polish
        # from the family that wins (MLP4 train on 2x2x2: 213.9 -> 232.2 us)
        pressed = [f for f in families if not f.whole_mesh]
        done = _pressed_families(p, ex, node_cost, best, pressed, deadline, budget, uncharged=len(full))
        ranked = sorted(done, key=lambda d: d[1].total_s)
        for fam, freed in ranked[:policy.family_released]:
            if time.perf_counter() >= deadline:
                break
            best, origin = _cheaper(best, origin, fam, freed, ex.resume(freed, p.roots, deadline=deadline, explain=False))
        wide = (_tensor_parallel(ranked, p.tensor_axis) if p.tensor_axis is not None
                else next((f for f in families if f.name == p.data_parallel), None))
        if wide is not None and time.perf_counter() < deadline:
            pinned = _pinned(p, ex, node_cost, wide, policy, deadline)
            best, origin = _release(p, ex, best, origin, wide, pinned, deadline)
        # last, so that it changes no start of the above (they price by the best plan so far)
        for fam in [f for f in families if f.whole_mesh and policy.whole_tp_in_full]:
            if time.perf_counter() < deadline:
                best, origin = _release(p, ex, best, origin, fam, _pinned(p, ex, node_cost, fam, policy, deadline),
                                        deadline)
    if origin is not None:
        best.notes.append(f"started from the {origin} layout family")
        best.gap = best.exact_status = None  # they were of another plan
    return best


def _tensor_parallel(ranked: list[tuple[Family, Extraction]], axis: str) -> Family | None:
    """The tensor-parallel family to complete in full as well (where data parallelism cannot use
    every device): the cheapest by its pressure completion over `axis` (families.tensor_axis),
    else over any axis. Pressure prices bytes, and a tensor-parallel plan needs the chain moves
    its pressure completion is made without, so pressure ranks these families last where they
    win (a 4-layer llama step, batch 32, on 4x4x4: FSDP + TP 795-853 us pressed, 592-606 pinned
    in full; ZeRO-1's 721-749 pressed, 774-878 pinned; the free plan 686 -> 572 us), and among
    axes of one speed it picks by noise (a GPT step on 4x4x4: tp over the middle axis polished
    to 606 us, over the minor one pinned 582). Done even where a pressed TP family is among the
    polished ones: polishing does not reach what the full completion does. Where the batch fills
    the mesh they never won (the experts benchmark's 8 devices: 0 of 17 cases); data parallelism
    over every axis is completed in full there instead."""
    tensor = [fam for fam, _ in ranked if fam.tensor_parallel]
    return next((fam for fam in tensor if fam.tensor_axis == axis), tensor[0] if tensor else None)


def _release(p: Problem, ex: Extractor, best: Extraction, origin: str | None, fam: Family,
             pinned: Extraction | None, deadline: float) -> tuple[Extraction, str | None]:
    """The cheaper of `best` and the family's completion, pinned or released."""
    if pinned is None:
        return best, origin
    freed = ex.release(pinned, p.roots, deadline, p.place_pins, p.ties) if pinned.state else pinned
    return _cheaper(best, origin, fam, pinned, freed)


def _cheaper(best: Extraction, origin: str | None, fam: Family, *candidates: Extraction
             ) -> tuple[Extraction, str | None]:
    """The cheapest of `best` and a family's plans (by more than EPS), and the family it started from."""
    for cand in candidates:
        if cand.total_s < best.total_s - EPS:
            best, origin = cand, fam.name
    return best, origin


def _pinned(p: Problem, ex: Extractor, node_cost: np.ndarray, fam: Family, policy: SearchPolicy,
            deadline: float) -> Extraction | None:
    """The family's completion as a pinned plan's search would make it; None where its pins
    leave an output no layout (fuzz seed 451). The problem's own pins win (fuzz seed 829);
    greedy: where the integer program runs, it has searched the free plans already (and its
    plans carry no extractor state to release)."""
    try:
        return best_plan(replace(p, place_pins=_family_pins(p, fam), seeds=[]), node_cost, deadline,
                         policy.greedy(bound=False), extractor=ex)
    except NoPlanError:
        return None


def _pressed_families(p: Problem, ex: Extractor, node_cost: np.ndarray, best: Extraction, families: list[Family],
                      deadline: float, budget: float, uncharged: int = 0) -> list[tuple[Family, Extraction]]:
    """The families in their order of promise, each completed by the pressure restart alone
    (the step of a pinned plan's search that makes its plan: a 3-layer GPT step on 2x4, every
    family within 0.7% of its full completion, in 10k moves instead of 36k) and released, both
    without chain moves (on 2x2x2 they cost ~30k moves a family for a few tenths of a percent;
    the release, ~2k, ranks the families as they end: a 4-layer GPT step on 2x2x2, replicated
    4,570 -> 4,464 us, zero1(data,model) 4,556 -> 4,541), while the work stays within `budget`
    moves. The first `uncharged` families' are not counted: completed in full already, they
    are ranked with the others too (the replicated family's pressure completion, released, is
    the best start of that GPT step; its full completion, released, ends at 4,943)."""
    pressed = _pressed(p, ex, node_cost, best)
    if pressed is None:
        return []
    out: list[tuple[Family, Extraction]] = []
    start = ex.work[0]
    for k, fam in enumerate(families):
        if k == uncharged:
            start = ex.work[0]
        # the next family starts while the budget lasts (the last may overrun it: one whose
        # completion just misses it was the best start of a 3-layer GPT step on 2x4)
        if time.perf_counter() >= deadline or (k > uncharged and ex.work[0] - start >= budget):
            break
        try:
            first = pressed.run(p.roots, deadline=deadline, place_pins=_family_pins(p, fam), ties=p.ties,
                                explain=False, chains=False)
        except NoPlanError:
            continue
        done = ex.resume(first, p.roots, deadline=deadline, explain=False, chains=False)
        out.append((fam, ex.release(done, p.roots, deadline, p.place_pins, p.ties, chains=False)))
    return out


def _pressure_restarts(p: Problem, ex: Extractor, node_cost: np.ndarray, best: Extraction,
                       starts: list[dict[int, int] | None], deadline: float,
                       polish: bool = True) -> tuple[Extraction, float]:
    """The starts again with every byte the plan holds priced (arguments, and intermediates at a
    quarter, per run of a loop body: the pressure is on work as much as on memory), each then
    improved at the true costs (`polish`: with chain moves); the cheapest plan of all. The local search
    settles in plans that compute much redundantly (whole forward passes replicated) and cannot
    leave them one value, chain or tensor space at a time; pressure towards small per-device
    arrays starts it in the partitioned basin instead. GPT step on 8 devices in a row: 471 ->
    329 us; on 4x2 387 -> 351 (pinned FSDP + TP 381); llama step on 4x2 405 -> 321, on 2x4
    337 -> 322."""
    spent = 0.0
    if not starts:
        return best, spent
    pressed = _pressed(p, ex, node_cost, best)
    if pressed is None:
        return best, spent
    for seed in starts:
        if time.perf_counter() >= deadline:
            break
        try:
            start = pressed.run(p.roots, deadline=deadline, place_pins=p.place_pins, ties=p.ties, explain=False,
                                chains=False, **({} if seed is None else {"seed": seed}))
        except NoPlanError:  # the greedy start's demands met no one production (fuzz seeds 464, 549)
            continue
        done = ex.resume(start, p.roots, deadline=deadline, explain=False, chains=polish)
        spent += start.seconds + done.seconds
        if done.total_s < best.total_s - EPS:
            best = done
    return best, spent


def _family_pins(p: Problem, fam: Family) -> dict[int, frozenset[int]]:
    """The family's argument pins under the problem's own: a user's pin wins (fuzz seed 829)."""
    return {**fam.pins, **p.place_pins}


def _pressed(p: Problem, ex: Extractor, node_cost: np.ndarray, best: Extraction) -> Extractor | None:
    """An extractor pricing every byte `best` holds per device (arguments, intermediates per run
    of a loop body) at PRESSURE times its step time per byte; None where `best` holds nothing or
    costs nothing, so there is no scale to price by."""
    weights = node_bytes(p, per_run=True)
    held = sum(float(weights[ch.node]) for ch in best.choices.values())
    if held <= 0 or not best.total_s > 0:
        return None
    return ex.with_costs(node_cost + PRESSURE * best.total_s / held * weights, p.weight)


def _split(p: Problem, ex: Extractor, best: Extraction, policy: SearchPolicy, worked: int) -> float:
    """The split bound, raised by agreement prices (extract/agreement.py) for a share of the
    work the search did (`worked`: Extractor.work); 0.0 where the policy computes the per-value
    bound alone."""
    if not policy.split_bound:
        return 0.0
    pins = p.place_pins or {}
    rounds = split_rounds(ex.graph, p.roots, p.ties, pins, best)
    evaluations = policy.agreement_share * worked / AGREEMENT_GROUP_WORK
    return agreed_bound(ex.graph, p.roots, rounds, best.total_s, evaluations)


def node_bytes(p: Problem, per_run: bool = False) -> np.ndarray:
    """Bytes per device each e-node holds: a placed argument its shard, a local op's result a
    quarter of its shard (ACTIVATION_WEIGHT), once however often a scan body runs it, or with
    `per_run` once per run. Computed once per problem (the pressure restarts ask each time)."""
    hit = p.held_bytes.get(per_run)
    if hit is None:
        hit = p.held_bytes[per_run] = _node_bytes(p, per_run)
    return hit


def _node_bytes(p: Problem, per_run: bool) -> np.ndarray:
    g = p.graph
    out = np.zeros(g.num_nodes)
    kinds = np.asarray(g.node_kind)
    groups = np.asarray(g.class_group)[g.node_class]
    spaces = np.asarray(g.group_spaces(p.value_space), dtype=np.int64)[groups]
    place, local = kinds == NodeKind.PLACE, kinds == NodeKind.LOCAL
    held = np.flatnonzero((spaces >= 0) & (place | local))
    lays = np.where(place, g.node_b, np.asarray(g.class_layout)[g.node_class])[held]
    pairs, at = np.unique(np.stack([spaces[held], lays]), axis=1, return_inverse=True)
    shard = np.array([p.spaces.shard_bytes(p.spaces.spaces[sp], lay) for sp, lay in pairs.T.tolist()], dtype=float)
    size = shard[at.reshape(-1)]
    is_place = place[held]
    out[held[is_place]] = size[is_place]
    per = np.ones(len(held)) if per_run else np.asarray(p.weight, dtype=float)[groups[held]]
    out[held[~is_place]] = ACTIVATION_WEIGHT * size[~is_place] / per[~is_place]
    return out


class MemoryNotMetError(NoPlanError):
    """No plan found fits the memory limit; carries the smallest one found."""

    def __init__(self, smallest: Extraction, memory: MemoryEstimate, message: str,
                 others: Sequence[tuple[Extraction, MemoryEstimate]] = ()) -> None:
        super().__init__(message)
        self.smallest = smallest
        self.memory = memory
        # the next smallest distinct plans found, smallest first: where the estimate errs
        # differently by plan, one of them may compile smaller than `smallest`
        self.others = list(others)


def fit_memory(
    p: Problem,
    first: Extraction,
    limit: int,
    estimate: Callable[[Extraction], MemoryEstimate],
    deadline: float,
    policy: SearchPolicy,
    steps: int = 14,
) -> tuple[Extraction, MemoryEstimate]:
    """The cheapest plan found whose memory estimate is within `limit` bytes per device: plans
    under node costs plus a price per byte held, the price raised 4x until one fits."""
    mem = estimate(first)
    if mem.total <= limit:
        return first, mem
    weights = node_bytes(p)
    pressed = policy.greedy(restarts=False, bound=False)  # _reprice drops a pressed plan's bound
    tried: list[tuple[float, Extraction, MemoryEstimate]] = []

    def at(lam: float) -> tuple[Extraction, MemoryEstimate]:
        ex = _reprice(best_plan(p, p.node_cost + lam * weights, deadline, pressed), p.node_cost)
        tried.append((lam, ex, estimate(ex)))
        return ex, tried[-1][2]

    lam = first.total_s / max(mem.total, 1)
    for _ in range(steps):
        if time.perf_counter() >= deadline:
            break
        if at(lam)[1].total <= limit:
            break
        lam *= 4.0
    fit = _fitting(tried, limit) or _between(at, tried, limit, deadline)
    if fit is None:
        # the plan with no pressure too: pressure by the per-node proxy can make every plan larger
        (smallest, m), *others = _smallest_distinct([(0.0, first, mem), *tried])
        raise MemoryNotMetError(smallest, m,
            f"No plan fits memory_limit={limit:,} bytes per device. The smallest plan found needs "
            f"{m.total:,} bytes ({m.parts()}). Consider a larger mesh, a smaller batch, or memory_limit >= that.",
            others)
    ex, m, hi = fit
    low = max((t[0] for t in tried if t[0] < hi and t[2].total > limit), default=0.0)
    for _ in range(3):  # a cheaper plan may fit with less pressure
        if time.perf_counter() >= deadline or hi <= low * 1.01:
            break
        mid = (low * hi) ** 0.5 if low > 0 else hi / 4
        cand, cm = at(mid)
        if cm.total <= limit:
            hi = mid
            if cand.total_s < ex.total_s:
                ex, m = cand, cm
        else:
            low = mid
    # a bound without the memory limit bounds plans within it (computed when either gap is read)
    ex.bound.defer(lambda: first.lower_bound_s, ex.total_s)
    return ex, m


def _smallest_distinct(tried: list[tuple[float, Extraction, MemoryEstimate]],
                       n: int = 3) -> list[tuple[Extraction, MemoryEstimate]]:
    """The `n` smallest plans tried, by estimate, one per (estimate, step time)."""
    out: dict[tuple[int, float], tuple[Extraction, MemoryEstimate]] = {}
    for _, ex, m in sorted(tried, key=lambda t: t[2].total):
        out.setdefault((m.total, ex.total_s), (ex, m))
    return list(out.values())[:n]


def _fitting(tried: list[tuple[float, Extraction, MemoryEstimate]],
             limit: int) -> tuple[Extraction, MemoryEstimate, float] | None:
    """The first plan tried that fits, with its price per byte."""
    return next(((ex, m, lam) for lam, ex, m in tried if m.total <= limit), None)


def _between(at: Callable[[float], tuple[Extraction, MemoryEstimate]],
             tried: list[tuple[float, Extraction, MemoryEstimate]], limit: int,
             deadline: float) -> tuple[Extraction, MemoryEstimate, float] | None:
    """Where no price 4x apart fit: prices between them, around the smallest plan's. The bytes
    a price buys are not monotone in it (more pressure can choose worse layouts by the search's
    per-node proxy), so a plan smaller than every one on the ladder can lie between two rungs."""
    if not tried:
        return None
    lam0 = min(tried, key=lambda t: t[2].total)[0]
    for t in (0.5, -0.5, 0.25, -0.25, 0.75, -0.75):
        if time.perf_counter() >= deadline:
            break
        lam = lam0 * 4.0 ** t
        ex, m = at(lam)
        if m.total <= limit:
            return ex, m, lam
    return None


__all__ = ["MemoryNotMetError", "Problem", "best_plan", "fit_memory"]
