"""saturate_and_extract: trace -> layout e-graph -> saturate -> extract -> Plan."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from egglog import Ruleset
from jax.sharding import Mesh

from .checks import known_keywords, require_mesh
from .egraph.export import ExportedGraph, export
from .egraph.layout import MeshAxes, SpaceTable
from .egraph.narrow import narrow_spaces
from .egraph.program import Literal, Program
from .egraph.rewrite import Rewrite
from .egraph.run import EGraphRun, SaturationReport
from .errors import (
    ConstraintWarning,
    FallbackWarning,
    InvalidArgumentError,
    InvalidMeshError,
    MemoryLimitWarning,
    NoPlanError,
    ShardsatWarning,
    StoppedEarlyError,
    warn_user,
)
from .extract.cost import CostModel
from .extract.families import data_parallel_fills, families, family_layouts, tensor_axis, widest_data_parallel
from .extract.memory import MemoryEstimate, MemoryModel
from .extract.plancost import cost_plan
from .extract.policy import (
    MANY_AXES,
    NARROW_PAIRS,
    NARROW_PAIRS_MANY_AXES,
    NARROW_WIDTH,
    PRIOR_MASS,
    PRIOR_PAIRS,
    SearchPolicy,
    exact_method,
    runs_exact,
)
from .extract.prior import fingerprint as prior_fingerprint
from .extract.prior import learned_layouts
from .extract.prior import resolve as resolve_prior
from .extract.profile import DeviceProfile, get_profile
from .extract.propagate import propagated_layouts
from .extract.result import Extraction
from .extract.search import MemoryNotMetError, Problem, best_plan, fit_memory
from .extract.seeds import seeds
from .extract.structure import combinable_groups
from .fitting import Fitting, fit
from .limits import Limits, StopReason
from .options import FALLBACKS as FALLBACKS  # re-exported: it was defined here
from .options import check_options, memory_limit_problem, multihost_problem, profile_axes_unknown
from .pins import check_tied_pins, example_pins, resolve_pins, resolve_ties, unkept_pins
from .prepare import FOLD_AUTO_EQUATIONS as FOLD_AUTO_EQUATIONS  # re-exported: it was defined here
from .prepare import Prepared, prepare
from .prepare import fold_threshold as fold_threshold
from .progress import Progress
from .rules.apply import Fallback, RuleTables, build_tables, grow
from .runtime.jsonout import to_json
from .runtime.multihost import agree, share_plan, spans_processes
from .runtime.plan import Plan, Report
from .runtime.record import Origin, decisions, digest
from .saved import cache_key, cache_path, load_cached, plan_from_data, save_cached
from .threads import PLANNING


@dataclass(frozen=True)
class _Request:
    """saturate_and_extract's arguments, checked, with the profile resolved."""

    fn: Callable[..., Any]
    mesh: Mesh
    example_args: tuple[Any, ...]
    profile: DeviceProfile
    limits: Limits
    fallback: str
    rules: Sequence[Ruleset | Rewrite]
    in_shardings: Any
    out_shardings: Any
    state_argnums: Any
    memory_limit: int | str | None
    extraction: str
    progress: bool | None
    fold_loops: bool | None
    priors: str | None

    def cache_key(self, prepared: Prepared) -> str:
        return cache_key(prepared.fingerprint.digest, self.mesh, self.profile, limits=self.limits,
                         fallback=self.fallback, rules=self.rules, in_shardings=self.in_shardings,
                         out_shardings=self.out_shardings, state_argnums=self.state_argnums,
                         memory_limit=self.memory_limit, extraction=self.extraction, fold_loops=self.fold_loops,
                         priors=self.priors if self.priors in ("auto", "families", None) else prior_fingerprint(self.priors))


def _axis_name_problem(name: Any) -> str | None:
    """Why no plan can shard over an axis of this name (None where it can)."""
    if not isinstance(name, str):
        return f"of type {type(name).__name__}, not a string (jax shards over string-named axes only)"
    if not name:
        return "empty (jax's shard_map reads an empty name in a spec as no axis)"
    if not name.isascii() or "\\" in name:
        return ("not ASCII or holding a backslash: XLA aborts the whole process on such names when it compiles "
                "(jax.jit too, in its HLO text's unescaping)")
    return None


