"""The peak of temporary buffers XLA allocates for a plan: liveness of the buffers the plan
materialises (see fusion.py), in the order the runtime traces the program.

XLA's memory analysis splits a program's memory into arguments, outputs (their own buffers,
whole from the start: a donated argument's buffer holds the output written into it) and temps:
every other buffer, packed by its heap simulator. Temps here are the materialised results of
equations, the per-layout copies a plan's collectives make (an all-gathered weight lives from
its first reader to its last, forward and backward alike), and the full-size buffer of a
reduce-scatter that XLA:CPU runs as an all-reduce and a slice. A fused value is read where its
fused readers run: its own operands stay live until then.

Loops run their body once per iteration on the same buffers, so a body's temps count once,
while stacked outputs and final carries are allocated when the loop starts. A branch runs alone:
the other branches' temps are never live with it.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..egraph.collectives import COLLECTIVES
from ..egraph.export import ExportedGraph, NodeKind
from ..egraph.layout import SpaceTable
from ..egraph.program import Equation, Literal, Program, dtype_name, itemsize
from ..rules.registry import rule_for
from . import deadcode, fusion, library
from .branches import passed_resharded
from .buffers import Allocation, Temp, heap_peak, packed_heap, reuse_fixed, share_inplace
from .chains import chain_transients
from .result import Extraction, GroupChoice
from .sends import assembled_views, sent_early, sent_fused, sliced_sends, stored_for_whole_reads

if TYPE_CHECKING:
    from ..rules.apply import RuleTables

Key = int  # a value group, or -1 - v for a folded loop member v (each repeat's own array)
Buf = tuple[Key, int]  # (key, layout)


@dataclass
class Peak:
    bytes: int
    time: int  # position in the execution order
    live: list[tuple[Buf, int]]  # buffers live at the peak and their sizes (largest first)


def constant_folded(seq: list[Equation], producer: dict[int, int]) -> list[bool]:
    """Per equation: does it read constants alone (literals, or results of such equations), with
    no effect? `producer`: value -> the position of the equation making it (none: an argument)."""
    out = [False] * len(seq)
    for i, e in enumerate(seq):
        out[i] = not e.effects and all(producer.get(a, i) < i and out[producer[a]]
                                       for a in e.inputs if isinstance(a, int))
    return out


class Timeline:
    """What of a program's liveness does not depend on the plan: the execution order, who reads
    what, which results XLA keeps whole. Built once per planned program; `peak` runs per plan."""

    def __init__(self, program: Program, graph: ExportedGraph, spaces: SpaceTable,
                 tables: RuleTables | None = None) -> None:
        self.program = program
        self.graph = graph
        self.spaces = spaces
        self.tables = tables  # the strategies, where the graph has no children (a loaded plan)
        self._whole: dict[tuple[int, int], bool] = {}  # (id of an equation, operand) -> reads_whole
        self._fed: dict[int, Equation] = {}  # id of a library reduction -> the op computing its operand
        self.masked: dict[int, int] = {}  # a masking multiply a library reduction reads -> its boolean operand
        self._readers: dict[int, list[Equation]] = {}  # value -> the equations reading it
        self._literals: dict[fusion.LiteralKey, int] = {}  # a scalar literal at a shape -> its readers
        dead = deadcode.dead_equations(program, self.key)  # XLA removes them first
        for e in program.equations:
            if id(e) in dead:
                continue
            for a in e.inputs:
                if isinstance(a, int):
                    self._readers.setdefault(a, []).append(e)
            for lk in self._literal_keys(e):
                self._literals[lk] = self._literals.get(lk, 0) + 1
        base = self.seq = [e for e in execution_order(program) if id(e) not in dead]
        self._keys()
        self.widened: set[Key] = set()  # widened_keys, once the order is known
        self._static_stored()
        self._schedule(base, set())
        # XLA:CPU's library fusions (YNNPACK), found in this order
        self.fusions = library.fused_keys(self, self.boundary) if spaces.mesh.platform == "cpu" else []
        self.inside = {k for f in self.fusions for k in f.inside}
        for f in self.fusions:
            self.stored.update(f.stored)
        fed = library.fed_duplicates(self)
        if self.inside or not fed <= self.duplicated:  # each library fusion is one instruction
            self.duplicated |= fed
            self._schedule(base, {(id(self.seq[t]), k) for t, k in library.fed_reads(self)})
        self.in_library = {k for f in self.fusions for k in f.inside | f.roots}
        self.widened, self.widened_args = widened_keys(self)
        self._regions()
        self._dependencies()
        self.read_at = read_positions(self)
        # per position and operand: does the reader need it whole (every plan's liveness reads it)
        fed = library.fed_reads(self)
        self.whole_at = [[isinstance(a, int) and (self.reads_whole(e, pos, a) or (t, self.key(a)) in fed)
                          for pos, a in enumerate(e.inputs)] for t, e in enumerate(self.seq)]
        self.literal_broadcasts = self._literal_broadcasts()
        platform = spaces.mesh.platform
        self.cumulative = [t for t, e in enumerate(self.seq) if rule_for(e.primitive).prefix_scan]
        self.draws = [t for t, e in enumerate(self.seq) if e.name == "random_bits"]
        self.flattened = {k for t, e in enumerate(self.seq) if e.name == "dot_general"
                          and fusion.flattened_product(e, tuple(len(program.values[a].shape) if isinstance(a, int)
                                                                else 0 for a in e.inputs)) for k in self.first[t]}
        self.dense = {t: ops for t, e in enumerate(self.seq) if (ops := fusion.dense_ragged_operands(e, platform))}
        self.sendable = frozenset(k for k in self.readers_whole - self.hoisted_whole if stored_for_whole_reads(self, k))

    # -- static structure ---------------------------------------------------------------------
    def key(self, v: int) -> Key | None:
        prog = self.program
        if v in prog.aliases:
            return -1 - v
        return self.graph.value_group.get(prog.alias(v))

    def _keys(self) -> None:
        """Per position: the output keys it is the first to compute (later equal equations do not
        run: the e-graph merged them), and every key's representative value."""
        self.rep: dict[Key, int] = {}
        self.first: list[list[Key]] = []
        for e in self.seq:
            mine = []
            for o in e.outputs:
                k = self.key(o)
                if k is not None and k not in self.rep:
                    self.rep[k] = o
                    mine.append(k)
            self.first.append(mine)
        for v in self.program.args + self.program.const_values:
            k = self.key(v)
            if k is not None:
                self.rep.setdefault(k, v)

    def _schedule(self, base: list[Equation], fed: set[tuple[int, Key]]) -> None:
        """Order `base` (the program's order) breadth first as XLA:CPU schedules it (bfs_order),
        with the buffers `stored` says are kept; loops and branches keep their own order. `fed`:
        (id of an equation, key) where a library fusion's member reads a value as a buffer."""
        self.breadth_first = all(reg.folded for reg in self.program.scans)
        if not self.breadth_first:
            return
        self.seq = base
        self._keys()
        self.seq = bfs_order(base, [any(self.stored.get(k, True) for k in ks) for ks in self.first],
                             recomputing_reads(self, fed), copying_reads(self, fed))
        self._keys()

    def _dependencies(self) -> None:
        """Per position: the positions it depends on (a bitset) and, for a fused result, the
        stored positions that read it (each computes it again). XLA writes a donated argument's
        new value into its buffer only where every reader of the old one provably runs first
        (copy insertion, on dependencies): these say which readers do."""
        self.dots = frozenset(t for t, e in enumerate(self.seq)  # positions XLA may copy operands at
                              if fusion.may_transpose(e) and all(isinstance(a, int) for a in e.inputs))
        self._transposed: dict[tuple[int, tuple[int | None, ...]], dict[int, tuple[int, ...]]] = {}
        made_at: dict[Key, int] = {}
        for t, ks in enumerate(self.first):
            for k in ks:
                made_at[k] = t
        self.made_at = made_at
        self.anc: list[int] = []
        deps: list[set[int]] = []
        for t, e in enumerate(self.seq):
            mine = {made_at[k] for a in e.inputs if isinstance(a, int)
                    for k in [self.key(a)] if k is not None and made_at.get(k, t) < t}
            deps.append(mine)
            bits = 0
            for d in mine:
                bits |= self.anc[d] | (1 << d)
            self.anc.append(bits)
        runs = [not ks or any(self.stored.get(k, True) for k in ks) for ks in self.first]
        readers: list[set[int]] = [set() for _ in self.seq]
        for t in range(len(self.seq)):
            for d in deps[t]:
                readers[d].add(t)
        self.mreaders: dict[int, frozenset[int]] = {}
        for t in range(len(self.seq) - 1, -1, -1):
            if not runs[t]:
                self.mreaders[t] = frozenset(r2 for r in readers[t]
                                             for r2 in (self.mreaders.get(r, frozenset({r}))))

    def runs_before(self, readers: set[int], t: int, combined: tuple[tuple[int, int], ...] = ()) -> bool:
        """Do all `readers` (positions) run before position t, by dependency (or are t)?
        `combined`: per all-reduce XLA combines into one, (sources, their ancestors): what
        depends on one of its sources depends on all."""
        anc, grown = self.anc[t], True
        while grown:  # one wave's results may be what another's sources wait for
            grown = False
            for bits, above in combined:
                if anc & bits and above & ~anc:
                    anc, grown = anc | above, True
        for r in readers:
            for r2 in self.mreaders.get(r, (r,)):
                if r2 != t and not (anc >> r2) & 1:
                    return False
        return True

    def _regions(self) -> None:
        """Loop regions (real scans and while loops) and when each starts; carry inputs read the
        loop's state, which is the final carry's buffer."""
        prog = self.program
        self.start: dict[int, int] = {}
        for t, e in enumerate(self.seq):
            r = e.region
            while r is not None:
                self.start.setdefault(r, t)
                r = prog.scans[r].parent
        self.loop_span = loop_spans(self.seq, prog)
        self.redirect: dict[Key, Key] = {}
        for reg in prog.scans:
            if reg.folded or reg.kind not in ("scan", "while"):
                continue
            for cin, fin in zip(reg.carry_in, reg.final, strict=True):
                kc, kf = self.key(cin), self.key(fin)
                if kc is not None and kf is not None and kc != kf:
                    self.redirect[kc] = kf
                    self.rep.setdefault(kc, cin)

    def held_through(self, t: int, born: int) -> int:
        """A buffer made before a loop and read inside it is read by every iteration: it lives
        until the loop's last instant (the outermost such loop's)."""
        end = t
        r = self.seq[t].region if t < len(self.seq) else None
        while r is not None:
            lp = self.program.run_loop(r)
            span = self.loop_span.get(lp) if lp is not None else None
            if span is not None and span[0] > born:
                end = max(end, span[1])
            r = self.program.scans[r].parent
        return end

    def in_region(self, t: int, r: int) -> bool:
        """Does position `t` run inside region `r` (or a region nested in it)? Past the program's
        end (where outputs are read) is no region's."""
        q = self.seq[t].region if t < len(self.seq) else None
        while q is not None and q != r:
            q = self.program.scans[q].parent
        return q == r

    def birth_time(self, t: int) -> int:
        """A loop's stacked outputs and final carries exist from the loop's start."""
        e = self.seq[t]
        if e.name in ("scan_final", "scan_stack"):
            return self.start.get(e.params["scan"], t)
        if e.name == "cond_merge":
            return min((self.start.get(r, t) for r in e.params["cond"]), default=t)
        return t

    def _static_stored(self) -> None:
        """Which keys XLA keeps as buffers whatever the layouts (fusion.stored)."""
        prog = self.program
        readers, whole, hoisted = key_readers(self)
        boundary: set[Key] = set()
        for o in prog.outputs:
            if isinstance(o, int) and self.key(o) is not None:
                boundary.add(self.key(o))  # type: ignore[arg-type]
        for reg in prog.scans:
            if reg.folded:
                continue
            for a in [*reg.init, *reg.carry_out, *reg.xs, *reg.ys, *reg.outs, reg.pred, *reg.extra_reads]:
                if isinstance(a, int) and self.key(a) is not None:
                    boundary.add(self.key(a))  # type: ignore[arg-type]
        self.n_readers = {k: len(r) for k, r in readers.items()}
        made = {k: e for e in self.seq for o in e.outputs if (k := self.key(o)) is not None}
        self.stored: dict[Key, bool] = {}
        # cheap values stored for a reader that cannot fuse them, and computed again inside the
        # readers that can (XLA duplicates a cheap producer into every consumer that fuses it)
        self.duplicated: set[Key] = set()
        kernels: dict[Key, frozenset[object]] = {}  # a key -> the kernels computing it (itself, if stored)
        for t in range(len(self.seq) - 1, -1, -1):  # readers first: their kernels are known
            e = self.seq[t]
            for k in self.first[t]:
                kern = reader_kernels(readers.get(k, []), kernels, self.key)
                self.stored[k] = fusion.stored(e, readers.get(k, []), k in whole, k in boundary, self.degenerate(e),
                                               len(kern)) or self.unfused_concatenation(e)
                kernels[k] = frozenset({k}) if self.stored[k] else kern
                if self.stored[k] and k in whole and fusion.duplicable(e, self.operand_producers(e, made), prog) \
                        and not fusion.stored(e, readers[k], False, k in boundary, self.degenerate(e), len(kern)):
                    self.duplicated.add(k)
        for k in scatters_into_sums(self, readers, made):
            self.stored[k] = False
        self.shared_inside = shared_inside(self, readers)
        fusion.over_duplicated(self.seq, self.first, self.stored, self.key,  # type: ignore[arg-type]
                               lambda v: prog.values[v].shape)
        self.boundary = boundary
        self.readers_whole = whole
        self.hoisted_whole = hoisted

    def operand_producers(self, e: Equation, made: dict[Key, Equation]) -> list[Equation | None]:
        """Per value operand of `e`: the equation making it (None: an argument)."""
        return [made.get(k) if (k := self.key(a)) is not None else None for a in e.inputs if isinstance(a, int)]

    def reads_whole(self, e: Equation, pos: int, a: int) -> bool:
        """fusion.reads_whole for operand `pos` (value `a`) of `e`, with YNNPACK's reductions."""
        memo = self._whole
        got = memo.get((id(e), pos))
        if got is None:
            got = memo[(id(e), pos)] = self._reads_whole(e, pos, a)
        return got

    def enters_loop(self, e: Equation, a: int) -> bool:
        """Does `e` read `a` inside a real loop that `a` is made outside of? XLA passes it into
        the while loop whole: no producer or slice fuses into the body's reader."""
        prog, outer = self.program, set()
        r = prog.values[a].region
        while r is not None:
            outer.add(r)
            r = prog.scans[r].parent
        r = e.region
        while r is not None and r not in outer:
            lp = prog.run_loop(r)
            if lp is not None and lp not in outer:
                return True
            r = prog.scans[r].parent
        return False

    def degenerate(self, e: Equation) -> bool:
        """A reduction over size-1 dimensions only: XLA's simplifier makes it a reshape."""
        if fusion.kind(e) != fusion.Fuse.REDUCE or not e.inputs or not isinstance(e.inputs[0], int):
            return False
        shape = self.program.values[e.inputs[0]].shape
        return all(shape[int(d)] == 1 for d in e.params.get("axes", ()))

    def unfused_concatenation(self, e: Equation) -> bool:
        """fusion.unfused_concatenation, from the result's shape and dtype."""
        if e.name != "concatenate" or not e.outputs:
            return False
        v = self.program.values[e.outputs[0]]
        return fusion.unfused_concatenation(e, tuple(v.shape), itemsize(v.dtype))

    def _reads_whole(self, e: Equation, pos: int, a: int) -> bool:
        if self.enters_loop(e, a):
            return True  # an element of the loop's state: made (resharded) before the loop runs
        if self.degenerate(e):
            return False
        if self.unfused_concatenation(e) or (e.outputs and fusion.folds_into_dots(e, self._readers.get(e.outputs[0], []))):
            return True  # a copy; a transpose folded into the products, which read its operand whole
        if self.hoisted(e, pos, a) is not None:
            return False  # the sum reads the negation's operand (_static_stored counts that read)
        return reduction_reads_whole(self, e, pos, a)

    def hoisted(self, e: Equation, pos: int, a: int) -> int | None:
        """fusion.negated_sum_operand of operand `pos` (value `a`) of `e`."""
        p = self.program.values[a].producer
        return fusion.negated_sum_operand(e, pos, None if p is None else self.program.equations[p])

    def _through_view(self, a: int) -> Equation | None:
        """The equation computing value `a`, looked through a view that is its source's only
        reader (XLA makes the view a bitcast inside the reduction's fusion, which then reads
        the op beneath it)."""
        prog = self.program
        p = prog.values[a].producer
        src = prog.equations[p] if p is not None else None
        if src is None or src.name not in fusion.YNN_VIEWS or len(self._readers.get(a, ())) != 1:
            return src
        b = src.inputs[0] if src.inputs else None
        if not isinstance(b, int) or len(self._readers.get(b, ())) != 1 or prog.values[b].producer is None:
            return src
        below = prog.equations[prog.values[b].producer]  # type: ignore[index]
        return below if below.name not in fusion.YNN_KEPT_PRODUCERS else src

    def _literal_keys(self, e: Equation) -> list[fusion.LiteralKey]:
        """The scalar literals `e` reads, each at the shape of its result (XLA broadcasts it there)."""
        if not e.outputs:
            return []
        shape = tuple(self.program.values[e.outputs[0]].shape)
        return [(repr(a.value), str(a.dtype), shape) for a in e.inputs if isinstance(a, Literal)]

    def _literal_broadcasts(self) -> list[tuple[int, Key, fusion.LiteralKey]]:
        """(position of a library reduction, key of an op its fusion takes in, the literal) where
        XLA materialises that op's scalar literal operand (fusion.ynn_literal_broadcast): the op
        beneath the reduction and the one elementwise reader of its result (the fusion grows
        down into it), when another op reads the same literal at the same shape."""
        out: list[tuple[int, Key, fusion.LiteralKey]] = []
        for t, e in enumerate(self.seq):
            fed = self._fed.get(id(e))
            if fed is None or not self.first[t] or not e.outputs:
                continue
            r = self._readers[e.outputs[0]][0] if len(self._readers.get(e.outputs[0], ())) == 1 else None
            for op in (fed, r):
                if op is None or not fusion.ynn_literal_broadcast(op, down=op is r):
                    continue
                k = self.key(op.outputs[0]) if op.outputs else None
                for lk in self._literal_keys(op):
                    if k is not None and self._literals.get(lk, 0) > 1:
                        out.append((t, k, lk))
        return out

    def masks(self, e: Equation) -> bool:
        """A multiply by a boolean converted to a number (XLA makes it a select)."""
        return e.name == "mul" and self._mask_operand(e) >= 0

    def _mask_operand(self, e: Equation) -> int:
        """The value of `e`'s operand that is a boolean converted to a number, or -1."""
        for a in e.inputs:
            p = self.program.values[a].producer if isinstance(a, int) else None
            src = self.program.equations[p] if p is not None else None
            if src is not None and src.name == "convert_element_type" and isinstance(src.inputs[0], int) \
                    and self.program.values[src.inputs[0]].dtype == bool:
                return a  # type: ignore[return-value]
        return -1

    # -- per plan -----------------------------------------------------------------------------
    def operand_layouts(self, t: int, ch: dict[int, GroupChoice]) -> list[int | None]:
        """The layout each non-literal operand of the equation at `t` is read in, by the plan."""
        e = self.seq[t]
        for o in e.outputs:
            grp = self.graph.value_group.get(self.program.alias(o))
            if grp in ch:
                node = ch[grp].node
                if NodeKind(int(self.graph.node_kind[node])) == NodeKind.LOCAL:
                    kids = self.graph.children(node)
                    if len(kids) or self.tables is None or not e.inputs:
                        return [int(self.graph.class_layout[c]) for c in kids]
                    # a loaded plan's graph keeps the chosen nodes only: its strategy's operands
                    key = self.tables.output_key.get(o, self.tables.output_key.get(self.program.alias(o)))
                    if key is None:
                        return []
                    info, _ = self.tables.info(key)
                    return [int(x) for x in info.strategies[int(self.graph.node_a[node])].ins]
        return []

    def transposed(self, t: int, lids: tuple[int | None, ...]) -> dict[int, tuple[int, ...]]:
        """The operands of the dot at `t` XLA copies into another order (and that order), read
        in layouts `lids` (None: unsharded); they depend on the shard shapes
        (fusion.transposed_operands). Shared: not to be changed."""
        hit = self._transposed.get((t, lids))
        if hit is None:
            e, layouts, mesh = self.seq[t], self.spaces.layouts, self.spaces.mesh
            shapes = tuple(self.program.values[a].shape if lid is None
                           else layouts[lid].shard_shape(self.program.values[a].shape, mesh)
                           for a, lid in zip(e.inputs, lids, strict=True))
            hit = self._transposed[(t, lids)] = fusion.transposed_operands(e, shapes)
        return hit

    def size(self, k: Key, lid: int) -> int:
        v = self.program.values[self.rep[k]]
        return self.spaces.shard_bytes(self.spaces.space(v.shape, v.dtype), lid) * (2 if k in self.widened else 1)


