"""A plan's cost as the user reads it: compute and communication seconds, every collective with
the consumers it serves, bytes per device, FLOPs and the weight update's share of them, and how
each weight's update runs. Worked out once from the extraction and its assignment, so the Plan
(runtime/) only holds and lowers the record."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..egraph.collectives import COLLECTIVES
from ..egraph.export import ExportedGraph
from ..egraph.layout import SpaceTable
from ..egraph.program import Literal, Program
from ..rules.apply import RuleTables
from ..rules.registry import rule_for
from .assignment import Assignment, assign
from .cost import CostModel
from .memory import MemoryEstimate, estimate_memory
from .result import Extraction
from .structure import chained_values as chained_values  # the runtime reads it here (tests/test_layering.py)
from .structure import heavy_roles

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


@dataclass(frozen=True)
class CostedPlan:
    """What extraction chose, costed: the record a Plan holds, lowers and shows."""

    extraction: Extraction
    assignment: Assignment
    cost: PlanCost
    weight_updates: dict[str, str]  # loop-carried weight -> how its update runs
    model: CostModel | None = None


def cost_plan(program: Program, graph: ExportedGraph, spaces: SpaceTable, tables: RuleTables, ex: Extraction, *,
              model: CostModel | None, arg_pins: dict[int, frozenset[int]] | None = None,
              ties: list[tuple[int, int]] | None = None, memory: MemoryEstimate | None = None) -> CostedPlan:
    """The extraction assigned to equations and costed. `memory`: the plan's estimate where the
    caller has it already; `model` None (a loaded plan without one): FLOPs are zeros."""
    pins = dict(arg_pins or {})
    for a, o in ties or []:  # loop-carried state the program never reads: passed as it is returned
        lid = ex.root_layouts[o] if o < len(ex.root_layouts) else None
        if a not in pins and lid is not None:
            pins[a] = frozenset({lid})
    asg = assign(program, graph, tables, spaces, ex, pins)
    c = _Costing(program, graph, spaces, tables, ex, asg, model, list(ties or []), pins)
    return CostedPlan(ex, asg, c.cost(memory), c.weight_updates(), model)


class _Costing:
    def __init__(self, program: Program, graph: ExportedGraph, spaces: SpaceTable, tables: RuleTables,
                 extraction: Extraction, asg: Assignment, model: CostModel | None, ties: list[tuple[int, int]],
                 arg_pins: dict[int, frozenset[int]]) -> None:
        self.program, self.graph, self.spaces, self.tables = program, graph, spaces, tables
        self.extraction, self.asg, self.model, self.ties, self.arg_pins = extraction, asg, model, ties, arg_pins
        self.layouts = spaces.layouts.layouts
        self.axes = spaces.mesh

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
        for r in self.asg.runs:
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

    def cost(self, memory: MemoryEstimate | None) -> PlanCost:
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
                    src=self.layouts[s.src].describe(self.axes),
                    dst=self.layouts[s.dst].describe(self.axes),
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
            lid = self.asg.arg_layouts[pos]  # an unused argument: as in_shardings passes it
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
        for r in self.asg.runs:
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
            store = self.asg.produced.get(vid)
            new = self.program.outputs[k]
            upd = None if isinstance(new, Literal) else self.asg.produced.get(new)
            stored_sharded = store is not None and bool(self.layouts[store].used_axes())
            update_sharded = upd is not None and bool(self.layouts[upd].split_axes())
            axes = self.axes.label(self.layouts[upd].split_axes()) if update_sharded else ""
            if stored_sharded:
                out[self.program.arg_paths[a]] = f"stored sharded, {self._used(vid)}; update sharded over {axes or '-'}"
            elif update_sharded:
                out[self.program.arg_paths[a]] = f"update sharded over {axes} (ZeRO-1/2: reduce-scatter, update 1/N, all-gather)"
            else:
                out[self.program.arg_paths[a]] = "replicated update (data parallel: all-reduced gradient)"
        return out

    def _used(self, vid: int) -> str:
        """How a weight stored sharded reaches its readers: gathered (ZeRO-3), otherwise
        resharded, or read where it lies (tensor parallelism: an MLP's pair split on its hidden
        width needs no gather, and was called ZeRO-3 before)."""
        ch = self.extraction.choices.get(self.graph.value_group[vid])
        kinds = sorted({KIND_NAMES[s.kind] for s in (ch.steps if ch else ()) if not COLLECTIVES[s.kind].local})
        if "all-gather" in kinds:
            return "gathered where used (ZeRO-3)"
        if kinds:
            return f"resharded where used ({', '.join(kinds)})"
        return "used where it lies (tensor parallel: no gather)"