def _check_entry(mesh: Any, multihost: str) -> None:
    require_mesh(mesh, "saturate_and_extract")
    bad = {n: why for n in mesh.axis_names if (why := _axis_name_problem(n))}
    if bad:
        raise InvalidMeshError(
            "saturate_and_extract: mesh axis name(s) "
            + "; ".join(f"{n!r}: {why}" for n, why in bad.items())
            + ". Consider short ASCII names, e.g. jax.make_mesh((2, 4), ('data', 'model')).")
    bad = multihost_problem(multihost)
    if bad:
        raise InvalidArgumentError(f"saturate_and_extract: {bad}")


@known_keywords
def saturate_and_extract(
    fn: Callable[..., Any],
    mesh: Mesh,
    *example_args: Any,
    profile: DeviceProfile | str | None = None,
    limits: Limits | None = None,
    fallback: str | None = None,
    rules: Sequence[Ruleset | Rewrite] = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
    state_argnums: Any = None,
    memory_limit: int | str | None = "device",
    extraction: str = "auto",
    progress: bool | None = None,
    fold_loops: bool | None = None,
    strict: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    multihost: str = "check",
    priors: str | None = "auto",
) -> Plan:
    """Plan how to shard `fn(*example_args)` over `mesh`.

    example_args: arrays or `jax.ShapeDtypeStruct`s, any pytrees (what `fn` will be called with);
      a struct's NamedSharding on `mesh` pins that argument (unless in_shardings says otherwise).
    profile: a DeviceProfile, a preset name ("h100", "h200", "tpu_v5e", "cpu") or the path of a
      saved profile (`DeviceProfile.calibrate(mesh).save(path)`); default: the platform's preset.
    limits: bounds on the search (`shardsat.Limits`); the plan's report says which one stopped it.
    fallback: "replicate" (the default) keeps an equation no sharding rule applies to replicated:
      the plan lists it (`plan.report.fallbacks`, `plan.explain()`) and a
      shardsat.FallbackWarning names it; "error" raises UnsupportedPrimitiveError instead.
    strict: the same as fallback="error" (for people writing rules).
    rules: algebraic identities (`shardsat.Rewrite(name, lhs, rhs, example_args)`: each match
      of lhs in the program gets rhs as an alternative computation, chosen if cheaper when
      sharded) and extra egglog rulesets saturated with the built-in ones.
    in_shardings / out_shardings: optional pins, pytree prefixes of the arguments (a tuple, one
      entry per positional argument) and of the output, with PartitionSpec / NamedSharding leaves
      as hard constraints and None leaves left free.
    state_argnums: positional arguments that are loop-carried state (parameters, optimizer
      state): each comes back as an output subtree of the same structure and keeps one layout in
      and out, so `plan.jit()` can run in a loop with no resharding between steps; their buffers
      are donated. "auto" ties every argument that comes back.
    memory_limit: bytes per device as XLA allocates them (`plan.cost.memory.total` estimates it;
      plans near the limit are compiled and checked, see fitting.py); raises NoPlanError naming the
      smallest plan found if none fits. "device" (the default): the profile's `memory_bytes` (H100: 60 GB,
      JAX's default 75% of HBM), where no fitting plan gives the smallest one found and a
      shardsat.MemoryLimitWarning instead of an error; None: no limit.
    extraction: "greedy" (DAG-aware greedy with exact local moves), "exact" (also the integer
      program, within the time limit; the report gives its optimality gap) or "auto" (the
      integer program on small e-graphs only).
    progress: a progress line for searches over ~2 s (default: when stderr is a terminal).
    fold_loops: plan the repeats of an unrolled loop (identical layers) once, as a scan, and run
      them as one (see egraph/fold.py); False plans and runs every repeat separately; None (the
      default) folds programs of fold_threshold(mesh) equations or more (3000 on a mesh of two
      axes, twice that on one, half on three).
    cache_dir: a folder of saved plans: a plan saved there for the same program, mesh, profile
      and options is loaded (no saturation, no extraction; `plan.report.loaded_from` says so),
      else the new plan is saved there (`plan.save`).
    multihost: on a mesh whose devices span several processes (`jax.distributed`): "check" (the
      default) plans in every process and compares the plans' fingerprints, raising a
      ShardsatError if they differ (instead of running different programs, which hangs); "share"
      plans in process 0 only and the others load its plan. Every process must call this.
    priors: "auto": narrow each value's layouts to the standard families' where the e-graph is too
      big (plan.report.narrowed); "families": always; "builtin" or a weights file: always, to a
      learned prior's best (extract/prior.py); None: never.
    """
    with PLANNING, _collector_paused():
        _check_entry(mesh, multihost)
        plan_here = functools.partial(
            _plan_checked, fn, mesh, example_args, cache_dir, strict, profile=profile, limits=limits,
            fallback=fallback, rules=rules, in_shardings=in_shardings, out_shardings=out_shardings,
            state_argnums=state_argnums, memory_limit=memory_limit, extraction=extraction, progress=progress,
            fold_loops=fold_loops, priors=priors)
        # several processes: every one of them must reach the exchange, also with an error
        if not spans_processes(mesh):
            return plan_here()
        if multihost == "share":
            return share_plan(plan_here, to_json,
                              lambda text: plan_from_data(json.loads(text), fn, mesh, example_args, rules=rules,
                                                          source="process 0's plan"))
        return agree(plan_here, lambda plan: digest(decisions(plan)))