def key_readers(tl: Timeline) -> tuple[dict[Key, list[Equation]], set[Key], set[Key]]:
    """Per key, the equations reading it; the keys some reader cannot fuse (reads whole); of
    those, the ones a sum of their negation reads whole (fusion.negated_sum_operand)."""
    readers: dict[Key, list[Equation]] = {}
    whole: set[Key] = set()
    hoisted: set[Key] = set()
    for e in tl.seq:
        if e.name == "cond_merge":
            continue  # a branch writes its results into the conditional's buffer
        for pos, a in enumerate(e.inputs):
            if isinstance(a, Literal):
                continue
            k = tl.key(a)
            if k is None:
                continue
            readers.setdefault(k, []).append(e)
            if tl.reads_whole(e, pos, a):
                whole.add(k)
            b = tl.hoisted(e, pos, a)
            if b is not None and tl.key(b) is not None and reduction_reads_whole(tl, e, pos, b):
                whole.add(tl.key(b))  # type: ignore[arg-type]
                hoisted.add(tl.key(b))  # type: ignore[arg-type]
    return readers, whole, hoisted


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


def reader_kernels(readers: list[Equation], kernels: dict[Key, frozenset[object]],
                   key: Callable[[int], Key | None]) -> frozenset[object]:
    """The kernels that compute a value's readers: a stored reader's own, a fused one's readers'
    (each computes it again); a reader with no key of its own is a kernel of its own."""
    out: set[object] = set()
    for r in readers:
        got = [kernels[k] for o in r.outputs if (k := key(o)) is not None and k in kernels]
        if not got:
            out.add(("equation", id(r)))
        for g in got:
            out |= g
    return frozenset(out)


