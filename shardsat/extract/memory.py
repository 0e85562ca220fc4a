"""Per-device memory of a plan: arguments by role, outputs, gradients and a liveness-based
peak of intermediates, from the layouts extraction chose."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..egraph.export import ExportedGraph
from ..egraph.layout import SpaceTable
from ..egraph.program import Equation, Literal, Program
from .result import Extraction
from .structure import HEAVY, heavy_roles


@dataclass
class MemoryEstimate:
    parameters: int  # arguments read by a contraction (weights)
    optimizer_state: int  # other loop-carried state (moments, counters)
    inputs: int  # other arguments (the batch)
    gradients: int  # reduced gradients: contraction results with a weight's shape, feeding only the update
    activations_peak: int  # peak of live intermediates (program order)
    outputs: int  # outputs that do not reuse a donated argument buffer (also in the peak)
    by_path: dict[str, int] = field(default_factory=dict)

    @property
    def arguments(self) -> int:
        return self.parameters + self.optimizer_state + self.inputs

    @property
    def total(self) -> int:
        """Arguments plus the peak of intermediates (outputs are live at the end of it)."""
        return self.arguments + self.activations_peak


def estimate_memory(
    program: Program,
    graph: ExportedGraph,
    spaces: SpaceTable,
    extraction: Extraction,
    state_args: frozenset[int] = frozenset(),  # flat positions of loop-carried state
    donated_outputs: frozenset[int] = frozenset(),  # flat outputs written into donated buffers
) -> MemoryEstimate:
    ch = extraction.choices
    feeds_heavy, after_heavy = heavy_roles(program)

    def bytes_of(vid: int, lid: int | None) -> int:
        v = program.values[vid]
        sp = spaces.space(v.shape, v.dtype)
        return spaces.shard_bytes(sp, lid) if lid is not None else v.nbytes

    params = opt = inputs = 0
    by_path: dict[str, int] = {}
    weight_shapes = set()
    for pos, vid in enumerate(program.args):
        grp = graph.value_group.get(vid)
        lid = ch[grp].layout if grp in ch else None
        b = bytes_of(vid, lid)
        by_path[program.arg_paths[pos]] = b
        # roles: with loop-carried state, weights are the state a contraction reads and the
        # rest of the state is optimizer state; without it, every argument is an input
        if pos in state_args and feeds_heavy[vid]:
            params += b
            weight_shapes.add((program.values[vid].shape, str(program.values[vid].dtype)))
        elif pos in state_args:
            opt += b
        else:
            inputs += b
    # gradients: contraction-derived values with a weight's shape that feed no contraction
    grads = 0
    seen: set[int] = set()
    sequence = execution_order(program)

    def group(v: int) -> int | None:
        return graph.value_group.get(program.alias(v))

    def key(v: int) -> int | None:  # a folded loop's member is its own array
        return -1 - v if v in program.aliases else group(v)

    for eqn in sequence:
        for o in eqn.outputs:
            v = program.values[o]
            grp, k = group(o), key(o)
            if grp is None or grp not in ch or k in seen:
                continue
            if eqn.name in HEAVY and after_heavy[o] and not feeds_heavy[o] and \
                    (v.shape, str(v.dtype)) in weight_shapes and len(v.shape) >= 2:
                seen.add(k)  # type: ignore[arg-type]
                reduced = [lid for lid in (*ch[grp].demanded, ch[grp].layout) if not spaces.layouts[lid].partial]
                grads += min(bytes_of(o, lid) for lid in reduced) if reduced else bytes_of(o, None)
    # peak of live intermediates, in execution order (a folded loop's body once per repeat, on
    # each repeat's own arrays); values the e-graph merged are computed once
    last_use: dict[int, int] = {}
    for i, e in enumerate(sequence):
        for a in e.inputs:
            if isinstance(a, int) and key(a) is not None:
                last_use[key(a)] = i  # type: ignore[index]
    end = len(sequence)
    in_donated: set[int] = set()
    for k, o in enumerate(program.outputs):
        if not isinstance(o, Literal) and key(o) is not None:
            last_use[key(o)] = end  # type: ignore[index]
            if k in donated_outputs:
                in_donated.add(key(o))  # type: ignore[arg-type]  # written into the donated argument's buffer
    events: list[tuple[int, int]] = []
    born: set[int] = set()
    for i, e in enumerate(sequence):
        for o in e.outputs:
            grp, k = group(o), key(o)
            if grp is None or grp not in ch or k in born or k in in_donated:
                continue
            born.add(k)  # type: ignore[arg-type]
            c = ch[grp]
            size = bytes_of(o, c.layout) + sum(bytes_of(o, lid) for lid in c.demanded if lid != c.layout)
            events.append((i, size))
            events.append((last_use.get(k, i) + 1, -size))  # type: ignore[arg-type]
    events.sort()
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    outs = 0
    for k, (o, lid) in enumerate(zip(program.outputs, extraction.root_layouts, strict=True)):
        if isinstance(o, Literal) or k in donated_outputs:
            continue
        outs += bytes_of(o, lid)
    return MemoryEstimate(params, opt, inputs, grads, peak, outs, by_path)


def execution_order(program: Program) -> list[Equation]:
    """The equations as the runtime runs them: a folded loop's body is replayed once per repeat,
    as that repeat's original equations (on its own arrays)."""
    bodies: dict[int, list[int]] = {}
    for eqn in program.equations:
        if eqn.region is not None and program.scans[eqn.region].folded:
            bodies.setdefault(eqn.region, []).append(eqn.index)
    out: list[Equation] = []
    for eqn in program.equations:
        s = eqn.region
        if s is None or s not in bodies:
            out.append(eqn)
            continue
        if eqn.index != bodies[s][0]:
            continue
        reg = program.scans[s]
        for j in range(reg.length):
            for t in bodies[s]:
                out.append(reg.replay[t][j])
    return out