def _plan_checked(fn: Callable[..., Any], mesh: Mesh, example_args: tuple[Any, ...],
                  cache_dir: str | os.PathLike[str] | None, strict: Any, *, profile: Any, limits: Any, fallback: Any,
                  rules: Any, **options: Any) -> Plan:
    """Check the options (all of them, reported together), then plan or load from cache_dir."""
    if not isinstance(strict, bool):
        raise InvalidArgumentError(f"strict must be True or False, got {strict!r}.")
    mode = "error" if strict else fallback or "replicate"
    options["in_shardings"] = example_pins(example_args, options.get("in_shardings"), mesh)
    check_options(fn, mesh, example_args, profile=profile, limits=limits, fallback=mode, rules=rules,
                  cache_dir=cache_dir, **options)
    if isinstance(options.get("priors"), os.PathLike):
        options["priors"] = os.fspath(options["priors"])
    req = _Request(fn, mesh, example_args, get_profile(profile, mesh.devices.flat[0].platform), limits or Limits(),
                   mode, rules, **options)
    if unknown := profile_axes_unknown(req.profile, mesh):
        warn_user(unknown, ShardsatWarning)
    return _plan_cached(req, cache_dir)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Tracing and planning make millions of small objects that live to the end of the call;
    Python's cyclic collector kept re-scanning them (a fifth of a 96-layer GPT plan's time) and
    freed almost nothing: peak memory is the same without it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan_cached(req: _Request, cache_dir: str | os.PathLike[str] | None) -> Plan:
    """Trace, then load the plan saved in `cache_dir` for this program and these options, or
    plan (and save the plan there)."""
    start = time.perf_counter()
    shown = Progress(req.progress)
    prepared = prepare(req.fn, req.mesh, req.example_args, req.rules, req.fold_loops,
                       on_traced=lambda n: shown.update("traced", f"{n} equations"))
    pins = unkept_pins(prepared.program, req.example_args, req.in_shardings, req.out_shardings)
    prepared = replace(prepared, unkept=tuple(dict.fromkeys([*prepared.unkept, *pins])))
    if prepared.unkept:
        warn_user(f"shardsat drops {len(prepared.unkept)} pin(s) or sharding constraint(s) of "
                  f"`{prepared.program.name}` that no plan on this mesh can keep:\n  " + "\n  ".join(prepared.unkept)
                  + ("\nConsider constraining with a PartitionSpec of this mesh's axes, listed in its order, over "
                     "dimensions they divide."
                     if any(u not in pins and "PRNG key" not in u for u in prepared.unkept) else ""),
                  ConstraintWarning)
    if cache_dir is None:
        return _plan(req, prepared, start, shown)
    key = req.cache_key(prepared)
    path = cache_path(cache_dir, prepared.program.name, key)
    loaded = load_cached(path, req.fn, req.mesh, req.example_args, prepared, req.rules)
    if loaded is not None:
        shown.close()
        return loaded
    plan = _plan(req, prepared, start, shown)
    plan.origin = replace(plan.origin, options_key=key)  # type: ignore[arg-type]
    save_cached(plan, path)
    return plan