def reduction_reads_whole(tl: Timeline, e: Equation, pos: int, a: int) -> bool:
    """fusion.reads_whole of operand `pos` of `e` read as value `a`, with YNNPACK's reductions
    (noted in `tl`: the op a library reduction reads, a masking multiply it reads)."""
    v = tl.program.values[a]
    library = False
    if fusion.kind(e) == fusion.Fuse.REDUCE and pos == 0:
        src = tl._through_view(a)
        library = fusion.ynn_reduce(e, v.shape, v.dtype, src, src is not None and tl.masks(src))
        if library and src is not None:
            tl._fed[id(e)] = src
            if tl.masks(src) and src.outputs:
                tl.masked[src.outputs[0]] = tl._mask_operand(src)
    return fusion.reads_whole(e, pos, len(v.shape), library)


def scatters_into_sums(tl: Timeline, readers: dict[Key, list[Equation]], made: dict[Key, Equation]) -> list[Key]:
    """`x + scatter-add(zeros, i, u)` (the gradient of a table both looked up and multiplied:
    tied embeddings): XLA's algebraic simplifier scatters into `x` itself, so neither the zeros
    nor the scatter's result is a buffer; the sum, written in place over `x`, is. Returns the
    keys of those zeros and scatters. `made`: each key's equation."""
    out: list[Key] = []
    for e in tl.seq:
        if e.name != "scatter-add" or len(e.outputs) != 1 or not isinstance(e.inputs[0], int):
            continue
        ks, kz = tl.key(e.outputs[0]), tl.key(e.inputs[0])
        zeros = made.get(kz) if kz is not None else None
        users = readers.get(ks, []) if ks is not None else []
        if zeros is None or len(users) != 1 or users[0].name not in ("add", "add_any") or len(readers.get(kz, [])) != 1:
            continue
        if zeros.name == "broadcast_in_dim" and len(zeros.inputs) == 1 and isinstance(zeros.inputs[0], Literal) \
                and float(zeros.inputs[0].value) == 0.0 and all(isinstance(a, int) for a in users[0].inputs):
            out += [kz, ks]  # type: ignore[list-item]
    return out


def shared_inside(tl: Timeline, readers: dict[Key, list[Equation]]) -> dict[Key, frozenset[Key]]:
    """Expensive values fused although several ops read them (all in one kernel: fusion.stored),
    each with the fused values between it and that kernel's root: a plan that stores one of
    those (a collective reads it) splits the kernel, and XLA then stores the expensive value too
    rather than compute it twice."""
    out: dict[Key, frozenset[Key]] = {}
    for t, e in enumerate(tl.seq):
        for k in tl.first[t]:
            if tl.stored[k] or fusion.kind(e) not in (fusion.Fuse.EXPENSIVE, fusion.Fuse.GATHER):
                continue
            if len({id(r) for r in readers.get(k, [])}) < 2:
                continue
            between: set[Key] = set()
            stack = [k]
            while stack:
                for r in readers.get(stack.pop(), []):
                    for o in r.outputs:
                        k2 = tl.key(o)
                        if k2 is not None and k2 not in between and not tl.stored.get(k2, True):
                            between.add(k2)
                            stack.append(k2)
            out[k] = frozenset(between)
    return out


def copying_reads(tl: Timeline, fed: set[tuple[int, Key]]) -> set[tuple[int, int]]:
    """(position, value) where a product reads, through a copy into another order, an
    operand a library fusion reads as a buffer: the copy reads that buffer too and is an
    instruction of its own between them (XLA:CPU: a weight gradient's product waits for its
    operand's transposed copy while the input gradient's library kernel, ready at once,
    runs first and frees the operand). Other copies compute their operand again beside its
    kernel (recomputed_reads) or are made with it: no step between. Judged on the unsplit
    shapes."""
    copies: dict[tuple[int, int], int] = {}  # (id of a product, value) -> its position
    for t, e in enumerate(tl.seq):
        if fusion.may_transpose(e) and all(isinstance(a, int) for a in e.inputs):
            shapes = tuple(tl.program.values[a].shape for a in e.inputs)  # type: ignore[index]
            copies |= {(id(e), e.inputs[pos]): t for pos in fusion.transposed_operands(e, shapes)}  # type: ignore[misc]
    return {(t, a) for (_, a), t in copies.items() if _fed_to_library(tl, a, fed, copies)}


def _fed_to_library(tl: Timeline, a: int, fed: set[tuple[int, Key]], copies: dict[tuple[int, int], int]) -> bool:
    """Does a library fusion's member read value `a` from outside (as a buffer)? Then a
    copy of it into another order reads that buffer too, a step after its producer."""
    k = tl.key(a)
    return tl.program.values[a].producer is not None and any(
        (id(r), k) in fed for r in tl._readers.get(a, ()) if (id(r), a) not in copies)


def recomputing_reads(tl: Timeline, fed: set[tuple[int, Key]]) -> set[tuple[int, int]]:
    """(position, value) where the equation at that position of `tl.seq` computes a
    duplicated value again inside its own fusion, not reading the value's buffer: it waits
    for the value's operands, not for the value (XLA:CPU: a batch norm's backward pass
    writes three products of the incoming gradient, each computing the relu's mask again,
    one after another before the library sums that read them)."""
    out: set[tuple[int, int]] = set()
    for t, e in enumerate(tl.seq):
        for pos, a in enumerate(e.inputs):
            k = tl.key(a) if isinstance(a, int) else None
            if k is not None and k in tl.duplicated and (id(e), k) not in fed \
                    and not tl.reads_whole(e, pos, a):
                out.add((t, a))  # type: ignore[arg-type]
    return out


def bfs_order(seq: list[Equation], runs: list[bool], recomputing: set[tuple[int, int]] = frozenset(),
              copying: set[tuple[int, int]] = frozenset()) -> list[Equation]:
    """The equations in the order XLA:CPU schedules its instructions: breadth first (its
    concurrency-optimised scheduler, Kahn's algorithm with a FIFO queue), which runs, for
    instance, every all-gather of a weight before the first layer. `runs[i]`: equation i is an
    instruction of its own; the others (fused into their readers, or computed before) pass
    readiness on at once and are placed with the first instruction that reads them (they run
    inside its kernel), but equations of constants alone, which XLA folds at compile time
    (HloConstantFolding: a scatter of `-1/n` into a zero buffer, the gradient of a loss's mean,
    is ready at the start, not after the chain of scalar ops that computes `-1/n`).
    `recomputing`: (i, value) where equation i computes the value again itself, so it depends on
    what the value's equation depends on. `copying`: (i, value) where equation i reads the value
    through a copy into another order, an instruction of its own (one per value) between them."""
    producer: dict[int, int] = {}
    for i, e in enumerate(seq):
        for o in e.outputs:
            producer.setdefault(o, i)
    folded = constant_folded(seq, producer)
    runs = [r and not c for r, c in zip(runs, folded, strict=True)]
    waits = _waits(seq, producer, recomputing, copying)
    runs += [True] * (len(waits) - len(seq))  # the copies
    order = _kahn(waits, runs, folded, len(seq))
    return [seq[i] for i in order] if len(order) == len(seq) else seq


