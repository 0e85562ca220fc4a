"""Per-device memory of a plan, as XLA allocates it: arguments, outputs and the peak of
temporaries, from the layouts extraction chose.

The compiled program's own accounting (`compiled.memory_analysis()`) is the reference: its
footprint is arguments + outputs - aliased + temps. Arguments are the shards the program reads
(jax.jit drops arguments nothing reads); outputs have their own buffers for the whole run, except
those written into a donated argument's buffer (loop-carried state: aliased, counted once, as
the argument); temps are everything else, at their peak (liveness.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..egraph.collectives import COLLECTIVES
from ..egraph.export import ExportedGraph
from ..egraph.layout import SpaceTable
from ..egraph.program import Literal, Program
from .branches import BranchRoots, branch_roots, taken_by_branch_results
from .buffers import Allocation, Temp, chain_copies
from .liveness import Buf, Key, Peak, PlanLiveness, Timeline, execution_order
from .result import Extraction
from .structure import heavy_roles, is_heavy


@dataclass
class MemoryEstimate:
    parameters: int  # arguments read by a contraction (weights)
    optimizer_state: int  # other loop-carried state (moments, counters)
    inputs: int  # other arguments (the batch)
    gradients: int  # reduced gradients: contraction results with a weight's shape, feeding only the update (in the peak)
    activations_peak: int  # peak of temporaries: every buffer that is neither an argument nor an output
    outputs: int  # outputs not written into a donated argument's buffer
    by_path: dict[str, int] = field(default_factory=dict)  # per argument, in its planned layout
    unused: int = 0  # arguments the program never reads: jax.jit does not pass them (not in total)
    # donated arguments XLA copies before their new values are written (copy insertion: a
    # reader is not ordered before the update), by path; in the peak (or in freed buffers)
    copied: tuple[str, ...] = ()

    @property
    def arguments(self) -> int:
        return self.parameters + self.optimizer_state + self.inputs

    @property
    def total(self) -> int:
        """Arguments, outputs and the peak of temporaries: XLA's argument + output - alias + temp."""
        return self.arguments + self.outputs + self.activations_peak

    def parts(self) -> str:
        """The total's parts in words, for messages. Without loop-carried state (state_argnums)
        weights are not told from inputs, so the arguments are one part."""
        if self.parameters or self.optimizer_state:
            args = (f"parameters {self.parameters:,}, optimizer state {self.optimizer_state:,}, "
                    f"other arguments {self.inputs:,}")
        else:
            args = f"arguments {self.inputs:,}"
        return f"{args}, outputs {self.outputs:,}, peak intermediates {self.activations_peak:,}"