def _plan(req: _Request, prepared: Prepared, start: float, shown: Progress) -> Plan:
    """Plan; where a prior narrowed the layouts and the narrowed e-graph holds no plan (or none
    within memory_limit), plan again with every layout; where priors="auto" left them whole and
    saturation stopped at a limit with no plan, plan again narrowed (a folded 4-layer GPT step
    on 2x2x2x2: 392k (value, layout) pairs, under the threshold, 6.9 M e-nodes at the limit)."""
    try:
        return _plan_in(req, prepared, start, shown)
    except NoPlanError as first:
        rulesets = [r for r in req.rules if not isinstance(r, Rewrite)]
        spaces = SpaceTable(MeshAxes.from_mesh(req.mesh))
        if _narrows(req, prepared.program, spaces, rulesets):
            again = replace(req, priors=None)
        elif req.priors == "auto" and isinstance(first, StoppedEarlyError) and _narrows(
                replace(req, priors="families"), prepared.program, spaces, rulesets):
            again = replace(req, priors="families")
        else:
            raise
        try:
            return _plan_in(again, prepared, start, shown)
        except NoPlanError:  # the other e-graph has none either (or passes a limit): say why the first failed
            raise first from None


def _plan_in(req: _Request, prepared: Prepared, start: float, shown: Progress) -> Plan:
    limits, prof, program = req.limits, req.profile, prepared.program
    limit = _memory_limit(req.memory_limit, prof)
    deadline = start + limits.seconds
    spaces = SpaceTable(MeshAxes.from_mesh(req.mesh))
    arg_pins, out_pins = resolve_pins(program, spaces, req.in_shardings, req.out_shardings, program.name)
    tie_pairs = resolve_ties(program, req.state_argnums, program.name)
    check_tied_pins(program, spaces, arg_pins, out_pins, tie_pairs, program.name)
    graph, tables, sat, value_space, method, skipped = _saturate(req, program, spaces, deadline, shown, tie_pairs,
                                                                 _pinned(program, arg_pins, out_pins))
    t1 = time.perf_counter()
    policy = SearchPolicy.derive(method, graph.size, len(spaces.mesh.active), limits.exact_seconds)
    model = CostModel(prof, spaces, tables)
    problem, node_cost, full_roots = _problem(program, graph, spaces, tables, model, value_space, arg_pins,
                                              out_pins, tie_pairs, policy)

    # one model per planned program: its liveness structure is built once for every plan priced
    memory_model = MemoryModel(program, graph, spaces, ties=tuple(tie_pairs), pins=arg_pins, tables=tables)

    def memory_of(ex: Extraction) -> MemoryEstimate:
        return memory_model.estimate(full_roots(ex))

    shown.update("extracting", f"{graph.num_classes:,} e-classes, {graph.size:,} e-nodes")

    free: list[Extraction] = []  # the search's plan with no limit: searched once, whatever bounds are tried

    def unbounded() -> Extraction:
        if not free:
            free.append(full_roots(best_plan(problem, node_cost, deadline, policy)))
        return free[0]

    def plan_of(extraction: Extraction, memory: MemoryEstimate | None) -> Plan:
        extraction = full_roots(extraction)
        report = _report(prepared, sat, graph, tables, extraction, skipped, time.perf_counter() - t1, deadline)
        costed = cost_plan(program, graph, spaces, tables, extraction, model=model, arg_pins=arg_pins,
                           ties=tie_pairs, memory=memory)
        return Plan(fn=req.fn, program=program, mesh=req.mesh, spaces=spaces, tables=tables, graph=graph,
                    costed=costed, profile=prof, report=report, arg_pins=arg_pins,
                    ties=tie_pairs, state_argnums=_argnums_of(program, [a for a, _ in tie_pairs]),
                    origin=Origin(prepared.fingerprint, prepared.folded, prepared.rewrites))

    def plan_within(bound: int | None) -> Plan:
        return plan_of(*_extract(req, policy, problem, unbounded, full_roots, memory_of, bound, deadline, sat))

    if limit is None:
        plan = plan_within(None)
    else:
        plan = fit(Fitting(limit, req.example_args, req.memory_limit == "device", prof.name, plan_within, plan_of,
                           lambda: memory_of(unbounded()).total))
    shown.update("done", f"{plan.extraction.total_s * 1e6:,.1f} us predicted")
    shown.close()
    if limit is not None and plan.cost.memory is not None:
        plan.report.memory_limit = limit
        plan.report.memory_headroom = limit - plan.cost.memory.total
    return plan