def _waits(seq: list[Equation], producer: dict[int, int], recomputing: set[tuple[int, int]],
           copying: set[tuple[int, int]]) -> list[set[int]]:
    """Per equation, then per copy (bfs_order): what it waits for."""
    waits: list[set[int]] = []
    copies: dict[int, int] = {}  # value -> its copy's node, numbered after the equations
    copy_waits: list[set[int]] = []
    last_effect = None
    for i, e in enumerate(seq):
        deps: set[int] = set()
        for a in e.inputs:
            if not isinstance(a, int) or producer.get(a, i) >= i:
                continue
            p = producer[a]
            if (i, a) in copying:
                if a not in copies:
                    copies[a] = len(seq) + len(copy_waits)
                    copy_waits.append({p})
                deps.add(copies[a])
            else:
                deps |= waits[p] if (i, a) in recomputing else {p}
        if e.effects:
            if last_effect is not None:
                deps.add(last_effect)
            last_effect = i
        waits.append(deps)
    return waits + copy_waits


def _kahn(waits: list[set[int]], runs: list[bool], folded: list[bool], n: int) -> list[int]:
    """bfs_order's schedule of nodes 0..n-1 (equations; nodes from n on are copies, run and not
    listed): a FIFO queue of what runs; what does not is placed with its first reader."""
    users: list[list[int]] = [[] for _ in waits]
    indeg = [len(w) for w in waits]
    for i, w in enumerate(waits):
        for d in w:
            users[d].append(i)
    order: list[int] = []
    queue: deque[int] = deque()
    pending: dict[int, int] = {}  # fused equations ready, not yet placed -> when they became ready

    def ready(i: int) -> None:
        if runs[i]:
            queue.append(i)
            return
        if folded[i]:  # a constant: it exists from the start
            order.append(i)
        else:
            pending[i] = len(pending) + len(order)
        done(i)

    def done(i: int) -> None:
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready(u)

    def place(i: int) -> None:
        """Equation i, after the fused equations it reads through: they run inside its kernel."""
        need, stack = set(), [i]
        while stack:
            for d in waits[stack.pop()]:
                if d in pending and d not in need:
                    need.add(d)
                    stack.append(d)
        for d in sorted(need, key=pending.__getitem__):
            order.append(d)
            del pending[d]
        order.append(i)

    for i in [i for i in range(len(waits)) if indeg[i] == 0]:  # the roots as they are now: ready()
        ready(i)  # lowers later counts to 0 and readies those itself
    while queue:
        i = queue.popleft()
        if i < n:
            place(i)
        done(i)
    return order + sorted(pending, key=pending.__getitem__)