class MemoryModel:
    """Estimates for the plans of one planned program: the program's liveness structure is
    built once (on first use) and shared by every plan the search prices."""

    def __init__(self, program: Program, graph: ExportedGraph, spaces: SpaceTable,
                 ties: tuple[tuple[int, int], ...] = (),  # (flat argument, flat output) of loop-carried state
                 pins: dict[int, frozenset[int]] | None = None,  # argument pins (unused ones' layout)
                 tables: Any = None) -> None:  # rule tables: a loaded plan's operand layouts
        self.tables = tables
        self.program = program
        self.graph = graph
        self.spaces = spaces
        self.ties = tuple(ties)
        self.state_args = frozenset(a for a, _ in self.ties)
        self.donated_outputs = frozenset(k for _, k in self.ties)
        self.pins = pins or {}
        self._timeline: Timeline | None = None
        self._roles: tuple[list[bool], list[bool]] | None = None
        self._carries: list[tuple[frozenset[int], int, Key, int]] | None = None  # loop_carries
        self._roots: BranchRoots | None = None  # branch_roots
        self._views: dict[Key, list[tuple[Buf, set[int]]]] = {}  # the last plan's views_by_value
        self.last_peak: Peak | None = None
        self.last_copied: list[int] = []  # the arguments the last `peak` copies (copy insertion)

    @property
    def timeline(self) -> Timeline:
        if self._timeline is None:
            self._timeline = Timeline(self.program, self.graph, self.spaces, self.tables)
        return self._timeline

    def bytes_of(self, vid: int, lid: int | None) -> int:
        v = self.program.values[vid]
        return v.nbytes if lid is None else self.spaces.shard_bytes(self.spaces.space(v.shape, v.dtype), lid)

    def estimate(self, ex: Extraction) -> MemoryEstimate:
        if self._roles is None:
            self._roles = heavy_roles(self.program)
        feeds_heavy, _ = self._roles
        prog, ch = self.program, ex.choices
        params = opt = inputs = unused = 0
        by_path: dict[str, int] = {}
        for pos, vid in enumerate(prog.args):
            grp = self.graph.value_group.get(vid)
            lid = ch[grp].layout if grp in ch else self._pinned(pos)
            b = self.bytes_of(vid, lid)
            by_path[prog.arg_paths[pos]] = b
            # roles: with loop-carried state, weights are the state a contraction reads and the
            # rest of the state is optimizer state; without it, every argument is an input
            if grp not in ch:
                unused += b
            elif pos in self.state_args and feeds_heavy[vid]:
                params += b
            elif pos in self.state_args:
                opt += b
            else:
                inputs += b
        outs = 0
        for k, (o, lid) in enumerate(zip(prog.outputs, ex.root_layouts, strict=True)):
            if isinstance(o, Literal) or k in self.donated_outputs:
                continue
            outs += self.bytes_of(o, lid)
        peak = self.peak(ex)
        copied = tuple(prog.arg_paths[a] for a in self.last_copied)
        return MemoryEstimate(params, opt, inputs, self.gradients(ex), peak.bytes, outs, by_path, unused, copied)

    def _pinned(self, pos: int) -> int | None:
        """The layout an argument the plan never reads is passed in: its pin's (of a partial pin,
        the one that splits least), as Plan.in_shardings passes it."""
        lays = self.pins.get(pos)
        if not lays:
            return None
        layouts = self.spaces.layouts
        return min(lays, key=lambda lid: (len(layouts[lid].used_axes()), lid))

    def peak(self, ex: Extraction) -> Peak:
        """The peak of temporaries: buffers that are neither arguments, constants nor outputs,
        less what XLA places in output and donated-argument allocations (buffers.py)."""
        tl, prog = self.timeline, self.program
        live = PlanLiveness(tl, ex)
        live.run()
        self._views = views_by_value(live)
        excluded: set[Buf] = set()
        fixed: dict[Buf, Allocation] = {}
        for vid in prog.args + prog.const_values:
            k = tl.key(vid)
            grp = self.graph.value_group.get(vid)
            if k is not None and grp in ex.choices:
                excluded.add((k, ex.choices[grp].layout))
        if self._roots is None:
            self._roots = branch_roots(tl)
        excluded |= taken_by_branch_results(live, self._roots)  # they live in the conditional's buffer
        donated = {k: a for a, k in self.ties}
        copies: list[Temp] = []
        # copies of arguments whose buffers are then free, and whether a later copy may take that buffer
        freed: list[tuple[Temp, Allocation, bool]] = []
        self.last_copied = []
        combined = live.combined
        end = len(tl.seq)
        loops = self._loop_state_copies(live)
        copies += [t for t, _ in loops] + self._constant_slices(live, ex)
        for n, (o, lid) in enumerate(zip(prog.outputs, ex.root_layouts, strict=True)):
            k = tl.key(o) if isinstance(o, int) else None
            if k is None or lid is None:
                continue
            b = (k, lid)
            alloc = fixed.setdefault(b, Allocation(self.bytes_of(o, lid)))
            excluded.add(b)
            alloc.busy.append((live.born.get(b, 0), end, b in live.inplace))
            if n in donated:  # written into the argument's buffer: busy while the argument is read
                got, free = self._donated(live, alloc, prog.args[donated[n]], b, combined)
                self.last_copied += [donated[n]] if got else []
                if free:
                    freed += [(t, alloc, not self._gathered(ex, o, lid)) for t in got]
                else:
                    copies += got
        copies += chain_copies(freed) + freed_states(live, loops, excluded)
        self.last_peak = live.peak(excluded, list(fixed.values()), copies)
        return self.last_peak

    def _constant_slices(self, live: PlanLiveness, ex: Extraction) -> list[Temp]:
        """A closed-over constant is embedded in the program whole (no argument, output or temp
        buffer), but one a plan holds split is sliced per device into a temporary, made at the
        start (it waits on nothing) and held to its last read (XLA:CPU: a captured 16 MiB matrix
        read split 8 ways holds a 2 MiB temp, which the estimate left out)."""
        out = []
        for vid in self.program.const_values:
            k, grp = self.timeline.key(vid), self.graph.value_group.get(vid)
            if k is None or grp not in ex.choices or not self.spaces.layouts[ex.choices[grp].layout].used_axes():
                continue
            b = (k, ex.choices[grp].layout)
            if b in live.last:
                out.append(Temp(self.bytes_of(vid, b[1]), 0, live.last[b], tag=b))
        return out

    def _donated(self, live: PlanLiveness, alloc: Allocation, arg: int, out: Buf,
                 combined: tuple[tuple[int, int], ...]) -> tuple[list[Temp], bool]:
        """The old value of a donated argument holds its buffer until its last read. Where a
        reader is not provably before the new value's producer, XLA copies the argument first
        (copy insertion; returns the copy). Where the new value is computed in place from the
        old one (an elementwise update in the argument's own layout) and only dots reading it
        transposed are late, the copy is their transposed copy and the update still reads the
        parameter itself (an XLA:CPU dump shows the copy, fused with the layout change, read
        by exactly those): the copy lives until their last read and the buffer holds the old
        value until the update. Otherwise the copy is plain and every reader reads it (the
        update slices or reads the copy: XLA:CPU dumps of FSDP and weight-update-sharded Adam
        steps), so the buffer is free from the start (True: then a later argument's copy may
        take it, buffers.chain_copies)."""
        tl, ch = self.timeline, live.ch
        ka, grp = tl.key(arg), self.graph.value_group.get(arg)
        if ka is None or grp not in ch:
            return [], False
        b = (ka, ch[grp].layout)
        last = max([live.last.get(b, 0), *(r for _, rs in slice_views(live, self._views, b) for r in rs)])
        made = tl.made_at.get(out[0])
        late = [] if made is None else self._late_readers(live, b, made, combined)
        if not late:
            alloc.busy.append((0, last, False))
            return [], False
        transposed = set().union(*live.copy_groups.get(b, []))
        if out not in live.inplace or not transposed.issuperset(late):
            alloc.busy.append((0, 0, False))
            return [Temp(tl.size(*b), 0, last, tag=b)], True
        late = [r2 for r in late for r2 in tl.mreaders.get(r, (r,))]
        alloc.busy.append((0, made, False))
        return [Temp(tl.size(*b), 0, min(last, max(late, default=last)), tag=b)], False

    def _gathered(self, ex: Extraction, vid: int, lid: int) -> bool:
        """Is output `vid` returned in another layout than it is made in (a weight's update made
        split and gathered whole, as weight-update sharding does)?"""
        grp = self.graph.value_group.get(vid)
        return grp in ex.choices and ex.choices[grp].layout != lid

    def _late_readers(self, live: PlanLiveness, b: Buf, made: int, combined: tuple[tuple[int, int], ...]) -> list[int]:
        """The readers of a donated argument's buffer not provably before its new value's
        producer `made`: those of the buffer and of its slices read in place. Dots reading one
        transposed copy of it read the copy, which is made before every one of them: the copy
        is early enough where any of them is."""
        tl = self.timeline
        late: list[int] = []
        for v, readers in [(b, live.direct.get(b[0], set())), *slice_views(live, self._views, b)]:
            groups = live.copy_groups.get(v, [])
            via_copy = set().union(*groups)
            late += [r for r in readers - via_copy if not tl.runs_before({r}, made, combined)]
            for g in groups:
                if not any(tl.runs_before({r}, made, combined) for r in g):
                    late += sorted(g)
        return late

    def _loop_state_copies(self, live: PlanLiveness) -> list[tuple[Temp, int]]:
        """Copy insertion inside a loop's body: the new carry is written into the loop state's
        buffer, so where a reader of the old carry is not provably before the new value's
        producer, XLA copies the old carry as the body starts and every reader in the body reads
        the copy (a fori_loop of SGD steps on 1x8: the input gradient's product reads the second
        weight, unordered with its update; `copy.10` in the body's XLA:CPU dump). Each copy comes
        with the position writing the new value: the state's buffer is free in between
        (freed_states)."""
        if self._carries is None:
            self._carries = loop_carries(self.timeline)
        tl, out = self.timeline, []
        for body, start, kf, made in self._carries:
            if kf not in live.produced:
                continue
            b = (kf, live.produced[kf])
            if any(r in body for r in self._late_readers(live, b, made, live.combined)):
                reads = [*live.direct.get(kf, ()), *(r for _, rs in slice_views(live, self._views, b) for r in rs),
                         *(r for g in live.copy_groups.get(b, []) for r in g)]
                out.append((Temp(tl.size(*b), start, max(r for r in reads if r in body), tag=b), made))
        return out

    def gradients(self, ex: Extraction) -> int:
        """Reduced gradients: contraction-derived values with a weight's shape that feed no
        contraction (a part of the peak, reported on its own)."""
        if self._roles is None:
            self._roles = heavy_roles(self.program)
        feeds_heavy, after_heavy = self._roles
        prog, ch, tl = self.program, ex.choices, self.timeline
        weight_shapes = {(prog.values[prog.args[a]].shape, str(prog.values[prog.args[a]].dtype))
                         for a in self.state_args if feeds_heavy[prog.args[a]]}
        grads = 0
        seen: set[int] = set()
        for eqn in tl.seq:
            for o in eqn.outputs:
                v = prog.values[o]
                grp, k = self.graph.value_group.get(prog.alias(o)), tl.key(o)
                if grp is None or grp not in ch or k is None or k in seen:
                    continue
                if is_heavy(eqn) and after_heavy[o] and not feeds_heavy[o] and \
                        (v.shape, str(v.dtype)) in weight_shapes and len(v.shape) >= 2:
                    seen.add(k)
                    c = ch[grp]
                    reduced = [lid for lid in (*c.demanded, c.layout) if not self.spaces.layouts[lid].partial]
                    grads += min(self.bytes_of(o, lid) for lid in reduced) if reduced else self.bytes_of(o, None)
        return grads