def _report(prepared: Prepared, sat: SaturationReport, graph: ExportedGraph, tables: RuleTables,
            extraction: Extraction, skipped: str | None, extraction_s: float, deadline: float) -> Report:
    stop = sat.stop_reason
    if time.perf_counter() > deadline and stop == StopReason.SATURATED:
        stop = StopReason.TIME_LIMIT
    return Report(
        e_classes=graph.num_classes,
        e_nodes=sat.nodes,
        iterations=sat.iterations,
        saturation_s=sat.seconds,
        extraction_s=extraction_s,
        stop_reason=stop,
        trace_s=prepared.trace_s,
        rules_s=sat.load_seconds,
        method=extraction.method,
        sweeps=extraction.sweeps,
        bound=extraction.bound,
        exact_status=extraction.exact_status or skipped,
        equations=len(prepared.program.equations),
        fallbacks=[str(f) for f in tables.fallbacks],
        unkept=list(prepared.unkept),
        narrowed=sat.narrowed,
    )


def _saturate(req: _Request, program: Program, spaces: SpaceTable, deadline: float, shown: Progress,
              tie_pairs: list[tuple[int, int]], pinned: dict[int, frozenset[int]],
              ) -> tuple[ExportedGraph, RuleTables, SaturationReport, list[int], str, str | None]:
    """The rule tables, the saturated e-graph exported for extraction, each value's space, the
    extraction method the e-graph allows, and why the exact integer program will not run where
    it was asked for (None if it will). `pinned`: the layouts pins allow each value, which a
    prior never leaves out."""
    method = req.extraction
    rulesets = [r for r in req.rules if not isinstance(r, Rewrite)]
    base, narrowed, t0 = None, 0, time.perf_counter()
    prior = _prior_kind(req, program, spaces, rulesets)
    if prior is not None:
        base = build_tables(program, spaces, req.fallback, edges=False)
        keep = _prior_layouts(prior, program, spaces, base, tie_pairs, req.profile, shown)
        for vid, lids in pinned.items():
            keep[vid].update(lids)
        narrowed = narrow_spaces(program, spaces, keep, _together(program, tie_pairs))
    narrow_s = time.perf_counter() - t0
    run = EGraphRun(program, spaces)
    skipped = None  # why the exact integer program did not run, where it was asked for
    try:
        tables, sat = grow(run, fallback=req.fallback, limits=req.limits, deadline=deadline, extra=rulesets,
                           base=None if base is None else base.keys,
                           on_iteration=lambda it, nodes: shown.update("saturating", f"iteration {it}, {nodes:,} e-nodes"))
        sat.narrowed, sat.load_seconds = narrowed, sat.load_seconds + narrow_s
        # the integer program needs the resharding e-nodes; the greedy search does not
        method, skipped = exact_method(method, sat.nodes)
        graph = export(run.egraph, reshard=method == "exact")
        if graph.unbuilt_nodes and runs_exact(method, graph.size):  # "auto" on a small e-graph
            graph = export(run.egraph)
        for a in program.aliases:  # folded loop members take their representative's value group
            graph.value_group[a] = graph.value_group[program.alias(a)]
    finally:
        run.close()
    if tables.fallbacks:
        warn_user(_fallback_message(program.name, tables.fallbacks), FallbackWarning)
    return graph, tables, sat, run.value_space, method, skipped


