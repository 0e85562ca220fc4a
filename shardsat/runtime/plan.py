"""The Plan: what extraction chose, as shardings a JAX user can read and a function they can run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..egraph.collectives import COLLECTIVES
from ..egraph.export import ExportedGraph, NodeKind
from ..egraph.layout import Layout, MeshAxes, SpaceTable, auto_mesh
from ..egraph.program import Literal, Program
from ..errors import InvalidArgumentError, ShardsatError
from ..extract.cost import CostModel
from ..extract.memory import MemoryEstimate, estimate_memory
from ..extract.profile import DeviceProfile
from ..extract.result import Extraction
from ..extract.structure import heavy_roles
from ..limits import StopReason
from ..rules.apply import RuleTables
from ..rules.registry import rule_for
from .argcheck import PlannedArgs, planned_args
from .hlo import count_collectives
from .lower import EqnRun, Interpreter, Step
from .record import Origin

KIND_NAMES = {k: kind.name for k, kind in COLLECTIVES.items()}  # display names, by NodeKind


@dataclass(frozen=True)
class Collective:
    kind: str  # all-gather, all-reduce, reduce-scatter, all-to-all
    axes: tuple[str, ...]
    bytes: int  # per-device buffer (the larger side)
    moved_bytes: float  # bytes each device sends
    seconds: float
    value: str  # the tensor: source line and shape
    src: str  # layout before, as a PartitionSpec
    dst: str  # layout after
    reason: str  # which consumer needed it
    count: int = 1  # times per step (inside a scan body: once per iteration)
    hlo_count: int = 1  # times it appears in the compiled HLO (a while loop's body holds it once)


@dataclass
class PlanCost:
    compute_s: float
    communication_s: float
    total_s: float
    collectives: list[Collective]
    argument_bytes: int  # per device, all arguments
    output_bytes: int  # per device, all outputs
    argument_bytes_by_path: dict[str, int] = field(default_factory=dict)
    memory: MemoryEstimate | None = None  # per device: parameters, optimizer state, gradients, peak
    flops: float = 0.0  # per device
    update_flops: float = 0.0  # per device: elementwise ops after the contractions that lead to returned state
    update_flops_unsharded: float = 0.0  # the same ops on one device (plain data parallelism)

    def count(self) -> Counter[str]:
        """Collectives by kind, as they appear in the compiled HLO."""
        out: Counter[str] = Counter()
        for c in self.collectives:
            out[c.kind] += c.hlo_count
        return out


@dataclass
class Report:
    e_classes: int
    e_nodes: int
    iterations: int
    saturation_s: float
    extraction_s: float
    stop_reason: StopReason
    trace_s: float = 0.0
    rules_s: float = 0.0
    method: str = "greedy-dag"
    sweeps: int = 0
    equations: int = 0
    fallbacks: list[str] = field(default_factory=list)
    # relative optimality gap (0.0: proven optimal): the exact solver's where it ran, else the
    # plan's distance from lower_bound_s, a cost no plan of the e-graph can beat
    gap: float | None = None
    lower_bound_s: float | None = None
    exact_status: str | None = None  # the exact integer program's outcome, where it ran
    memory_limit: int | None = None  # bytes per device, when planned under a limit
    memory_headroom: int | None = None  # limit minus the plan's estimate
    # a plan loaded from a file (shardsat.load_plan, cache_dir): the file, and the seconds it
    # took to trace and restore; the fields above describe the search that made it
    loaded_from: str | None = None
    load_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.trace_s + self.rules_s + self.saturation_s + self.extraction_s

    def __str__(self) -> str:
        s = (
            f"{self.equations} equations -> {self.e_classes} e-classes, {self.e_nodes} e-nodes; "
            f"saturation {self.saturation_s:.3f}s in {self.iterations} iterations ({self.stop_reason.value}); "
            f"extraction {self.extraction_s:.3f}s ({self.method}, {self.sweeps} sweeps"
            + (f", optimality gap {self.gap:.1%}" if self.gap is not None and self.lower_bound_s is None else "")
            + (f", within {self.gap:.1%} of a lower bound" if self.gap is not None and self.lower_bound_s is not None
               else "")
            + (f", exact ILP: {self.exact_status}" if self.exact_status else "")
            + f"); total {self.total_s:.3f}s"
        )
        if self.memory_limit is not None:
            s += f"; memory limit {self.memory_limit:,} B per device, headroom {self.memory_headroom:,} B"
        if self.fallbacks:
            s += f"; replicated by fallback: {', '.join(self.fallbacks)}"
        if self.loaded_from is not None:
            s += f"; loaded from {self.loaded_from} in {self.load_s:.3f}s (the search above made it)"
        return s


def _explicit(x: Any) -> bool:
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _needs_move(x: Any, want: Any) -> bool:
    """Committed arrays in another layout than the plan's (jit would reject them), and arrays
    whose Explicit mesh axes carry their sharding in their type."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    if _explicit(x):
        return True
    try:
        return bool(x.committed) and not x.sharding.is_equivalent_to(want, x.ndim)
    except Exception:  # pragma: no cover - unusual shardings: let jit decide
        return False