def freed_states(live: PlanLiveness, loops: list[tuple[Temp, int]], excluded: set[Buf]) -> list[Temp]:
    """A loop state copied in the body (MemoryModel._loop_state_copies) is free from the copy
    until the new value is written, and XLA's heap reuses it (three weights of a fori_loop of
    SGD steps whose result a loss reads: 1.097 of compiled with the states held). The state
    is then two buffers of the heap; one `excluded` from it (an output's allocation) stays
    busy: which of the body's temporaries XLA puts there its heuristics decide (every one that
    fits in, as reuse_fixed places them, read 0.929 of compiled on 2x2x2), so the estimate errs
    high there, by at most the carry."""
    out = []
    for copy, made in loops:
        b = copy.tag
        if b in excluded or b not in live.born:
            continue
        excluded.add(b)  # type: ignore[arg-type]
        born, last = live.born[b], live.last.get(b, made)  # type: ignore[index]
        out += [Temp(copy.size, born, copy.start, b in live.inplace, b), Temp(copy.size, made, max(last, made), tag=b)]
    return out


def loop_carries(tl: Timeline) -> list[tuple[frozenset[int], int, Key, int]]:
    """Per carry of a loop XLA runs (not folded) that its body changes: the body's positions,
    where the body starts, the loop state's key (the final carry's) and the position making
    the new value (MemoryModel._loop_state_copies)."""
    out = []
    for reg in tl.program.scans:
        start = tl.start.get(reg.index)
        if reg.folded or reg.kind not in ("scan", "while") or start is None:
            continue
        body = frozenset(t for t in range(start, len(tl.seq)) if tl.in_region(t, reg.index))
        for cin, cout in zip(reg.carry_in, reg.carry_out, strict=True):
            kc, ko = tl.key(cin), tl.key(cout) if isinstance(cout, int) else None
            kf = tl.redirect.get(kc, kc) if kc is not None else None
            made = tl.made_at.get(ko) if ko is not None and ko not in (kc, kf) else None
            if kf is not None and made in body:
                out.append((body, start, kf, made))
    return out