def _prior_layouts(prior: str, program: Program, spaces: SpaceTable, base: RuleTables,
                   tie_pairs: list[tuple[int, int]], profile: DeviceProfile, shown: Progress) -> dict[int, set[int]]:
    """Per value, the layouts its prior keeps: the standard families' propagation ("families"),
    or a learned prior's best-scored layouts with every family's argument layouts (the search
    starts from them, extract/search.py)."""
    if prior == "families":
        shown.update("narrowing", "layouts by the standard families")
        return propagated_layouts(program, spaces, base, CostModel(profile, spaces, base), tie_pairs, NARROW_WIDTH)
    shown.update("narrowing", "layouts by the learned prior")
    keep: dict[int, set[int]] = defaultdict(set)
    weights = resolve_prior(prior)
    keep.update(learned_layouts(program, spaces, base, tie_pairs, profile, weights, PRIOR_PAIRS, PRIOR_MASS))
    for _, layouts in family_layouts(program, spaces, tie_pairs, base):
        for pos, lay in layouts.items():
            keep[program.args[pos]].add(spaces.layouts.intern(lay))
    return keep


def _narrows(req: _Request, program: Program, spaces: SpaceTable, rulesets: list[Ruleset]) -> bool:
    """Whether each value gets only its prior's layouts (see _prior_kind)."""
    return _prior_kind(req, program, spaces, rulesets) is not None


def _prior_kind(req: _Request, program: Program, spaces: SpaceTable, rulesets: list[Ruleset]) -> str | None:
    """The prior that narrows each value's layouts: "families", a learned prior ("builtin" or a
    weights file), or None (every layout). With priors="auto", by the program's (value, layout)
    pairs against the e-graph budget (extract/policy.py). Never with the user's own egglog
    rulesets: the values they make have no prior."""
    if req.priors is None or rulesets or len(spaces.mesh.active) < 2:
        return None
    if req.priors != "auto":
        return str(req.priors)
    pairs = sum(len(spaces.space(v.shape, v.dtype).layouts) for vid, v in enumerate(program.values)
                if vid not in program.aliases)  # a folded loop's repeats are planned once
    if pairs > NARROW_PAIRS:
        return "families"
    if len(spaces.mesh.active) >= MANY_AXES and pairs > NARROW_PAIRS_MANY_AXES:
        return "builtin"
    return None


def _pinned(program: Program, arg_pins: dict[int, frozenset[int]],
            out_pins: dict[int, frozenset[int]]) -> dict[int, frozenset[int]]:
    """The layouts in_shardings and out_shardings allow, per value."""
    out = {program.args[pos]: lids for pos, lids in arg_pins.items()}
    for pos, lids in out_pins.items():
        vid = program.outputs[pos]
        if isinstance(vid, int):
            out[vid] = out.get(vid, frozenset()) | lids
    return out