def _concrete_mesh(context: Any, runtime: Mesh) -> Mesh:
    """The caller's context mesh on the plan's devices (a context holds an abstract mesh)."""
    if tuple(context.axis_names) != tuple(runtime.axis_names) or tuple(context.axis_sizes) != tuple(
            runtime.devices.shape):
        raise ShardsatError(
            f"plan.jit() was called inside a mesh context {dict(zip(context.axis_names, context.axis_sizes, strict=True))}"
            f" that is not the plan's mesh {dict(runtime.shape)}. Call it under the mesh it was planned for, or "
            "plan again for this mesh.")
    return Mesh(runtime.devices, runtime.axis_names, axis_types=tuple(context.axis_types))


class PlannedFunction:
    """`jax.jit` of the plan. It takes what `jax.jit(fn)` takes: arrays committed to another
    layout (or to a mesh with Explicit axes, whose type carries the sharding) are moved to the
    plan's layout first."""

    def __init__(self, jitted: Any, in_shardings: tuple[Any, ...], donate_argnums: tuple[int, ...] = (),
                 mesh: Mesh | None = None, planned: PlannedArgs | None = None) -> None:
        self.jitted = jitted
        self.in_shardings = in_shardings
        self.donate_argnums = donate_argnums
        self.mesh = mesh  # the runtime's (Auto) mesh the plan lowers on
        self.planned = planned  # the arguments the plan was made for: others are refused

    def _prepare(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if self.planned is not None and tree != self.planned.tree:
            self.planned.check(leaves, tree)
        shardings = jax.tree_util.tree_leaves(self.in_shardings)
        if len(shardings) != len(leaves):
            return args
        if not any(_needs_move(x, s) for x, s in zip(leaves, shardings, strict=True)):
            return args
        moved = [jax.device_put(x, s) if _needs_move(x, s) else x for x, s in zip(leaves, shardings, strict=True)]
        return jax.tree_util.tree_unflatten(tree, moved)

    def _run(self, fn: Any, args: tuple[Any, ...]) -> Any:
        """fn (the jitted function or its lower) on the prepared arguments. Shapes and dtypes are
        checked where it costs nothing per call: jit traces `planned` (which checks them) again
        for every new signature, and where jit rejects the arguments before tracing (a sharding
        that does not divide, another rank) its error gives way to the one naming the argument."""
        try:
            return fn(*self._prepare(args))  # (moving committed arguments may fail on them too)
        except Exception:
            err = None if self.planned is None else self.planned.mismatch(*jax.tree_util.tree_flatten(args))
            if err is None:
                raise
        raise err

    def __call__(self, *args: Any) -> Any:
        context = jax.sharding.get_abstract_mesh()
        if self.mesh is None or context.empty:
            return self._run(self.jitted, args)
        # Inside `jax.set_mesh(mesh)` (the way Explicit axes are used) the plan's constraints on
        # its Auto copy of the mesh would be type errors: it runs under its own mesh, and its
        # outputs are handed back on the caller's, where they are usable
        with jax.set_mesh(self.mesh):
            out = self._run(self.jitted, args)
        explicit = [n for n, t in zip(context.axis_names, context.axis_types, strict=True) if t == AxisType.Explicit]
        if not explicit:
            return out
        caller = _concrete_mesh(context, self.mesh)
        return jax.tree_util.tree_map(
            lambda y: jax.device_put(y, NamedSharding(caller, y.sharding.spec))
            if isinstance(getattr(y, "sharding", None), NamedSharding) else y, out)

    def lower(self, *args: Any) -> Any:
        if self.mesh is None or jax.sharding.get_abstract_mesh().empty:
            return self._run(self.jitted.lower, args)
        with jax.set_mesh(self.mesh):
            return self._run(self.jitted.lower, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)


def _argnums(nums: Any, n_args: int, name: str) -> tuple[int, ...]:
    """donate_argnums as jax.jit takes it (a position or a sequence of them), checked."""
    seq = (nums,) if isinstance(nums, int) and not isinstance(nums, bool) else nums
    if isinstance(seq, tuple | list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_args
                                             for i in seq):
        return tuple(seq)
    raise InvalidArgumentError(
        f"plan.jit(donate_argnums={nums!r}) for `{name}`: donate_argnums must be positions of its {n_args} "
        f"positional argument(s), 0..{n_args - 1}. Consider donate_argnums=() to donate nothing, or (0,).")


class Plan:
    """A sharding plan for one function, mesh and device profile."""

    def __init__(
        self,
        *,
        fn: Callable[..., Any],
        program: Program,
        mesh: Mesh,
        spaces: SpaceTable,
        tables: RuleTables,
        graph: ExportedGraph,
        extraction: Extraction,
        profile: DeviceProfile,
        report: Report,
        model: CostModel | None = None,
        arg_pins: dict[int, frozenset[int]] | None = None,
        ties: list[tuple[int, int]] | None = None,
        state_argnums: list[int] | None = None,
        memory: MemoryEstimate | None = None,
        origin: Origin | None = None,
    ) -> None:
        self.fn = fn
        self.program = program
        self.mesh = mesh
        self.runtime_mesh = auto_mesh(mesh)
        self.axes: MeshAxes = spaces.mesh
        self.spaces = spaces
        self.tables = tables
        self.graph = graph
        self.extraction = extraction
        self.profile = profile
        self.report = report
        self.model = model
        self.arg_pins = dict(arg_pins or {})
        self.ties = list(ties or [])  # (flat arg, flat output) pairs of loop-carried state
        self.state_argnums = tuple(state_argnums or ())
        self.origin = origin  # the traced program's fingerprint, for save()
        self._layouts = spaces.layouts.layouts
        self._assign()
        self.cost = self._cost(memory)
        self._jitted: Any = None

    # -- assignment -----------------------------------------------------------------------------
    def _assign(self) -> None:
        g, prog, ex = self.graph, self.program, self.extraction
        self.produced: dict[int, int] = {}
        self.parent: dict[tuple[int, int], Step] = {}
        for vid in range(len(prog.values)):
            grp = g.value_group.get(prog.alias(vid))
            if grp is not None and grp in ex.choices:
                self.produced[vid] = ex.choices[grp].layout
                for step in ex.choices[grp].steps:
                    self.parent[(vid, step.dst)] = Step(step.src, step.kind, step.axes, step.dim, step.dim2)
        # a folded loop's repeats read their carry through the carry input's resharding tree
        for scan in prog.scans:
            for cin, members in scan.members.items():
                grp = g.value_group.get(cin)
                if scan.folded and cin in scan.carry_in and grp in ex.choices:
                    for m in members:
                        if isinstance(m, int):
                            for step in ex.choices[grp].steps:
                                self.parent.setdefault(
                                    (m, step.dst), Step(step.src, step.kind, step.axes, step.dim, step.dim2))
        # values the e-graph proved equal (identical equations) are computed once
        # values the e-graph proved equal (identical equations, or a rewrite's two sides) are
        # computed once, by an equation of the production the plan chose
        self.canon: dict[int, int] = {}
        for grp, vids in enumerate(g.group_values):
            chosen = self._chosen_base(grp)
            first: dict[int | None, int] = {}
            for v in sorted(vids, key=lambda v: (self._base_key(v) != chosen, v)):
                # only within one region: a scan body recomputes per iteration
                self.canon[v] = first.setdefault(prog.values[v].region, v)
        for scan in prog.scans:  # a replayed repeat's value is computed once like its body value
            if scan.folded:
                for b, members in scan.members.items():
                    cb = self.canon.get(b, b)
                    if cb != b and cb in scan.members:
                        for m, cm in zip(members, scan.members[cb], strict=True):
                            if isinstance(m, int) and isinstance(cm, int):
                                self.canon[m] = cm
        runs: list[EqnRun] = []
        done: set[int] = set()
        for eqn in prog.equations:
            if eqn.outputs and all(self.canon.get(o, o) in done for o in eqn.outputs):
                continue
            by_strategy: dict[int, list[tuple[int, int]]] = {}
            for k, out in enumerate(eqn.outputs):
                grp = g.value_group.get(out)
                if grp is None or grp not in ex.choices:
                    continue
                node = ex.choices[grp].node
                okey = self.tables.output_key[out]
                nkey = g.node_key[node]
                if NodeKind(int(g.node_kind[node])) != NodeKind.LOCAL or nkey is None:
                    raise ShardsatError(f"Value {out} is produced by a non-local node; cannot lower.")
                if nkey.rpartition("#")[0] != okey.rpartition("#")[0]:
                    if any(self._base_key(v) == nkey.rpartition("#")[0] for v in g.group_values[grp]):
                        continue  # an equal value's equation (the other side of a rewrite) computes it
                    raise ShardsatError(
                        f"The plan computes `{eqn.name}` at {eqn.source} through a rewritten term "
                        f"({nkey}) that no equation of the program computes; write the rewrite as a "
                        f"shardsat.Rewrite so both sides are equations."
                    )
                by_strategy.setdefault(int(g.node_a[node]), []).append((k, ex.choices[grp].layout))
            if eqn.effects and not eqn.outputs:  # a debug print: run on whole operands
                ins = tuple(self.spaces.space(prog.values[a].shape, prog.values[a].dtype).layouts[0]
                            for a in eqn.inputs if isinstance(a, int))
                runs.append(EqnRun(eqn.index, ins, ()))
                continue
            info, _ = self.tables.info(self.tables.output_key[eqn.outputs[0]]) if eqn.outputs else (None, 0)
            for s, outs in by_strategy.items():
                st = info.strategies[s]  # type: ignore[union-attr]
                runs.append(EqnRun(eqn.index, st.ins, tuple(outs)))
                done.update(self.canon.get(eqn.outputs[k], eqn.outputs[k]) for k, _ in outs)
        self.runs = runs

    def _base_key(self, vid: int) -> str | None:
        key = self.tables.output_key.get(vid)
        return None if key is None else key.rpartition("#")[0]

    def _chosen_base(self, grp: int) -> str | None:
        ch = self.extraction.choices.get(grp)
        if ch is None or NodeKind(int(self.graph.node_kind[ch.node])) != NodeKind.LOCAL:
            return None
        key = self.graph.node_key[ch.node]
        return None if key is None else key.rpartition("#")[0]

    def layout_of(self, vid: int) -> Layout | None:
        lid = self.produced.get(vid)
        return None if lid is None else self._layouts[lid]

    def _sharding(self, lid: int | None) -> NamedSharding:
        spec = PartitionSpec() if lid is None else self._layouts[lid].spec(self.axes)
        return NamedSharding(self.runtime_mesh, spec)

    def _pinned(self, pos: int) -> int | None:
        """The layout an argument the plan never reads is passed in: its pin's (of a partial pin,
        the one that splits least)."""
        lays = self.arg_pins.get(pos)
        if not lays:
            return None
        return min(lays, key=lambda lid: (len(self._layouts[lid].used_axes()), lid))

    @property
    def in_shardings(self) -> tuple[Any, ...]:
        """One pytree of NamedSharding per positional argument."""
        leaves = [self._sharding(self.produced.get(vid, self._pinned(pos)))
                  for pos, vid in enumerate(self.program.args)]
        return tuple(jax.tree_util.tree_unflatten(self.program.in_tree, leaves))

    @property
    def out_shardings(self) -> Any:
        leaves = []
        for o, lid in zip(self.program.outputs, self.extraction.root_layouts, strict=True):
            leaves.append(self._sharding(None if isinstance(o, Literal) else lid))
        return jax.tree_util.tree_unflatten(self.program.out_tree, leaves)

    # -- running --------------------------------------------------------------------------------
    def compiled_memory(self, *args: Any) -> int | None:
        """Bytes per device XLA allocates for this plan, compiled for the mesh's devices with
        loop-carried state donated: memory_analysis()'s arguments + outputs - aliased + temps.
        None where the backend does not report it. The reference for `cost.memory`."""
        ma = self.jit().lower(*args).compile().memory_analysis()
        if ma is None:
            return None
        parts = [getattr(ma, f"{n}_size_in_bytes", None) for n in ("argument", "output", "alias", "temp")]
        if any(p is None for p in parts):
            return None
        arg, out, alias, temp = (int(p) for p in parts)  # type: ignore[arg-type]
        return arg + out - alias + temp

    def jit(self, *, donate_argnums: tuple[int, ...] | None = None) -> Any:
        """`jax.jit` of the planned program with the plan's shardings. Loop-carried state
        (`state_argnums`) is donated unless `donate_argnums` says otherwise."""
        if donate_argnums is None:
            donate_argnums = self.state_argnums
        donate_argnums = _argnums(donate_argnums, len(self.program.arg_counts), self.program.name)
        if self._jitted is not None and self._jitted.donate_argnums == tuple(donate_argnums):
            return self._jitted
        interp = Interpreter(
            self.program, self.runs, self.produced, self.parent, self._layouts, self.axes, self.runtime_mesh,
            self.extraction.root_layouts, self.canon, self.extraction.carry_layouts,
        )
        prog = self.program
        expected = planned_args(prog)

        def planned(*args: Any) -> Any:
            leaves, tree = jax.tree_util.tree_flatten(args)
            expected.check(leaves, tree)
            expected.check_weak(self.fn, leaves)  # once per weak-type signature: jit traces again for one
            outs = interp(*leaves)
            return jax.tree_util.tree_unflatten(prog.out_tree, outs)

        planned.__name__ = f"planned_{prog.name}"
        f = PlannedFunction(
            jax.jit(planned, in_shardings=self.in_shardings, out_shardings=self.out_shardings,
                    donate_argnums=tuple(donate_argnums)),
            self.in_shardings,
            tuple(donate_argnums),
            self.runtime_mesh,
            expected,
        )
        self._jitted = f
        return f

    def hlo_collectives(self, *args: Any) -> Counter[str]:
        """Collectives XLA emits for this plan (compiled for `args`, or the traced shapes)."""
        if not args:
            args = tuple(jax.tree_util.tree_unflatten(
                self.program.in_tree,
                [jax.ShapeDtypeStruct(self.program.values[v].shape, self.program.values[v].dtype)
                 for v in self.program.args]))
        text = self.jit(donate_argnums=()).lower(*args).compile().as_text()
        return count_collectives(text)

    def predicted_collectives(self) -> Counter[str]:
        return self.cost.count()

    # -- cost -----------------------------------------------------------------------------------
    def _in_real_scan(self, grp: int) -> bool:
        vids = self.graph.group_values[grp]
        region = self.program.values[vids[0]].region if vids else None
        while region is not None:
            if not self.program.scans[region].folded:
                return True
            region = self.program.scans[region].parent
        return False

    def _describe_value(self, grp: int) -> str:
        vids = self.graph.group_values[grp]
        if not vids:
            return f"group {grp}"
        v = self.program.values[vids[0]]
        shape = "x".join(map(str, v.shape)) or "scalar"
        if v.arg is not None:
            return f"{self.program.arg_paths[v.arg]} {v.dtype}[{shape}]"
        if v.producer is not None:
            e = self.program.equations[v.producer]
            return f"{e.name} at {e.source} {v.dtype}[{shape}]"
        return f"const {v.dtype}[{shape}]"

    def _consumers(self) -> dict[tuple[int, int], list[str]]:
        """(group, layout) -> who needs the value in that layout."""
        out: dict[tuple[int, int], list[str]] = {}
        g, prog = self.graph, self.program
        for r in self.runs:
            eqn = prog.equations[r.eqn]
            it = iter(r.operand_layouts)
            for a in eqn.inputs:
                if isinstance(a, Literal):
                    continue
                lid = next(it)
                out.setdefault((g.value_group[a], lid), []).append(f"{eqn.name} at {eqn.source}")
        for k, (o, lid) in enumerate(zip(prog.outputs, self.extraction.root_layouts, strict=True)):
            if not isinstance(o, Literal) and lid is not None:
                out.setdefault((g.value_group[o], lid), []).append(f"output {prog.out_paths[k]}")
        return out

    def _cost(self, memory: MemoryEstimate | None = None) -> PlanCost:
        """memory: the plan's estimate where the caller already has it."""
        ex = self.extraction
        compute, comm, colls = self._collectives()
        arg_bytes, by_path = self._argument_bytes()
        out_bytes = self._output_bytes()
        if memory is None:
            memory = estimate_memory(
                self.program, self.graph, self.spaces, ex,
                ties=tuple(self.ties), pins=self.arg_pins, tables=self.tables)
        flops, update, update_full = self._flops()
        return PlanCost(compute, comm, compute + comm, colls, arg_bytes, out_bytes, by_path, memory, flops, update,
                        update_full)

    def _collectives(self) -> tuple[float, float, list[Collective]]:
        """Compute seconds (productions and dynamic slices), communication seconds and the
        collectives, each with the consumers it is for."""
        compute = 0.0
        comm = 0.0
        colls: list[Collective] = []
        consumers = self._consumers()
        for grp in sorted(self.extraction.choices):
            ch = self.extraction.choices[grp]
            compute += ch.node_seconds
            # which demanded layouts does each step lead to?
            leads: dict[int, set[int]] = {s.dst: {s.dst} for s in ch.steps}
            for s in reversed(ch.steps):
                for t in list(leads.get(s.dst, ())):
                    leads.setdefault(s.src, set()).add(t)
            for s in ch.steps:
                if COLLECTIVES[s.kind].local:  # moves nothing: a local copy
                    compute += s.seconds * ch.weight
                    continue
                comm += s.seconds * ch.weight
                needs = sorted({c for t in leads.get(s.dst, ()) if t in ch.demanded
                                for c in consumers.get((grp, t), [])})
                reason = "for " + "; ".join(needs[:3]) + (f" (+{len(needs) - 3} more)" if len(needs) > 3 else "") if needs else ""
                colls.append(Collective(
                    kind=KIND_NAMES[s.kind],
                    axes=tuple(self.axes.names[a] for a in s.axes),
                    bytes=s.buffer_bytes,
                    moved_bytes=s.moved_bytes,
                    seconds=s.seconds,
                    value=self._describe_value(grp),
                    src=self._layouts[s.src].describe(self.axes),
                    dst=self._layouts[s.dst].describe(self.axes),
                    reason=reason,
                    count=int(ch.weight),
                    hlo_count=1 if self._in_real_scan(grp) else int(ch.weight),
                ))
        return compute, comm, colls

    def _argument_bytes(self) -> tuple[int, dict[str, int]]:
        """Bytes per device of all arguments, and of each by its pytree path."""
        arg_bytes = 0
        by_path: dict[str, int] = {}
        for pos, vid in enumerate(self.program.args):
            v = self.program.values[vid]
            sp = self.spaces.space(v.shape, v.dtype)
            lid = self.produced.get(vid, self._pinned(pos))  # an unused argument: as in_shardings passes it
            b = self.spaces.shard_bytes(sp, lid) if lid is not None else v.nbytes
            by_path[self.program.arg_paths[pos]] = b
            arg_bytes += b
        return arg_bytes, by_path

    def _output_bytes(self) -> int:
        """Bytes per device of all (non-literal) outputs, in their root layouts."""
        out_bytes = 0
        for o, lid in zip(self.program.outputs, self.extraction.root_layouts, strict=True):
            if isinstance(o, Literal) or lid is None:
                continue
            v = self.program.values[o]
            out_bytes += self.spaces.shard_bytes(self.spaces.space(v.shape, v.dtype), lid)
        return out_bytes

    def _leads_to_state(self) -> list[bool]:
        """Per value: whether it leads to returned state (a tied output, else any output)."""
        targets = {self.program.outputs[k] for _, k in self.ties} or {
            o for o in self.program.outputs if not isinstance(o, Literal)}
        to_state = [False] * len(self.program.values)
        for v in targets:  # a folded loop's member is returned: its body value leads there
            to_state[v] = to_state[self.program.alias(v)] = True  # type: ignore[index]
        for eqn in reversed(self.program.equations):
            if any(to_state[o] for o in eqn.outputs):
                for a in eqn.inputs:
                    if isinstance(a, int):
                        to_state[a] = to_state[self.program.alias(a)] = True
        return to_state

    def _flops(self) -> tuple[float, float, float]:
        """FLOPs per device: all, the weight update's, and the update's on one device (zeros
        without a cost model)."""
        flops = update = update_full = 0.0
        if self.model is None:
            return flops, update, update_full
        ex = self.extraction
        before, after = heavy_roles(self.program)
        # the weight update: after the last contraction, and leading to returned state
        to_state = self._leads_to_state()
        for r in self.runs:
            if not r.outputs:  # a side effect with no results: host work, not device FLOPs
                continue
            eqn = self.program.equations[r.eqn]
            grp = self.graph.value_group[eqn.outputs[r.outputs[0][0]]]
            node = ex.choices[grp].node
            f = sum(self.model.local_work(self.tables.output_key[eqn.outputs[k]], int(self.graph.node_a[node]))[1]
                    for k, _ in r.outputs)
            times = ex.choices[grp].weight  # a scan or folded loop body runs once per iteration
            flops += f * times
            o = eqn.outputs[r.outputs[0][0]]
            if after[o] and not before[o] and to_state[o] and rule_for(eqn.primitive).elementwise:
                update += f * times
                info, _ = self.tables.info(self.tables.output_key[o])
                update_full += info.signature.flops * times
        return flops, update, update_full

    def weight_updates(self) -> dict[str, str]:
        """For each weight in loop-carried state (state a contraction reads): how its update runs."""
        before, _ = heavy_roles(self.program)
        out: dict[str, str] = {}
        for a, k in self.ties:
            vid = self.program.args[a]
            if not before[vid]:
                continue
            store = self.produced.get(vid)
            new = self.program.outputs[k]
            upd = None if isinstance(new, Literal) else self.produced.get(new)
            stored_sharded = store is not None and bool(self._layouts[store].used_axes())
            update_sharded = upd is not None and bool(self._layouts[upd].split_axes())
            axes = self.axes.label(self._layouts[upd].split_axes()) if update_sharded else ""
            if stored_sharded:
                out[self.program.arg_paths[a]] = f"stored sharded, gathered where used; update sharded over {axes or '-'} (ZeRO-3)"
            elif update_sharded:
                out[self.program.arg_paths[a]] = f"update sharded over {axes} (ZeRO-1/2: reduce-scatter, update 1/N, all-gather)"
            else:
                out[self.program.arg_paths[a]] = "replicated update (data parallel: all-reduced gradient)"
        return out

    # -- saving ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (the CLI's --json format): its layouts, collectives and cost for
        people and tools, and a record `shardsat.load_plan(path, fn, mesh, *example_args)` rebuilds
        it from with no saturation or extraction, with fingerprints of the program, the mesh and
        the profile that it checks. Returns the path."""
        from .jsonout import write_json

        if self.origin is None:
            raise ShardsatError(
                f"This plan of `{self.program.name}` was built outside saturate_and_extract and has no fingerprint "
                "of its program, so it cannot be saved for loading. Consider shardsat.saturate_and_extract(...).save().")
        return write_json(self, path)

    # -- presentation ---------------------------------------------------------------------------
    def explain(self) -> str:
        from .explain import explain

        return explain(self)

    def __repr__(self) -> str:
        c = self.cost
        return (f"<Plan {self.program.name} on {dict(zip(self.axes.names, self.axes.sizes, strict=True))}: "
                f"{c.total_s * 1e6:.1f} us predicted, {len(c.collectives)} collectives>")