class PlanLiveness:
    """One plan's buffers on a Timeline: when each is made and last read."""

    def __init__(self, tl: Timeline, ex: Extraction) -> None:
        self.tl = tl
        self.ex = ex
        self.ch = ex.choices
        self.produced: dict[Key, int] = {}
        self.step_to: dict[Buf, object] = {}
        for k, v in tl.rep.items():
            grp = tl.graph.value_group.get(tl.program.alias(v))
            c = self.ch.get(grp) if grp is not None else None
            if c is not None:
                self.produced[k] = c.layout
                for s in c.steps:
                    self.step_to[(k, s.dst)] = s
        for kc, kf in tl.redirect.items():
            if kf in self.produced:
                self.produced[kc] = self.produced[kf]
        self.born: dict[Buf, int] = {}
        self.inplace: set[Buf] = set()  # made by an op that may write into a dying operand
        self.direct: dict[Key, set[int]] = {}  # positions that read a key in its produced layout
        self.view_readers: dict[Buf, set[int]] = {}  # positions that read a view
        self.combined: tuple[tuple[int, int], ...] = ()  # per combined all-reduce: sources, their ancestors
        self.last: dict[Buf, int] = {}
        self.ev: dict[Key, tuple[int, int]] = {}  # a fused value: (first, last) time its readers run
        self.duplicated: frozenset[Key] = frozenset()  # duplicated_values
        self.recomputed_at: dict[Key, int] = {}  # a duplicated value: its last fusing reader
        self.settled: set[Key] = set()  # values whose reads of operands are placed
        self.transient: list[tuple[int, int, int]] = []  # (start, end, bytes) of buffers no value names
        self.copied: dict[int, dict[int, tuple[int, ...]]] = {}  # dot position -> operand -> the order XLA copies it in
        self.gathered_in_order: set[Buf] = set()  # minor gathers copied once, into their products' order
        self.sliced_masks: set[Buf] = set()  # booleans a library reduction reads sliced (_unmasked)
        self.copy_groups: dict[Buf, list[set[int]]] = {}  # per buffer: the dots reading each transposed copy of it
        self.middles: set[Buf] = set()  # chain steps made and read in one instant (chains.py)
        self.pieces: dict[Buf, int] = {}  # buffers XLA holds as this many separate equal slices
        self.reads_from: dict[Buf, Buf] = {}  # a view -> the buffer it is made from (read_source)
        self.recopied: set[Key] = set()  # dot operands whose copies compute them again (recomputed_reads)
        self.held: set[Key] = set()  # what those copies read: no in-place write takes it over
        self.stepped: set[Buf] = set()  # views holding their step's buffers at their birth (chains.py)
        self.sent: dict[Buf, int] = {}  # all-to-alls whose slices are made a step before the pieces arrive
        self.sliced_whole: dict[Buf, tuple[int, int, int]] = {}  # reduce-scatters read sliced: the whole buffer
        self.prepared: set[Buf] = set()  # minor gathers copied for a reader running then (half_steps)
        self.early: list[tuple[int, int, int]] = []  # transients of the collectives made with them
        self.sent_fused: frozenset[Key] = frozenset()  # cheap values whose slices all-to-alls send (sent_fused)
        self.sends_whole: set[Buf] = set()  # sources whose slices are the value (sent_whole)
        self.assembled: dict[Buf, int] = {}  # views products read in their own order: the first (assembled_views)

    def run(self) -> None:
        tl = self.tl
        reads = self._reads()
        self.copied = self._copied(reads)
        self.assembled = assembled_views(self, reads)
        self.gathered_in_order = gathered_in_order(self, reads)
        self._stored(reads)
        self.duplicated = duplicated_values(self, reads)
        recomputed = recomputed_reads(self, reads)
        copied_views: list[tuple[Buf, int]] = []
        for t in range(len(tl.seq) - 1, -1, -1):
            outs = [k for k in tl.first[t] if k in self.produced]
            if not outs and not (tl.seq[t].effects and not tl.seq[t].outputs):
                continue
            self.settled.update(outs)  # a later read of a duplicated value reads its buffer
            if not outs or any(self.stored[k] for k in outs):
                lo, hi = t, max([t] + [self.recomputed_at.get(k, t) for k in outs])
            else:
                spans = [self.ev[k] for k in outs if k in self.ev]
                if not spans:
                    continue  # read by nothing
                lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
            inplace = fusion.in_place(tl.seq[t])
            for k in outs:
                self.born[(k, self.produced[k])] = tl.birth_time(t)
                if inplace:
                    self.inplace.add((k, self.produced[k]))
            copied = self.copied.get(t, ())
            for pos, (ka, lid, whole) in enumerate(reads[t]):
                view = lid is not None and lid != self.produced.get(ka)
                if view:
                    self.view_readers.setdefault((ka, lid), set()).add(t)
                cp = pos in copied and not self._written_transposed(ka, lid)
                c = self._copy_time(t, ka, lid) if cp else lo
                if cp and view and copied_view(self, (ka, lid), t):
                    copied_views.append(((ka, lid), t))  # its read is the copy's (copied_views_read)
                    continue
                self.read(ka, lid, min(c, lo), c if cp else hi, whole or (ka, lid) in self.sliced_masks)
                if not (cp or view) and hi > t:  # read again where the fused value is (copy insertion)
                    self.direct.setdefault(ka, set()).add(hi)
            for c, (ka, lid, whole) in recomputed.get(t, ()):
                self.read(ka, lid, min(c, lo), c, whole)
        read_last = dict(self.last)  # the equations' reads, not the loops' of their initial carries
        read_initial_carries(self)
        end = len(tl.seq)
        for o, lid in zip(tl.program.outputs, self.ex.root_layouts, strict=True):
            k = tl.key(o) if isinstance(o, int) else None
            if k is not None and lid is not None:  # an output in another layout is a view too
                self.read(tl.redirect.get(k, k), lid, end, end, True)
        n = len(self.transient)
        self._views()
        self.early = made_with_copies(self, self.transient[n:])
        copied_views_read(self, copied_views)
        held_through_loops(self, read_last)
        self._combine()
        transposed_copies(self, reads)
        literal_broadcast_buffers(self)
        self.transient += dense_expansions(self)
        self.transient += blocked_scan_copies(self)
        self.transient += stack_initial_values(self)
        self.transient += threefry_state(self) + widened_arguments(self)

    def _reads(self) -> list[list[tuple[Key, int | None, bool]]]:
        tl = self.tl
        out: list[list[tuple[Key, int | None, bool]]] = []
        for t, e in enumerate(tl.seq):
            row: list[tuple[Key, int | None, bool]] = []
            if any(k in self.produced for k in tl.first[t]) or (e.effects and not e.outputs):
                lids = iter(tl.operand_layouts(t, self.ch))
                for pos, a in enumerate(e.inputs):
                    if isinstance(a, Literal):
                        continue
                    lid = next(lids, None)
                    k = tl.redirect.get(tl.key(a), tl.key(a))  # type: ignore[arg-type]
                    if k is None or (e.name == "cond_merge" and pos > 0 and not passed_resharded(tl, t, pos, lid, self.produced)):
                        continue  # a branch's result is written into the conditional's buffer (branches.py)
                    whole = tl.whole_at[t][pos]
                    row.append((k, lid, whole))
                    if lid is None or lid == self.produced.get(k) or self._fused_slice(k, lid, whole):
                        self.direct.setdefault(k, set()).add(t)
            out.append(row)
        return out

    def _copied(self, reads: list[list[tuple[Key, int | None, bool]]]) -> dict[int, dict[int, tuple[int, ...]]]:
        """Per dot position: the operands XLA copies into another order, in this plan's layouts."""
        out: dict[int, dict[int, tuple[int, ...]]] = {}
        for t in self.tl.dots:
            if len(reads[t]) == 2:
                tr = self.tl.transposed(t, tuple(lid if lid is not None else self.produced.get(k)
                                                 for k, lid, _ in reads[t]))
                if tr:
                    out[t] = tr
        return out

    def _combine(self) -> None:
        """XLA:CPU combines all-reduces that do not depend on one another into one (a
        reduce-scatter is an all-reduce there), but only those over the same device groups
        (AllReduceCombiner keys on the replica groups) and within one computation (a loop's body, a
        branch: computation_at): per computation and group of mesh axes, the last wave of
        reductions (that no other reduction waits for) runs once all their sources exist, which
        stay live until then, and writes every result then. `combined`: per group, (sources,
        their ancestors) as bitsets of positions, of its first wave and of its last."""
        tl = self.tl
        groups: dict[tuple[object, ...], list[tuple[Buf, object, int, int]]] = {}
        for b, s in self.step_to.items():
            src = tl.made_at.get(b[0])
            if COLLECTIVES[s.kind].sums and b in self.born and src is not None:  # type: ignore[attr-defined]
                bits = 0
                for p in self.view_readers.get(b, ()):
                    bits |= 1 << p
                key = (computation_at(tl, src), tuple(sorted(s.axes)))  # type: ignore[attr-defined]
                groups.setdefault(key, []).append((b, s, src, bits))
        self.combined = tuple(w for reds in groups.values() for w in self._combine_group(reds))

    def _combine_group(self, reds: list[tuple[Buf, object, int, int]]) -> list[tuple[int, int]]:
        """One combined all-reduce: its last wave's sources live until all exist; returns the
        first wave's and the last wave's (sources, their ancestors): what one update waits for,
        all wait for (XLA's copy insertion orders a weight's late read before every update
        once the combined gradients' reduction waits for it)."""
        tl = self.tl
        sinks = _sinks(tl, reds)
        if len(sinks) > 1:
            # a source that is not a stored buffer (fused into its producer) exists once
            # that producer has run, not from the program's start; the all-reduce runs a step
            # after the last of them (a view is made a step after its source)
            when = 1 + max(self.born.get((b[0], s.src), tl.birth_time(t)) for b, s, t, _ in sinks)  # type: ignore[attr-defined]
            for b, s, _, _ in sinks:
                self.read(b[0], s.src, when, when, True)  # type: ignore[attr-defined]
                if COLLECTIVES[s.kind].whole_buffer_on(tl.spaces.mesh.platform):  # type: ignore[attr-defined]
                    # the combined all-reduce writes every whole result at once; each reader
                    # slices its shard out of it (the slice fuses), so the whole buffer lives
                    # until the reduced value's last read (that buffer, not its step's own as well)
                    size, end = tl.size(b[0], s.src), max(self.last.get(b, when), when)  # type: ignore[attr-defined]
                    if b in self.stepped and (self.born[b], self.born[b], size) in self.transient:
                        self.transient.remove((self.born[b], self.born[b], size))
                    if b in self.sliced_whole:
                        self.transient.remove(self.sliced_whole[b])
                    self.transient.append((when, end, size))
                elif b in self.born and self.born[b] < when:
                    # the combined all-reduce writes new buffers once every source exists: each
                    # result is born then, whatever read it earlier (its update runs after)
                    self.born[b] = when
                    self.last[b] = max(self.last.get(b, when), when)
        every = 0
        for _, _, src, _ in reds:
            every |= 1 << src
        first = [src for _, _, src, _ in reds if not tl.anc[src] & every]
        return [wave(tl, first), wave(tl, [src for _, _, src, _ in sinks])]

    def _fused_slice(self, k: Key, lid: int, whole: bool) -> bool:
        """A slice its reader fuses (it reads the source buffer itself)."""
        s = self.step_to.get((k, lid))
        return s is not None and COLLECTIVES[s.kind].fuses and not whole  # type: ignore[attr-defined]

    def _stored(self, reads: list[list[tuple[Key, int | None, bool]]]) -> None:
        """The static choice, plus: a value a collective reads is a buffer; so is a slice a
        contraction reads, and a value of a library fusion read in another layout (YNNPACK
        takes no slice)."""
        self.stored = dict(self.tl.stored) | library.broken(self.tl, self.produced)
        for k, between in self.tl.shared_inside.items():
            self.stored[k] = self.stored[k] or any(self.stored.get(u, False) for u in between)
        self.view_whole: set[Buf] = set()
        for row in reads:
            for k, lid, whole in row:
                if whole and lid is not None:
                    self.view_whole.add((k, lid))
        self.sent_fused = sent_fused(self, reads)
        for k in self.sent_fused:
            self.stored[k] = False
        for (k, _), s in self.step_to.items():
            if s.src == self.produced.get(k) and (not COLLECTIVES[s.kind].fuses or (k, s.dst) in self.view_whole
                                                  or k in self.tl.inside) and k not in self.sent_fused:
                self.stored[k] = True
        self._unmasked(reads)

    def _unmasked(self, reads: list[list[tuple[Key, int | None, bool]]]) -> None:
        """A masking multiply that reads its boolean through a slice (another layout) stays a
        multiply: XLA's simplifier turns `convert(b) * x` into a select only where it sees the
        convert. The library reduction then takes the multiply in and reads its operands, so the
        converted boolean is a buffer from when it is made, and the product is none."""
        tl = self.tl
        for v, m in tl.masked.items():
            km, kb = tl.key(v), tl.key(m)
            t = tl.made_at.get(km) if km is not None else None
            if t is None or kb is None or km not in self.produced:
                continue
            views = {(k, lid) for k, lid, _ in reads[t] if k == kb and lid is not None and lid != self.produced.get(kb)}
            if views:
                self.stored[km] = False
                self.sliced_masks |= views

    def read(self, k: Key, lid: int | None, lo: int, hi: int, whole: bool) -> None:
        p = self.produced.get(k)
        if p is None:
            return
        if lid is None or lid == p:
            if not whole and k in self.duplicated and k not in self.settled:
                self.recomputed_at[k] = max(self.recomputed_at.get(k, hi), hi)
                return
            if self.stored.get(k, True):
                b = (k, p)
                self.last[b] = max(self.last.get(b, hi), hi)
            else:
                first, last = self.ev.get(k, (lo, hi))
                self.ev[k] = (min(first, lo), max(last, hi))
            return
        s = self.step_to.get((k, lid))
        if s is None:
            return
        if COLLECTIVES[s.kind].fuses and not whole:  # the slice fuses into its reader
            self.read(k, s.src, lo, hi, whole)
            return
        b = (k, lid)
        self.born[b] = min(self.born.get(b, lo), lo)
        self.last[b] = max(self.last.get(b, hi), hi)

    def _copy_time(self, t: int, k: Key, lid: int | None) -> int:
        """When the transposed copy of a dot operand is made: right after the operand is (the
        dot at `t` reads the copy, not the operand); for a view, at the dot."""
        src = self.tl.made_at.get(k)
        if src is None or (lid is not None and lid != self.produced.get(k)):
            return t
        return min(t, self.tl.birth_time(src) + 1)

    def _written_transposed(self, k: Key, lid: int | None) -> bool:
        """Is a dot operand that XLA transposes written in the dot's order by its producer (the
        dot its only reader, not a view)? Then no copy is made: the operand itself lives until
        the dot."""
        b = (k, lid if lid is not None else self.produced.get(k, -1))
        if b in self.gathered_in_order:
            return True
        return b not in self.step_to and self.tl.n_readers.get(k, 0) <= 1 and k in self.tl.made_at

    def _views(self) -> None:
        """Each view (a collective's result) is made from its source when first needed: deepest
        first, so a source's last read includes making every view below it. XLA's breadth-first
        schedule runs a collective as soon as its source exists: a weight's all-gather at the
        start. A reduce-scatter on XLA:CPU is an all-reduce of the whole buffer and a slice: the
        whole buffer lives for an instant, or until the last reader where each slices its shard
        out of it (sliced_by_readers); an all-gather of a minor dimension gathers the major one
        and transposes: the raw gathered buffer lives until the copy. A chain's middle hop is
        born when its next hop reads it, so it joins the list then; chains.py prices the chains
        made in one instant."""
        def depth(b: Buf) -> int:
            d, s = 0, self.step_to.get(b)
            while s is not None and d < 64:
                d += 1
                s = self.step_to.get((b[0], s.src))  # type: ignore[attr-defined]
            return d

        views = sorted((b for b in self.born if b in self.step_to), key=depth)
        sent_early(self)
        for b in views:  # shallowest first: a source's (earlier) birth is known
            self.born[b] = min(self.born[b], self._source_birth(b) + 1)
        copies: dict[int, int] = {}  # instant -> the largest raw gathered buffer copied then
        sends: list[tuple[Buf, int]] = []
        made: dict[Buf, list[int]] = {}  # per view: the buffers its step holds beside source and result
        todo = [(-depth(b), i, b) for i, b in enumerate(views)]
        heapq.heapify(todo)
        queued = set(views)
        hops = {(b[0], self.step_to[b].src) for b in views}  # type: ignore[attr-defined]
        while todo:  # deepest first; a middle hop is born when the next one reads it
            b = heapq.heappop(todo)[2]
            s = self.step_to[b]
            t = self.born[b]
            src = read_source(self, b, t)
            if src in self.step_to and src in self.born and src not in queued:
                heapq.heappush(todo, (-depth(src), len(views), src))
                views.append(src)
                queued.add(src)
            platform = self.tl.spaces.mesh.platform
            if COLLECTIVES[s.kind].whole_buffer_on(platform):  # type: ignore[attr-defined]
                if not sliced_by_readers(self, b, t, hops):
                    made[b] = [self.tl.size(b[0], s.src)]  # type: ignore[attr-defined]
            elif COLLECTIVES[s.kind].sliced_send_on(platform):  # type: ignore[attr-defined]
                sends.append((b, t))
            elif COLLECTIVES[s.kind].transposes_minor and minor(self.tl, b[0], s.dst, s.dim):  # type: ignore[attr-defined]
                # the raw gathered buffer now, the transposed copy (the view) a step later, or at t
                # if read then (half_steps). XLA gathers every weight's raw buffer before copying any
                # (breadth-first): at t side by side; a chain's middle hop (no op reads it) is a chain's step
                self.born[b] = max(t, min(t + 1, self.last.get(b, t), *self.view_readers.get(b, ())))
                if b in self.view_readers or self.born[b] > t:
                    self.transient.append((t, t, self.tl.size(*b)))
                    if self.born[b] == t and self._source_birth(b) >= 0:
                        self.prepared.add(b)
                else:
                    made[b] = [self.tl.size(*b)]
                if self.born[b] > t:
                    copies[self.born[b]] = max(copies.get(self.born[b], 0), self.tl.size(*b))
        # XLA copies the raw buffers one by one, freeing each: the copies and one raw buffer
        self.transient += [(t, t, size) for t, size in copies.items()]
        made.update(sliced_sends(self, sends))
        self.transient += chain_transients(self, views, made)

    def _source_birth(self, b: Buf) -> int:
        """When the source of view `b` exists: a buffer's birth, an argument's -1 (before the
        start). A step no reader reads (the middle of a chain, say the reduce-scatter before an
        all-gather) runs with the rest of its chain, right after the chain's nearest buffer, not
        at the start of the program."""
        src = (b[0], self.step_to[b].src)  # type: ignore[attr-defined]
        for _ in range(64):
            if src in self.born or src not in self.step_to:
                break
            src = (src[0], self.step_to[src].src)  # type: ignore[attr-defined]
        made = self.tl.made_at.get(src[0])  # a value fused into the view's own fusion
        return self.born.get(src, -1 if made is None or src in self.step_to else self.tl.birth_time(made))

    def is_buffer(self, b: Buf) -> bool:
        """A view (a collective's result) always is; an equation's result when XLA stores it."""
        return b in self.step_to or self.stored.get(b[0], True)

    def peak(self, excluded: set[Buf], fixed: list[Allocation], extra: list[Temp]) -> Peak:
        """The peak of temporaries: every stored buffer but `excluded` (arguments, constants,
        outputs) and the `extra` ones (copies), after in-place sharing and reuse of the `fixed`
        (output, donated) allocations."""
        flat = self.tl.flattened
        temps = [Temp(self.tl.size(*b), t, max(self.last.get(b, t), t), b in self.inplace, b,
                      (b[0] in flat or b[0] in self.held or retyped_at(self.tl, b[0], self.last.get(b, t)))
                      and b not in self.step_to)
                 for b, t in self.born.items()
                 if b not in excluded and b not in self.middles and self.is_buffer(b) and b not in self.pieces
                 and b not in self.sliced_whole]
        for b, n in self.pieces.items():  # tagged once: the peak's list names the buffer
            if b in self.born and b not in excluded and b not in self.middles:
                t, size = self.born[b], self.tl.size(*b)
                end, f = max(self.last.get(b, t), t), self.assembled.get(b, -1)
                if t <= f <= end:  # concatenated for the first product reading them: one buffer on
                    temps.append(Temp(size, f, end, tag=b))
                    end = f
                temps += [Temp(size // n, t, end, tag=b if i == 0 and end != f else None, kept=True)
                          for i in range(n)]
        temps += extra
        temps += [Temp(size, t0, t1) for t0, t1, size in self.transient]
        temps = half_steps(self, temps, fixed)
        share_inplace(temps)
        left = reuse_fixed(temps, fixed)
        best, best_t = heap_peak(left)
        best = max(best, packed_heap(left))
        at = [(t.tag, t.size) for t in left if t.tag is not None and t.start <= best_t <= t.end]
        return Peak(best, (best_t + 1) // 2, sorted(at, key=lambda x: -x[1]))  # type: ignore[misc]


def _sinks(tl: Timeline, reds: list[tuple[Buf, object, int, int]]) -> list[tuple[Buf, object, int, int]]:
    """The reductions (buffer, step, source, readers' bits) none of whose readers is another
    one's source or an ancestor of it."""
    return [r for r, others in zip(reds, _others(tl.anc[r[2]] | (1 << r[2]) for r in reds), strict=True)
            if not others & r[3]]


def _others(masks: Iterable[int]) -> list[int]:
    """Per mask, the union of all the others (prefix and suffix unions: linear, where testing
    each pair was quadratic, 1.3 M tests on a 96-layer step's combined gradients)."""
    ms = list(masks)
    before, after = [0] * len(ms), [0] * len(ms)
    for i in range(1, len(ms)):
        before[i] = before[i - 1] | ms[i - 1]
    for i in range(len(ms) - 2, -1, -1):
        after[i] = after[i + 1] | ms[i + 1]
    return [b | a for b, a in zip(before, after, strict=True)]


def minor(tl: Timeline, k: Key, lid: int, dim: int) -> bool:
    """Does a dimension before `dim` have more than one element per shard?"""
    v = tl.program.values[tl.rep[k]]
    shard = tl.spaces.layouts[lid].shard_shape(v.shape, tl.spaces.mesh)
    return any(n > 1 for n in shard[:dim])


def transposed_copies(live: PlanLiveness, reads: list[list[tuple[Key, int | None, bool]]]) -> None:
    """A dot operand XLA transposes is copied as soon as it exists (breadth-first) and read
    by the dot; one whose only reader is the dot is written transposed (no copy). Copies of
    one buffer in one order are one buffer, read by the last of their dots (CSE)."""
    tl = live.tl
    spans: dict[tuple[Buf, tuple[int, ...]], tuple[int, int, int]] = {}
    groups: dict[tuple[Buf, tuple[int, ...]], set[int]] = {}
    for t, ops in live.copied.items():
        if not any(k in live.produced for k in tl.first[t]):
            continue
        for pos, order in ops.items():
            k, lid, _ = reads[t][pos]
            b = (k, lid if lid is not None else live.produced.get(k, -1))
            if b[1] < 0 or live._written_transposed(k, lid):
                continue
            start = min(live.born.get(b, -1) + (k not in live.recopied), t)
            lo, hi, _ = spans.get((b, order), (start, t, 0))
            spans[(b, order)] = (min(lo, start), max(hi, t), tl.size(*b))
            groups.setdefault((b, order), set()).add(t)
    live.transient += spans.values()
    for (b, _), g in groups.items():
        live.copy_groups.setdefault(b, []).append(g)


def made_with_copies(live: PlanLiveness, made: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The collectives' transients (`made`: raw gathered buffers, slices sent, chain steps) of the
    instants where a minor all-gather is copied for a reader that runs then: XLA runs every
    collective of that instant before the reader (half_steps)."""
    when = {live.born[b] for b in live.prepared}
    return [x for x in made if x[0] in when]


def half_steps(live: PlanLiveness, temps: list[Temp], fixed: list[Allocation]) -> list[Temp]:
    """Each instant t in two halves, 2t - 1 and 2t. Where a minor all-gather of a value is read at
    the instant it is made (`live.prepared`), it is gathered raw and copied into its reader's
    order in the first half, with the instant's other collectives and views, and the raw buffer
    is freed before the reader runs: XLA:CPU runs all-gather, copy, product, so the raw buffer
    never meets the product's result (the GNN step on 2x2x2). Every other buffer is made in the
    second half. An argument's gathers are not moved: XLA gathers and copies every weight at the
    start, before the first product (Megatron's MLP on 8)."""
    early = Counter(live.early)
    when = {live.born[b] for b in live.prepared}
    out: list[Temp] = []
    for t in temps:
        key = (t.start, t.end, t.size)
        pre = 1 if t.tag is None and not t.kept and early[key] > 0 else 0
        early[key] -= pre
        view = t.tag in live.step_to or (t.tag is None and t.kept)  # untagged and kept: a view's later pieces
        made = 1 if view and t.start in when else 0
        out.append(Temp(t.size, 2 * t.start - (pre or made), 2 * t.end - (pre and t.end == t.start),
                        t.inplace, t.tag, t.kept))
    for a in fixed:
        a.busy = [(2 * s, 2 * e, ip) for s, e, ip in a.busy]
    return out


def wave(tl: Timeline, srcs: list[int]) -> tuple[int, int]:
    """(sources, their ancestors) of reductions XLA combines into one, as bitsets."""
    bits = anc = 0
    for src in srcs:
        bits |= 1 << src
        anc |= tl.anc[src] | (1 << src)
    return bits, anc


def duplicated_values(live: PlanLiveness, reads: list[list[tuple[Key, int | None, bool]]]) -> frozenset[Key]:
    """Timeline.duplicated, where every operand can be read again: the readers that fuse the
    value compute it again from its operands, which live until the last of them. (An expensive
    fused operand, a gather say, would be stored or computed again too: not modelled, so such
    a value is read stored by all its readers.)"""
    out = set()
    for k in live.tl.duplicated:
        t = live.tl.made_at.get(k)
        if t is not None and live.stored.get(k, True) and all(recomputable(live, ka, lid) for ka, lid, _ in reads[t]):
            out.add(k)
    return frozenset(out)


def recomputable(live: PlanLiveness, k: Key, lid: int | None) -> bool:
    """Can a reader read operand `k` (in layout `lid`) again: a buffer, a view, or a cheap fused
    value (a broadcast) that XLA duplicates with it."""
    if live.stored.get(k, True) or lid not in (None, live.produced.get(k)):
        return True
    t = live.tl.made_at.get(k)
    return t is not None and fusion.kind(live.tl.seq[t]) == fusion.Fuse.CHEAP


def literal_broadcast_buffers(live: PlanLiveness) -> None:
    """A broadcast literal the library reductions read (Timeline._literal_broadcasts): one
    buffer per literal and shape (XLA's CSE), written at the start, read by the last of them."""
    spans: dict[object, tuple[int, int]] = {}
    for t, k, lk in live.tl.literal_broadcasts:
        if k in live.produced:
            size = live.tl.size(k, live.produced[k])
            spans[lk] = (max(t, spans.get(lk, (t, 0))[0]), max(size, spans.get(lk, (0, size))[1]))
    live.transient += [(0, t, size) for t, size in spans.values()]


def retyped_at(tl: Timeline, k: Key, t: int) -> bool:
    """Does the op at `t` (the last to read `k`) write another element type? XLA shares an
    operand's buffer with its user only where both have one shape, element type included
    (`CanShareOperandBufferWithUser`): an int8 product's s32 result is not overwritten by its
    f32 epilogue, though both are 4 bytes."""
    if t >= len(tl.seq) or not tl.seq[t].outputs:
        return False
    out = tl.program.values[tl.seq[t].outputs[0]].dtype
    return str(out) != str(tl.program.values[tl.rep[k]].dtype)


def copied_view(live: PlanLiveness, b: Buf, t: int) -> bool:
    """A dot at `t` reads view `b`, an all-gather's result, through a transposed copy: XLA
    copies the gathered buffer once, into the order its products read, and frees it (GPT's
    attention weights under FSDP, gathered along their first dimension: `all-gather`, then a
    `copy_bitcast_fusion` both products read, in an XLA:CPU dump), so `b` is a step between
    the two, whichever dimension it is gathered along. (Held until their products, views
    gathered along a major dimension counted the weights twice: GPT FSDP on 2x4 1.108 of the
    compiled figure, 1.043 now.)"""
    s = live.step_to.get(b)
    if s is None or not COLLECTIVES[s.kind].copied_once:
        return False
    live.born[b] = min(live.born.get(b, t), t)
    return True


def copied_views_read(live: PlanLiveness, copied: list[tuple[Buf, int]]) -> None:
    """The views of copied_view are copied into their products' order as soon as they exist
    (breadth first, as transposed_copies dates the copy), and the products read the copy: a view's
    read is the copy's, a step after its birth, not the products' (a gathered weight read by
    its forward and backward products is one copy between them)."""
    for b, t in copied:
        if b in live.born:
            live.last[b] = max(live.last.get(b, live.born[b]), min(live.born[b] + 1, t))


def sliced_by_readers(live: PlanLiveness, b: Buf, t: int, hops: set[Buf]) -> bool:
    """A reduce-scatter on XLA:CPU (an all-reduce and a slice) whose every reader is elementwise
    (none reads it whole, no collective takes it further): XLA fuses the slice into each reader,
    which reads its shard out of the whole all-reduced buffer, so that buffer lives until the
    last of them (a relu's pre-activation read again by its gradient's mask) and the shard is
    no buffer of its own (`sliced_whole`). Otherwise the slice is a buffer and the whole one
    lives for an instant."""
    if b not in live.view_readers or b in live.view_whole or b in hops:
        return False
    span = live.sliced_whole[b] = (t, max(live.last.get(b, t), t), live.tl.size(b[0], live.step_to[b].src))  # type: ignore[attr-defined]
    live.transient.append(span)
    return True


def recomputed_reads(live: PlanLiveness, reads: list[list[tuple[Key, int | None, bool]]]
                     ) -> dict[int, list[tuple[int, tuple[Key, int | None, bool]]]]:
    """Per dot position: what its transposed copy of an elementwise operand reads, and when. XLA
    fuses the operand's computation into the copy, which reads the operand's own operands
    again, where the copy is the operand's only reader (every reader a dot reading it in that
    order, CSE) or every other reader fuses it too (others_fuse); an expensive op inside is then
    stored, not computed twice (a gelu's tanh). Otherwise (an input gradient's library fusion
    reads the operand) the copy reads the operand's buffer. Breadth first, the copy runs beside
    the operand's own kernel, reading what it reads."""
    tl, out = live.tl, {}
    copies: dict[tuple[Key, tuple[int, ...]], int] = {}
    for t, ops in live.copied.items():
        for pos, order in ops.items():
            if pos < len(reads[t]):
                copies[(reads[t][pos][0], order)] = copies.get((reads[t][pos][0], order), 0) + 1
    for t, ops in live.copied.items():
        for pos, order in ops.items():
            if pos >= len(reads[t]):
                continue
            k, lid, _ = reads[t][pos]
            src = tl.made_at.get(k)
            if src is None or fusion.kind(tl.seq[src]) not in (fusion.Fuse.CHEAP, fusion.Fuse.EXPENSIVE):
                continue
            s = live.step_to.get((k, lid)) if lid is not None else None
            if s is not None and not COLLECTIVES[s.kind].fuses:  # type: ignore[attr-defined]
                continue  # the copy reads the collective's result, not what the operand reads
            if copies[(k, order)] < tl.n_readers.get(k, 0):  # duplicated: if every other reader fuses it
                if fusion.kind(tl.seq[src]) == fusion.Fuse.EXPENSIVE or not others_fuse(live, k, order):
                    continue
                for k2 in fused_sources(live, src, expensive=True):  # computed once, for both
                    live.stored[k2] = True
            c = live._copy_time(t, k, lid)
            if tl.breadth_first and c == tl.birth_time(src) + 1:
                c -= 1  # with the operand's kernel, after it: nothing it reads is written in place
                live.recopied.add(k)
                live.held |= set(fused_sources(live, src))
            out.setdefault(t, []).extend((c, r) for r in reads[src])
    return out


def others_fuse(live: PlanLiveness, k: Key, order: tuple[int, ...]) -> bool:
    """Can every reader of `k` but the dots copying it in `order` fuse its computation (XLA
    duplicates a fused computation only into readers that all fuse it)? An elementwise op can;
    so can a dot XLA flattens into a matrix product, which reads it through a reshape (several
    free or contracting dimensions), unless the dot is inside a library fusion (YNNPACK takes
    the reshape in, and the computation is one buffer both read)."""
    tl = live.tl
    for t, pos in tl.read_at.get(k, ()):
        e = tl.seq[t]
        if live.copied.get(t, {}).get(pos) is not None:
            continue  # a dot reading its own copy, in this or another order
        if any(k2 in tl.in_library and not (k2 in tl.inside and live.stored.get(k2)) for k2 in tl.first[t]):
            return False  # inside a library fusion the plan keeps (a collective reading a member splits it)
        if e.name == "dot_general":
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
            contract, batch = (lc, lb) if pos == 0 else (rc, rb)
            rank = len(tl.program.values[e.inputs[pos]].shape)  # type: ignore[index]
            if rank - len(contract) - len(batch) <= 1 and len(contract) <= 1:
                return False
        elif fusion.kind(e) not in (fusion.Fuse.CHEAP, fusion.Fuse.EXPENSIVE) or tl.whole_at[t][pos]:
            return False
    return True


def read_positions(tl: Timeline) -> dict[Key, list[tuple[int, int]]]:
    """Per key: the (position, operand) pairs reading it."""
    out: dict[Key, list[tuple[int, int]]] = {}
    for t, e in enumerate(tl.seq):
        for pos, a in enumerate(e.inputs):
            if isinstance(a, int) and (k := tl.key(a)) is not None:
                out.setdefault(k, []).append((t, pos))
    return out


def fused_sources(live: PlanLiveness, t: int, expensive: bool = False) -> list[Key]:
    """The buffers the fused computation of the op at `t` reads (it and the values it reads that
    are no buffers, transitively); with `expensive`, the expensive values it computes instead:
    XLA stores them rather than compute them in two kernels."""
    tl, stack, seen, out = live.tl, [t], {t}, []
    while stack:
        p = stack.pop()
        e = tl.seq[p]
        if expensive and p != t and fusion.kind(e) == fusion.Fuse.EXPENSIVE:
            out += tl.first[p]
            continue
        for a in e.inputs:
            k = tl.key(a) if isinstance(a, int) else None
            q = tl.made_at.get(k) if k is not None else None
            if q is None or q in seen:
                continue
            if not live.stored.get(k, True):  # type: ignore[arg-type]
                seen.add(q)
                stack.append(q)
            elif not expensive:
                out.append(k)  # type: ignore[arg-type]
    return out


def read_source(live: PlanLiveness, b: Buf, t: int) -> Buf:
    """View `b` reads its source at t; returns the buffer it reads. A local slice read by
    another slice or by an all-to-all is no buffer: XLA composes slices of slices, and
    fuses a slice into the all-to-all's own slicing, which read the slice's source."""
    s = live.step_to[b]
    src = (b[0], s.src)  # type: ignore[attr-defined]
    up = live.step_to.get(src)
    kind = COLLECTIVES[s.kind]  # type: ignore[attr-defined]
    through = up is not None and COLLECTIVES[up.kind].fuses and (  # type: ignore[attr-defined]
        kind.fuses or kind.sliced_send_on(live.tl.spaces.mesh.platform))
    live.read(src[0], src[1], t, t, not through)
    while through and src in live.step_to and COLLECTIVES[live.step_to[src].kind].fuses:  # type: ignore[attr-defined]
        src = (src[0], live.step_to[src].src)  # type: ignore[attr-defined]
    live.reads_from[b] = src
    return src


def gathered_in_order(live: PlanLiveness, reads: list[list[tuple[Key, int | None, bool]]]) -> set[Buf]:
    """Minor-dimension all-gathers read only by products that copy them, all into one order:
    XLA copies the raw gathered buffer straight into that order (one copy, the view itself),
    where a view any other op reads is copied into the value's order and then again."""
    orders: dict[Buf, set[tuple[int, ...]]] = {}
    other: set[Buf] = set()
    for t, row in enumerate(reads):
        for pos, (k, lid, _) in enumerate(row):
            if lid is None or lid == live.produced.get(k):
                continue
            order = live.copied.get(t, {}).get(pos)
            if order is None:
                other.add((k, lid))
            else:
                orders.setdefault((k, lid), set()).add(order)
    out: set[Buf] = set()
    for b, seen in orders.items():
        s = live.step_to.get(b)
        if (b not in other and len(seen) == 1 and s is not None
                and COLLECTIVES[s.kind].transposes_minor and minor(live.tl, b[0], s.dst, s.dim)):  # type: ignore[attr-defined]
            out.add(b)
    return out


def dense_expansions(live: PlanLiveness) -> list[tuple[int, int, int]]:
    """A ragged dot's operands expanded per group (fusion.dense_ragged_operands): each a
    buffer of its dot alone, written as soon as its operand is (XLA:CPU's breadth-first
    schedule: an argument's expansion for the weight gradient is written at the start).
    The (groups, *shard) boolean mask that selects each group's rows is fused into its one
    expansion, or, read by several, one buffer per group sizes and shard shape (XLA's CSE
    shares it between the forward pass and the gradients) until its last reader."""
    tl, out = live.tl, []
    masks: dict[tuple[Key | None, tuple[int, ...]], tuple[int, int, int, int]] = {}
    for t, ops in tl.dense.items():
        e = tl.seq[t]
        if not any(k in live.produced for k in tl.first[t]):
            continue
        lids = tl.operand_layouts(t, live.ch)
        gs = e.inputs[2]
        groups = tl.program.values[gs].shape[-1] if isinstance(gs, int) else 1
        for pos in ops:
            a = e.inputs[pos]
            k = tl.key(a) if isinstance(a, int) else None
            lid = lids[pos] if pos < len(lids) else None
            lid = live.produced.get(k) if lid is None and k is not None else lid
            if k is None or lid is None:
                continue
            born = live.born.get((k, lid), live.born.get((k, live.produced.get(k, -1)), 0))
            out.append((min(born, t), t, groups * tl.size(k, lid)))
            v = tl.program.values[a]
            shard = tuple(tl.spaces.layouts[lid].shard_shape(v.shape, tl.spaces.mesh))
            key = (tl.key(gs) if isinstance(gs, int) else None, shard)
            lo, hi, _, n = masks.get(key, (t, t, 0, 0))
            masks[key] = (min(lo, born, t), max(hi, t), groups * math.prod(shard), n + 1)
    return out + [(lo, hi, size) for lo, hi, size, n in masks.values() if n > 1]


def read_initial_carries(live: PlanLiveness) -> None:
    """A loop reads its initial carry when it starts, in the carry's layout."""
    tl, prog = live.tl, live.tl.program
    for reg in prog.scans:
        if reg.folded or reg.kind not in ("scan", "while") or reg.index not in tl.start:
            continue
        t = tl.start[reg.index]
        for cin, a in zip(reg.carry_in, reg.init, strict=True):
            if isinstance(a, int) and tl.key(a) is not None:
                live.read(tl.key(a), live.ex.carry_layouts.get(cin), t, t, True)  # type: ignore[arg-type]


def held_through_loops(live: PlanLiveness, read_last: dict[Buf, int]) -> None:
    """Each buffer's equation reads (`read_last`, before the loops' reads of their initial
    carries) inside a loop it was made before hold it to the loop's end (Timeline.held_through),
    once the views' birth times are known."""
    for b, last in read_last.items():
        end = live.tl.held_through(last, live.born[b]) if b in live.born else last
        if end > last:  # only then: later rules may have moved a read earlier (copied_views_read)
            live.last[b] = max(live.last[b], end)


def computation_at(tl: Timeline, t: int) -> int | None:
    """The region XLA compiles as a computation of its own that runs position `t`: a real loop's
    body or condition, or a branch; None for the entry computation (a folded loop is replayed
    there). XLA's passes, the all-reduce combiner among them, work within one computation."""
    r = tl.seq[t].region
    while r is not None:
        reg = tl.program.scans[r]
        if tl.program.run_loop(r) is not None or reg.kind == "branch":
            return r
        r = reg.parent
    return None


def widened_keys(tl: Timeline) -> tuple[set[Key], dict[int, list[int]]]:
    """Half-precision values XLA:CPU keeps in float32 (fusion.widened_values): a product's
    computed operands and results; and per position, the operands that are arguments, which
    keep their own buffers beside a float32 copy (widened_arguments). A library fusion of
    several ops converts inside itself: what it computes and reads keeps its dtype."""
    prog, out, at = tl.program, set(), {}
    args = set(prog.args) | set(prog.const_values)
    several = {k for f in tl.fusions if f.inside for k in f.inside | f.roots}
    for t, e in enumerate(tl.seq):
        if any(k in several for k in tl.first[t]):
            continue
        atoms = [*e.inputs, *e.outputs]
        dtypes = [dtype_name(prog.values[a].dtype) if isinstance(a, int) else "" for a in atoms]
        for i in fusion.widened_values(e, dtypes, tl.spaces.mesh.platform):
            a = atoms[i]
            k = tl.key(a) if isinstance(a, int) else None
            if k is not None and a in args:
                at.setdefault(t, []).append(i)
            elif k is not None and k not in several:
                out.add(k)
    return out, at


def widened_arguments(live: PlanLiveness) -> list[tuple[int, int, int]]:
    """(start, end, bytes) of the float32 copies of half-precision arguments products read on
    CPU: one per argument and layout, made when the read layout exists (XLA's breadth-first
    schedule converts an argument at the start), held until the last such product."""
    tl, spans = live.tl, {}
    for t, ops in tl.widened_args.items():
        if not any(k in live.produced for k in tl.first[t]):
            continue
        lids = tl.operand_layouts(t, live.ch)
        for pos in ops:
            k = tl.key(tl.seq[t].inputs[pos])  # type: ignore[arg-type]
            lid = lids[pos] if pos < len(lids) and lids[pos] is not None else live.produced.get(k)  # type: ignore[arg-type]
            if k is None or lid is None:
                continue
            lo, hi = spans.get((k, lid), (live.born.get((k, lid), 0), t))
            spans[(k, lid)] = (min(lo, t), max(hi, t))
    return [(lo, hi, 2 * tl.size(k, lid)) for (k, lid), (lo, hi) in spans.items()]


def loop_spans(seq: list[Equation], prog: Program) -> dict[int, tuple[int, int]]:
    """Each real loop's (first, last) instant, its predicate's region included: XLA runs a
    while loop (a scan is one) as one instruction over its body and condition."""
    spans: dict[int, tuple[int, int]] = {}
    for t, e in enumerate(seq):
        r = e.region
        while r is not None:
            lp = prog.run_loop(r)
            if lp is not None:
                lo, hi = spans.get(lp, (t, t))
                spans[lp] = (min(lo, t), max(hi, t))
            r = prog.scans[r].parent
    return spans


def stack_initial_values(live: PlanLiveness) -> list[tuple[int, int, int]]:
    """A top-level loop's stacked outputs are loop carries initialised by a broadcast of zeros
    that reads nothing: the breadth-first schedule runs it first, and XLA's CSE makes one per
    shape, copied into each carry as its loop starts. One buffer per shape and layout, from
    the start of the program to the first such loop."""
    tl, first = live.tl, {}
    outs = {tl.key(o) for o in tl.program.outputs if isinstance(o, int)}  # broadcast into the output
    for t, e in enumerate(tl.seq):
        if e.name != "scan_stack" or tl.program.scans[e.params["scan"]].parent is not None:
            continue
        for k in tl.first[t]:
            b = (k, live.produced.get(k))
            if b in live.born and k not in outs:
                v = tl.program.values[tl.rep[k]]
                first.setdefault((tuple(v.shape), dtype_name(v.dtype), b[1]), (live.born[b], b))
    return [(0, t, tl.size(*b)) for t, b in first.values() if t > 0]  # type: ignore[arg-type]


def threefry_state(live: PlanLiveness) -> list[tuple[int, int, int]]:
    """(start, end, bytes) of random bits' counter words (fusion.threefry_words) beyond the
    result's own buffer: held until its last reader, and the loop's new words at the draw."""
    tl, out = live.tl, []
    for t in tl.draws:
        for k in tl.first[t]:
            b = (k, live.produced.get(k))
            if b not in live.born:
                continue
            e = tl.seq[t]
            key_dtype = tl.program.values[e.inputs[0]].dtype if isinstance(e.inputs[0], int) else None
            held, instant = fusion.threefry_words(e, key_dtype, tl.spaces.mesh.platform)
            v = tl.program.values[tl.rep[k]]
            words = 4 * math.prod(tl.spaces.layouts[b[1]].shard_shape(v.shape, tl.spaces.mesh))  # type: ignore[index]
            born = live.born[b]  # type: ignore[index]
            out += [(born, max(live.last.get(b, born), born), max(0, held * words - tl.size(*b))),  # type: ignore[arg-type]
                    (born, born, instant * words)]
    return out


def blocked_scan_copies(live: PlanLiveness) -> list[tuple[int, int, int]]:
    """(start, end, bytes) of the block-order copies of cumulative ops XLA splits into blocks
    (fusion.blocked_scan): held while the op runs, unless its operand is computed into the copy
    (fused) or dies there, where XLA writes the copy in the operand's place (a reverse cumsum in
    a gradient: counted, the estimate was 1.30 of the compiled figure)."""
    tl, out = live.tl, []
    for t in tl.cumulative:
        ks = [k for k in tl.first[t] if k in live.produced]
        a = tl.seq[t].inputs[0]
        k = tl.key(a) if isinstance(a, int) else None
        if not ks or k is None or k not in live.produced or not live.stored.get(k, True):
            continue
        lids = tl.operand_layouts(t, live.ch)
        src = (k, lids[0] if lids and lids[0] is not None else live.produced[k])
        if src in live.born and live.last.get(src, t) <= t:
            continue
        lid = live.produced[ks[0]]
        v = tl.program.values[tl.rep[ks[0]]]
        if fusion.blocked_scan(tl.seq[t], tuple(tl.spaces.layouts[lid].shard_shape(v.shape, tl.spaces.mesh))):
            out.append((t, t, tl.size(ks[0], lid)))
    return out


__all__ = ["Peak", "PlanLiveness", "Timeline", "execution_order"]