def _together(program: Program, tie_pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Values that keep one layout: tied state in and out, a scan's carry with its initial,
    next and final values."""
    pairs = [(program.args[a], program.outputs[o]) for a, o in tie_pairs if isinstance(program.outputs[o], int)]
    for r in program.scans:
        for k, cin in enumerate(r.carry_in):
            for atom in (r.init[k], r.carry_out[k], r.final[k] if k < len(r.final) else None):
                if isinstance(atom, int):
                    pairs.append((cin, atom))
    return pairs


def _problem(program: Program, graph: ExportedGraph, spaces: SpaceTable, tables: RuleTables, model: CostModel,
             value_space: list[int], arg_pins: dict[int, frozenset[int]], out_pins: dict[int, frozenset[int]],
             tie_pairs: list[tuple[int, int]],
             policy: SearchPolicy) -> tuple[Problem, np.ndarray, Callable[[Extraction], Extraction]]:
    """What extraction solves: the priced e-graph, its roots, pins, ties and starting points;
    and the function that completes an extraction's root layouts to one per program output."""
    combinable = combinable_groups(program, graph)
    weight = _weights(program, graph)
    node_cost = model.node_costs(graph, value_space, combinable) * weight[graph.class_group[graph.node_class]]
    roots, n_out_roots, tie_list, carry_root = _roots(program, graph, spaces, out_pins, tie_pairs)
    fills = data_parallel_fills(program, spaces, tie_pairs)
    problem = Problem(
        graph=graph, node_cost=node_cost, value_space=value_space, spaces=spaces, edges=tables.edges,
        model=model, combinable=combinable, describe=lambda grp: describe_group(program, graph, grp),
        roots=roots, place_pins={graph.value_group[program.args[pos]]: lay for pos, lay in arg_pins.items()},
        ties=tie_list,
        weight=weight,
        # the search is local: training steps also start from data-parallel and ZeRO-3 state,
        # and where it pays from FSDP + TP (see extract/seeds.py)
        seeds=seeds(program, graph, spaces, tie_pairs, arg_pins, hybrids=policy.seed_hybrids),
        families=families(program, graph, spaces, tie_pairs, arg_pins, tables),
        tensor_axis=None if fills else tensor_axis(spaces, model.profile.link),
        data_parallel=widest_data_parallel(spaces) if fills else None,
    )

    def full_roots(ex: Extraction) -> Extraction:
        if len(ex.root_layouts) != len(program.outputs) or (carry_root and not ex.carry_layouts):
            ex.carry_layouts = {cin: ex.root_layouts[r] for cin, r in carry_root.items()}
            it = iter(ex.root_layouts[:n_out_roots])
            ex.root_layouts = [None if isinstance(o, Literal) else next(it) for o in program.outputs]
        return ex

    return problem, node_cost, full_roots


def _weights(program: Program, graph: ExportedGraph) -> np.ndarray:
    """Executions per step of each value group: a scan body's values run once per iteration, and
    a folded loop's per-layer inputs of one role stand for that many arrays."""
    weight = np.ones(graph.num_groups)
    stand_for: dict[int, int] = {}
    for a in program.aliases:  # a representative counts itself only if it is a real array
        rep = program.alias(a)
        if program.is_loop_invariant(rep):
            continue  # every repeat computes the same array
        stand_for[rep] = stand_for.get(rep, 0 if program.is_folded_body(rep) else 1) + 1
    for grp, vids in enumerate(graph.group_values):
        if vids:
            weight[grp] = max(max(program.value_multiplicity(v), stand_for.get(v, 1))
                              for v in vids)
    return weight


def _extract(req: _Request, policy: SearchPolicy, problem: Problem, unbounded: Callable[[], Extraction],
             full_roots: Callable[[Extraction], Extraction], memory_of: Callable[[Extraction], MemoryEstimate], limit: int | None, deadline: float,
             sat: SaturationReport) -> tuple[Extraction, MemoryEstimate | None]:
    """The best plan the policy's search finds, within the memory limit where there is one."""
    limits = req.limits
    try:
        extraction = unbounded()
        memory = None
        if limit is not None:
            try:
                extraction, memory = fit_memory(problem, extraction, limit, memory_of, deadline, policy)
            except MemoryNotMetError as e:
                if req.memory_limit != "device":
                    raise
                # the device's own memory: a plan that does not fit is still the best answer
                # to give, with a warning (the estimate has no rematerialisation, for one)
                extraction, memory = e.smallest, e.memory
                warn_user(f"{e} Returning that plan: it may not fit on {req.profile.name} devices.",
                          MemoryLimitWarning)
            extraction = full_roots(extraction)
    except NoPlanError as e:
        if sat.stop_reason == StopReason.SATURATED:
            raise
        raise StoppedEarlyError(
            f"{e} The search stopped early at the {sat.stop_reason.value} ({sat.iterations} iterations, "
            f"{sat.nodes:,} e-nodes; saturation ran {sat.seconds:.2f} s, and the time limit counts from the start "
            f"of planning, tracing included) before every value had a plan. Consider raising "
            f"shardsat.Limits (now {limits})."
        ) from e
    return extraction, memory


def _roots(program: Program, graph: Any, spaces: SpaceTable, out_pins: dict[int, int],
           tie_pairs: list[tuple[int, int]]) -> tuple[list[tuple[int, frozenset[int] | None]], int,
                                                     list[tuple[int, int]], dict[int, int]]:
    """What extraction must compute: the outputs (pinned ones in their layout) first, then what
    the program needs beyond them: loop carries tied to one layout, while predicates, and what
    side effects read or make. Returns (roots, outputs' count, ties (group, root), carry input ->
    its root)."""
    roots: list[tuple[int, frozenset[int] | None]] = []
    root_of: dict[int, int] = {}
    for k, o in enumerate(program.outputs):
        if isinstance(o, Literal):
            continue
        root_of[k] = len(roots)
        roots.append((graph.value_group[o], out_pins.get(k)))
    n_out_roots = len(roots)
    tie_list = [(graph.value_group[program.args[a]], root_of[k]) for a, k in tie_pairs if k in root_of]
    # scan carries: placed in one layout, which the body's carry-out and the initial carry meet
    carry_root: dict[int, int] = {}
    for scan in program.scans:
        for v in scan.extra_reads:  # read by a folded loop's replay, outside its body's operands
            if v in graph.value_group:
                roots.append((graph.value_group[v], None))
        for k, cin in enumerate(scan.carry_in):
            h = graph.value_group[cin]
            for atom in (scan.carry_out[k], scan.init[k]):
                if isinstance(atom, int) and atom in graph.value_group:
                    carry_root.setdefault(cin, len(roots))
                    tie_list.append((h, len(roots)))
                    roots.append((graph.value_group[atom], None))
    for v, whole in program.required_values():
        if v in graph.value_group:
            sp = spaces.space(program.values[v].shape, program.values[v].dtype)
            roots.append((graph.value_group[v], frozenset({sp.layouts[0]}) if whole else None))
    return roots, n_out_roots, tie_list, carry_root


def _fallback_message(name: str, fallbacks: list[Fallback]) -> str:
    """One warning for every equation kept replicated, grouped by primitive and reason."""
    groups: dict[tuple[str, str], list[str]] = {}
    for f in fallbacks:
        groups.setdefault((f.primitive, f.reason), []).append(f.source)
    lines = []
    for (prim, reason), sources in groups.items():
        more = f" (+{len(sources) - 3} more)" if len(sources) > 3 else ""
        lines.append(f"  * `{prim}` at {', '.join(sources[:3])}{more}: {reason}")
    return (f"shardsat keeps {len(fallbacks)} equation(s) of `{name}` replicated (no sharding rule "
            "applies):\n" + "\n".join(lines) + "\nThe plan is correct but may be slower than it could "
            "be; plan.explain() lists them. Consider shardsat.register_signature() to teach shardsat "
            "the primitive, or strict=True to make this an error.")


def _memory_limit(memory_limit: int | str | None, profile: DeviceProfile) -> int | None:
    """Bytes per device the plan may use, or None for no limit."""
    if memory_limit is None:
        return None
    if memory_limit == "device":
        return None if profile.memory_bytes is None else int(profile.memory_bytes)
    bad = memory_limit_problem(memory_limit)
    if bad:
        raise InvalidArgumentError(bad)
    return int(memory_limit)  # type: ignore[arg-type]


def describe_group(program: Any, graph: Any, grp: int) -> str:
    """A value e-class in user terms: its argument path or output path, or its equation."""
    vids = graph.group_values[grp]
    for k, o in enumerate(program.outputs):
        if not isinstance(o, Literal) and o in vids:
            return f"output {program.out_paths[k]}"
    if not vids:
        return f"a rewritten value (e-class {grp})"
    v = program.values[vids[0]]
    if v.arg is not None:
        return f"argument {program.arg_paths[v.arg]}"
    if v.producer is not None:
        e = program.equations[v.producer]
        return f"the result of `{e.name}` at {e.source}"
    return "a constant"


def _argnums_of(program: Any, flat_positions: list[int]) -> list[int]:
    """Positional arguments that hold any of these flat argument leaves."""
    out, start = [], 0
    for i, n in enumerate(program.arg_counts):
        if any(start <= p < start + n for p in flat_positions):
            out.append(i)
        start += n
    return out
