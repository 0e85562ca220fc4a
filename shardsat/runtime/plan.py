"""The Plan: what extraction chose, as shardings a JAX user can read and a function they can run."""

from __future__ import annotations

import copy
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..egraph.export import ExportedGraph
from ..egraph.layout import Layout, MeshAxes, SpaceTable, auto_mesh
from ..egraph.program import Literal, Program
from ..errors import InvalidArgumentError, ShardsatError
from ..extract.plancost import Collective as Collective  # re-exported: shardsat.Collective
from ..extract.plancost import CostedPlan, chained_values
from ..extract.plancost import PlanCost as PlanCost
from ..extract.profile import DeviceProfile
from ..extract.result import Bound, HasBound
from ..limits import StopReason
from ..rules.apply import RuleTables
from .argcheck import PlannedArgs, planned_args
from .hlo import copied_arguments, count_collectives
from .lower import Interpreter
from .record import Origin


@dataclass
class Report(HasBound):
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
    unkept: list[str] = field(default_factory=list)  # the user's sharding constraints and pins no plan keeps
    # gap and lower_bound_s (HasBound): the relative optimality gap (0.0: proven optimal), the
    # exact solver's where it ran, else the plan's distance from lower_bound_s, a cost no plan
    # of the e-graph can beat; computed on first read, and shared with the plan's extraction
    bound: Bound = field(default_factory=Bound, repr=False, compare=False)
    exact_status: str | None = None  # the exact integer program's outcome, where it ran
    memory_limit: int | None = None  # bytes per device, when planned under a limit
    memory_headroom: int | None = None  # limit minus the plan's estimate
    memory_compiled: int | None = None  # XLA's bytes per device, where the plan was compiled to check the limit
    # a plan loaded from a file (shardsat.load_plan, cache_dir): the file, and the seconds it
    # took to trace and restore; the fields above describe the search that made it
    loaded_from: str | None = None
    load_s: float = 0.0
    # (value, layout) pairs the prior left out of the e-graph (priors=; egraph/narrow.py)
    narrowed: int = 0

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
            if self.memory_compiled is not None:
                s += f" (compiled: {self.memory_compiled:,} B)"
        if self.narrowed:
            s += f"; {self.narrowed:,} (value, layout) pairs left out by the prior"
        if self.fallbacks:
            s += f"; replicated by fallback: {', '.join(self.fallbacks)}"
        if self.unkept:
            s += f"; sharding constraints and pins not kept: {'; '.join(self.unkept)}"
        if self.loaded_from is not None:
            s += f"; loaded from {self.loaded_from} in {self.load_s:.3f}s (the search above made it)"
        return s


