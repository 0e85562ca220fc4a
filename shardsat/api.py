"""saturate_and_extract: trace -> layout e-graph -> saturate -> extract -> Plan."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from egglog import Ruleset
from jax.sharding import Mesh

from .egraph.export import export
from .egraph.layout import MeshAxes, SpaceTable
from .egraph.program import Literal, trace
from .egraph.run import EGraphRun
from .errors import InvalidArgumentError, InvalidMeshError
from .extract.cost import CostModel
from .extract.greedy import Extractor
from .extract.profile import DeviceProfile, get_profile
from .limits import Limits, StopReason
from .rules.apply import grow
from .runtime.plan import Plan, Report

FALLBACKS = (None, "replicate")


def saturate_and_extract(
    fn: Callable[..., Any],
    mesh: Mesh,
    *example_args: Any,
    profile: DeviceProfile | str | None = None,
    limits: Limits | None = None,
    fallback: str | None = None,
    rules: Sequence[Ruleset] = (),
) -> Plan:
    """Plan how to shard `fn(*example_args)` over `mesh`.

    example_args: arrays or `jax.ShapeDtypeStruct`s, any pytrees (what `fn` will be called with).
    profile: a DeviceProfile or a preset name ("h100", "h200", "tpu_v5e", "cpu"); by default the
      preset of the mesh's platform.
    limits: bounds on the search (`shardsat.Limits`); the plan's report says which one stopped it.
    fallback: "replicate" keeps equations without a sharding rule replicated (listed in the plan)
      instead of raising UnsupportedPrimitiveError.
    rules: extra egglog rulesets saturated with the built-in ones.
    """
    if not isinstance(mesh, Mesh):
        raise InvalidMeshError(
            f"saturate_and_extract needs a jax.sharding.Mesh, got {type(mesh).__name__}. "
            "Consider jax.make_mesh((2, 4), ('data', 'model'))."
        )
    if fallback not in FALLBACKS:
        raise InvalidArgumentError(f"fallback must be one of {FALLBACKS}, got {fallback!r}.")
    limits = limits or Limits()
    platform = mesh.devices.flat[0].platform
    prof = get_profile(profile, platform)
    start = time.perf_counter()
    deadline = start + limits.seconds
    program = trace(fn, example_args)
    t_trace = time.perf_counter() - start
    spaces = SpaceTable(MeshAxes.from_mesh(mesh))
    run = EGraphRun(program, spaces)
    try:
        tables, sat = grow(run, fallback=fallback, limits=limits, deadline=deadline, extra=rules)
        graph = export(run.egraph)
    finally:
        run.close()
    t1 = time.perf_counter()
    model = CostModel(prof, spaces, tables)
    node_cost = model.node_costs(graph, run.value_space)
    extractor = Extractor(graph, node_cost, run.value_space, spaces, tables.edges, model)
    roots = [(graph.value_group[o], None) for o in program.outputs if not isinstance(o, Literal)]
    extraction = extractor.run(roots, deadline=deadline)
    root_layouts: list[int | None] = []
    it = iter(extraction.root_layouts)
    for o in program.outputs:
        root_layouts.append(None if isinstance(o, Literal) else next(it))
    extraction.root_layouts = root_layouts
    t2 = time.perf_counter()
    stop = sat.stop_reason
    if time.perf_counter() > deadline and stop == StopReason.SATURATED:
        stop = StopReason.TIME_LIMIT
    report = Report(
        e_classes=graph.num_classes,
        e_nodes=sat.nodes,
        iterations=sat.iterations,
        saturation_s=sat.seconds,
        extraction_s=t2 - t1,
        stop_reason=stop,
        trace_s=t_trace,
        rules_s=sat.load_seconds,
        method=extraction.method,
        sweeps=extraction.sweeps,
        equations=len(program.equations),
        fallbacks=[f"{name} at {src}" for _, name, src in tables.fallbacks],
    )
    return Plan(
        fn=fn,
        program=program,
        mesh=mesh,
        spaces=spaces,
        tables=tables,
        graph=graph,
        extraction=extraction,
        profile=prof,
        report=report,
    )