def views_by_value(live: PlanLiveness) -> dict[Key, list[tuple[Buf, set[int]]]]:
    """The run's view_readers by value, in their order: slice_views is asked of every argument,
    and scanning all views each time was quadratic (1.2 s of a 96-layer step's estimate)."""
    out: dict[Key, list[tuple[Buf, set[int]]]] = {}
    for v, readers in live.view_readers.items():
        out.setdefault(v[0], []).append((v, readers))
    return out


def slice_views(live: PlanLiveness, views: dict[Key, list[tuple[Buf, set[int]]]], b: Buf
                ) -> list[tuple[Buf, set[int]]]:
    """The views of buffer `b` in another layout that slice it in place (a sharded product or
    update reading its part of a replicated weight), each with the positions reading it: they
    read `b`'s own buffer, as late as they run (an XLA:CPU dump of a weight-update-sharded
    Adam step copies each weight whose input gradient's product reads a slice of it)."""
    return [(v, readers) for v, readers in views.get(b[0], ()) if v[1] != b[1] and _sliced_from(live, v, b[1])]


def _sliced_from(live: PlanLiveness, v: Buf, lid: int) -> bool:
    """Is view `v` made from its value in layout `lid` by slices alone (one hop per axis)?"""
    seen = {v[1]}
    while v[1] != lid:
        s = live.step_to.get(v)
        if s is None or not COLLECTIVES[s.kind].fuses or s.src in seen:  # type: ignore[attr-defined]
            return False
        v = (v[0], s.src)  # type: ignore[attr-defined]
        seen.add(v[1])
    return True


def estimate_memory(
    program: Program,
    graph: ExportedGraph,
    spaces: SpaceTable,
    extraction: Extraction,
    ties: tuple[tuple[int, int], ...] = (),  # (flat argument, flat output) of loop-carried state
    pins: dict[int, frozenset[int]] | None = None,
    tables: Any = None,
) -> MemoryEstimate:
    """One plan's estimate (MemoryModel.estimate, for callers that price a single plan)."""
    return MemoryModel(program, graph, spaces, ties, pins, tables).estimate(extraction)


__all__ = ["MemoryEstimate", "MemoryModel", "estimate_memory", "execution_order"]