def on_explicit_mesh(x: Any) -> bool:
    """An array placed on a mesh with Explicit axes: its type carries that mesh."""
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _needs_move(x: Any, want: Any) -> bool:
    """Committed arrays in another layout than the plan's (jit would reject them), and arrays
    whose Explicit mesh axes carry their sharding in their type."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    if on_explicit_mesh(x):
        return True
    try:
        return bool(x.committed) and not x.sharding.is_equivalent_to(want, x.ndim)
    except Exception:  # pragma: no cover - unusual shardings: let jit decide
        return False


def _concrete_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _trace_state_clean() -> bool:
    """Outside every jax trace (jit, grad, vmap): where `jax.set_mesh` may be entered."""
    from jax._src import core  # no public spelling; jax.set_mesh itself asks this

    return bool(core.trace_state_clean())


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
                 mesh: Mesh | None = None, planned: PlannedArgs | None = None, fn: Any = None,
                 out_shardings: Any = None) -> None:
        self.jitted = jitted
        self.out_shardings = out_shardings  # pytree of NamedSharding, as the jit's
        self.in_shardings = in_shardings
        self.donate_argnums = donate_argnums
        self.mesh = mesh  # the runtime's (Auto) mesh the plan lowers on
        self.planned = planned  # the arguments the plan was made for: others are refused
        self.fn = fn  # the user's function: its signature names the arguments

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Arguments given by name (as jax.jit takes them) in the function's positions."""
        if not kwargs:
            return args
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"plan.jit() takes the planned function's arguments, positionally or by name; these do not bind to "
                f"its signature: {e}. Consider passing them positionally, as they were given to "
                "saturate_and_extract.") from e
        if bound.kwargs:
            raise InvalidArgumentError(
                f"plan.jit() got keyword-only arguments {sorted(bound.kwargs)}: the plan was made for positional "
                "arguments. Consider functools.partial(fn, ...) for them before planning.")
        planned = None if self.planned is None else len(self.planned.tree.children())
        if planned is not None and len(bound.args) > planned:
            extra = list(bound.arguments)[planned:len(bound.args)]
            raise InvalidArgumentError(
                f"plan.jit() got argument(s) {', '.join(map(repr, extra))} the plan was not made for (it was "
                f"planned with {planned} positional argument(s), their defaults left as they are). Consider "
                "planning with them given, or functools.partial(fn, ...) for them before planning.")
        return tuple(bound.args)

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

    def _unshared(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The arguments, with each donated array that is also passed elsewhere in the call
        copied: jax would donate a buffer the call still reads (`plan.jit()(a, a)` with the
        first argument state; on a replicated layout over several devices XLA crashes the
        process). jax.jit without donation runs such a call, so the plan does too."""
        if not self.donate_argnums:
            return args
        seen = Counter(id(x) for x in jax.tree_util.tree_leaves(args) if _concrete_array(x))
        if all(n == 1 for n in seen.values()):
            return args
        out = list(args)
        for i in self.donate_argnums:
            if i < len(out):
                out[i] = jax.tree_util.tree_map(
                    lambda x: jax.numpy.copy(x) if _concrete_array(x) and seen[id(x)] > 1 else x, out[i])
        return tuple(out)

    def _run(self, fn: Any, args: tuple[Any, ...]) -> Any:
        """fn (the jitted function or its lower) on the prepared arguments. Shapes and dtypes are
        checked where it costs nothing per call: jit traces `planned` (which checks them) again
        for every new signature, and where jit rejects the arguments before tracing (a sharding
        that does not divide, another rank) its error gives way to the one naming the argument."""
        try:
            return fn(*self._unshared(self._prepare(args)))  # (moving committed arguments may fail on them too)
        except Exception:
            err = None if self.planned is None else self.planned.mismatch(*jax.tree_util.tree_flatten(args))
            if err is None:
                raise
        raise err

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = self._positional(args, kwargs)
        context = jax.sharding.get_abstract_mesh()
        if self.mesh is None or context.empty:
            return self._run(self.jitted, args)
        if not _trace_state_clean():
            return self._run(self._traced(context), self._placed_on(context, args))
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

    def _placed_on(self, context: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The arguments a caller's trace under `jax.set_mesh` passes in, placed in the plan's
        layouts on the caller's mesh: in an eager jax.grad or jvp, jit typed a closed-over batch
        (or a primal) replicated there and refused it against the plan's in_shardings
        (ValueError); under the caller's jax.jit the placement is a constraint the plan makes
        anyway. An eager jax.vmap there is still refused (a batched value's placement), as before."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        shardings = jax.tree_util.tree_leaves(self.in_shardings)
        if len(shardings) != len(leaves):
            return args
        caller = _concrete_mesh(context, self.mesh)  # type: ignore[arg-type]
        moved = [jax.device_put(x, NamedSharding(caller, s.spec)) if isinstance(x, jax.Array) else x
                 for x, s in zip(leaves, shardings, strict=True)]
        return jax.tree_util.tree_unflatten(tree, moved)

    def _traced(self, context: Any) -> Any:
        """The plan as a caller's trace under `jax.set_mesh` calls it (inside jax.jit, grad or
        vmap, where set_mesh is refused): on a mesh of Auto axes as it is; where the caller's
        axes are Explicit, run with them Auto (`jax.sharding.auto_axes`), its outputs typed with
        the plan's layouts on the caller's mesh, as the eager call hands them back."""
        if self.mesh is None or not any(t == AxisType.Explicit for t in context.axis_types):
            return self.jitted
        _concrete_mesh(context, self.mesh)  # the plan's mesh, or a clear error
        specs = jax.tree_util.tree_map(lambda s: s.spec, self.out_shardings)
        return jax.sharding.auto_axes(self.jitted, out_sharding=specs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        args = self._positional(args, kwargs)
        if self.mesh is None or jax.sharding.get_abstract_mesh().empty or not _trace_state_clean():
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
        costed: CostedPlan,
        profile: DeviceProfile,
        report: Report,
        arg_pins: dict[int, frozenset[int]] | None = None,
        ties: list[tuple[int, int]] | None = None,
        state_argnums: list[int] | None = None,
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
        self.costed = costed
        self.extraction = costed.extraction
        self.profile = profile
        self.report = report
        self.model = costed.model
        self.arg_pins = dict(arg_pins or {})
        self.ties = list(ties or [])  # (flat arg, flat output) pairs of loop-carried state
        self.state_argnums = tuple(state_argnums or ())
        self.origin = origin  # the traced program's fingerprint, for save()
        self.layouts = spaces.layouts.layouts  # layout id -> Layout
        asg = costed.assignment
        self.produced, self.parent, self.canon, self.runs = asg.produced, asg.parent, asg.canon, asg.runs
        self.cost = costed.cost
        self._jitted: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Plan:
        """A copy with its own report, sharing the traced program and the search's record: they
        hold jax primitives, which copy.deepcopy would clone without their lowering rules (the
        copy's jit then failed: "MLIR translation rule for primitive 'dot_general' not found").
        A plan is not changed after planning; plan.save() is how to keep one."""
        out = copy.copy(self)
        out.report = copy.copy(self.report)
        out._jitted = None
        memo[id(self)] = out
        return out

    def layout_of(self, vid: int) -> Layout | None:
        lid = self.produced.get(vid)
        return None if lid is None else self.layouts[lid]

    def _sharding(self, lid: int | None, mesh: Mesh) -> NamedSharding:
        spec = PartitionSpec() if lid is None else self.layouts[lid].spec(self.axes)
        return NamedSharding(mesh, spec)

    def _in_shardings(self, mesh: Mesh) -> tuple[Any, ...]:
        leaves = [self._sharding(lid, mesh) for lid in self.costed.assignment.arg_layouts]
        return tuple(jax.tree_util.tree_unflatten(self.program.in_tree, leaves))

    def _out_shardings(self, mesh: Mesh) -> Any:
        leaves = [self._sharding(None if isinstance(o, Literal) else lid, mesh)
                  for o, lid in zip(self.program.outputs, self.extraction.root_layouts, strict=True)]
        return jax.tree_util.tree_unflatten(self.program.out_tree, leaves)

    @property
    def in_shardings(self) -> tuple[Any, ...]:
        """One pytree of NamedSharding per positional argument, on the user's mesh (with its
        axis types: arrays placed with them are usable in the user's own jit under set_mesh)."""
        return self._in_shardings(self.mesh)

    @property
    def out_shardings(self) -> Any:
        return self._out_shardings(self.mesh)

    # -- running --------------------------------------------------------------------------------
    def compiled_memory(self, *args: Any, **kwargs: Any) -> int | None:
        """Bytes per device XLA allocates for this plan, compiled for the mesh's devices with
        loop-carried state donated: memory_analysis()'s arguments + outputs - aliased + temps.
        None where the backend does not report it. The reference for `cost.memory`."""
        ma = self.jit().lower(*args, **kwargs).compile().memory_analysis()
        if ma is None:
            return None
        parts = [getattr(ma, f"{n}_size_in_bytes", None) for n in ("argument", "output", "alias", "temp")]
        if any(p is None for p in parts):
            return None
        arg, out, alias, temp = (int(p) for p in parts)  # type: ignore[arg-type]
        return arg + out - alias + temp

    def compiled_argument_copies(self, *args: Any, **kwargs: Any) -> list[str]:
        """The paths of the arguments XLA copies whole in the compiled program (copy insertion:
        a donated argument read where nothing orders the read before its new value is written),
        sorted. The reference for `cost.memory.copied`."""
        return copied_arguments(self.jit().lower(*args, **kwargs).compile().as_text())

    def jit(self, *, donate_argnums: tuple[int, ...] | None = None) -> Any:
        """`jax.jit` of the planned program with the plan's shardings. Loop-carried state
        (`state_argnums`) is donated unless `donate_argnums` says otherwise."""
        if donate_argnums is None:
            donate_argnums = self.state_argnums
        donate_argnums = _argnums(donate_argnums, len(self.program.arg_counts), self.program.name)
        if self._jitted is not None and self._jitted.donate_argnums == tuple(donate_argnums):
            return self._jitted
        interp = Interpreter(
            self.program, self.runs, self.produced, self.parent, self.layouts, self.axes, self.runtime_mesh,
            self.extraction.root_layouts, self.canon, self.extraction.carry_layouts,
            combine_bytes=self.profile.combine_threshold_bytes, chained=chained_values(self.program),
        )
        prog = self.program
        expected = planned_args(prog)

        def planned(*args: Any) -> Any:
            leaves, tree = jax.tree_util.tree_flatten(args)
            expected.check(leaves, tree)
            expected.check_weak(self.fn, leaves, self.runtime_mesh)  # once per weak-type signature: jit traces again for one
            outs = interp(*leaves)
            return jax.tree_util.tree_unflatten(prog.out_tree, outs)

        planned.__name__ = f"planned_{prog.name}"
        ins, outs = self._in_shardings(self.runtime_mesh), self._out_shardings(self.runtime_mesh)
        f = PlannedFunction(jax.jit(planned, in_shardings=ins, out_shardings=outs, donate_argnums=tuple(donate_argnums)),
                            ins, tuple(donate_argnums), self.runtime_mesh, expected, self.fn, outs)
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

    def weight_updates(self) -> dict[str, str]:
        """For each weight in loop-carried state (state a contraction reads): how its update runs."""
        return dict(self.costed.weight_updates)

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
