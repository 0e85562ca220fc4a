"""Which values XLA:CPU's library fusions keep inside one YNNPACK kernel, never as buffers.

XLA:CPU's LibraryRewriter (jaxlib 0.10's default `--xla_cpu_experimental_ynn_fusion_type`:
individual dots, individual convolutions, reductions) visits dots, convolutions and reductions
consumers first. A dot or a convolution YNNPACK runs becomes a fusion of its own; a large add /
max / min reduction starts one that grows breadth first: up through an operand YNNPACK supports
whose users are all inside already, down to the root's only user where YNNPACK supports it, and
through any fusion it meets, which it takes in. Every value inside but the root never exists as
a buffer: `mean(conv(relu(conv(x))))` and attention's `softmax(q k^T) v` compile to no
temporaries at all. A collective, a transpose, a slice, a select or a program output stops the
growth. Read off this jaxlib's `TF_CPP_VMODULE=library_rewriter=4` trace; GPU and TPU have no
such pass, so `fused_keys` is for CPU meshes only.

The simulation runs on the traced program, not on XLA's optimised module, so it leaves alone
what it cannot see the same way: a fusion that keeps no stored value inside but a reduction's
own result changes nothing (_drops_a_buffer), and a negation XLA moves below its reduction
joins only with its operand (_hoisted_fits). The fusions are the program's; a plan can break
one (`broken`: a dimension split down to one element; PlanLiveness also stores a value inside
one that the plan reads in another layout, as YNNPACK takes no slice or collective).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..egraph.program import Equation, Program, dtype_name
from . import fusion
from .fusion import YNN_REDUCERS, YNN_VIEWS

if TYPE_CHECKING:
    from .liveness import Key, Timeline

MIN_ELEMENTS = 4096  # a reduction or elementwise op YNNPACK takes (per device; ynn_support.cc)
FLOATS = frozenset({"float32", "bfloat16"})
ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "exp", "log", "log1p", "expm1",
                         "sqrt", "rsqrt", "abs", "neg", "sign", "floor", "ceil", "round", "erf", "logistic",
                         "tanh", "convert_element_type", "integer_pow", "square"})
VIEWS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "iota", "stop_gradient"})


@dataclass(frozen=True)
class Node:
    """One position of the program's order: what YNNPACK makes of it."""

    kind: str  # "dot" (a dot or convolution YNNPACK runs), "reduce", "op" (elementwise, view), ""
    large: bool  # at least MIN_ELEMENTS per device in its result or an operand
    hoists: bool = False  # a negation, which XLA moves below a reduction (_hoisted_fits)


def classify(e: Equation, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str], out_shape: tuple[int, ...],
             out_dtype: str, devices: int) -> Node:
    """`shapes`, `dtypes`: the operands' (literals as scalars). The size test divides by every
    device: a shard may be that small, and a value kept a buffer only overestimates."""
    sizes = [_count(s) for s in (*shapes, out_shape)]
    large = max(sizes, default=0) // max(devices, 1) >= MIN_ELEMENTS
    if out_dtype not in FLOATS or any(d not in FLOATS for d in dtypes):
        return Node("", large)
    if e.name in YNN_REDUCERS and e.params.get("axes"):
        return Node("reduce", large)
    if e.name in ELEMENTWISE:
        return Node("op", large, hoists=e.name == "neg")
    if e.name in VIEWS and (e.name != "broadcast_in_dim" or _in_order(e.params.get("broadcast_dimensions", ()))):
        return Node("op", True)  # a bitcast or a broadcast: free inside the kernel
    if e.name == "dot_general" and _ynn_dot(e, shapes):
        return Node("dot", True)
    if e.name == "conv_general_dilated" and _ynn_conv(e, shapes):
        return Node("dot", True)
    return Node("", large)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _in_order(dims: Sequence[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(dims))


def _ynn_dot(e: Equation, shapes: Sequence[tuple[int, ...]]) -> bool:
    """Leading batch dimensions, the left operand not transposed (contracting its last
    dimensions), and neither free side of size 1 (a matrix-vector product)."""
    if len(shapes) != 2:
        return False
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    (ls, rs), nb = shapes, len(lb)
    if tuple(lb) != tuple(range(nb)) or tuple(rb) != tuple(range(nb)):
        return False
    if tuple(lc) != tuple(range(len(ls) - len(lc), len(ls))):
        return False
    if tuple(rc) not in (tuple(range(nb, nb + len(rc))), tuple(range(len(rs) - len(rc), len(rs)))):
        return False
    m = _count(tuple(d for i, d in enumerate(ls) if i >= nb and i not in lc))
    n = _count(tuple(d for i, d in enumerate(rs) if i >= nb and i not in rc))
    k = _count(tuple(ls[i] for i in lc))
    return m != 1 and n != 1 and max(m, n, k) >= 8


def _ynn_conv(e: Equation, shapes: Sequence[tuple[int, ...]]) -> bool:
    """A 2-D convolution in NHWC / HWIO, not a transposed one (no input dilation), with more than
    16 input or output features."""
    dn = e.params.get("dimension_numbers")
    if dn is None or len(shapes) != 2 or len(shapes[0]) != 4:
        return False
    lhs, rhs, out = (tuple(s) for s in dn)
    if lhs != (0, 3, 1, 2) or rhs != (3, 2, 0, 1) or out != (0, 3, 1, 2):
        return False
    if any(int(d) != 1 for d in e.params.get("lhs_dilation", ()) or ()):
        return False
    return max(int(shapes[1][2]), int(shapes[1][3])) > 16


@dataclass
class _Fusions:
    """Growing fusions: positions -> fusion id, members and root per id."""

    of: dict[int, int] = field(default_factory=dict)
    members: dict[int, set[int]] = field(default_factory=dict)
    root: dict[int, int] = field(default_factory=dict)
    made: int = 0  # fusions made so far: a merged one's id is never given again

    def new(self, t: int) -> int:
        fid, self.made = self.made, self.made + 1
        self.of[t], self.members[fid], self.root[fid] = fid, {t}, t
        return fid

    def take(self, fid: int, other: int) -> set[int]:
        """Merge fusion `other` into `fid`; the members taken in."""
        got = self.members.pop(other)
        self.root.pop(other)
        for t in got:
            self.of[t] = fid
        self.members[fid] |= got
        return got


def fused_inside(nodes: Sequence[Node], operands: Sequence[Sequence[int]], users: Sequence[Sequence[int]],
                 region: Sequence[Hashable], boundary: Callable[[int], bool]) -> list[tuple[set[int], int]]:
    """The library fusions of more than one op: their positions and their root, whose result
    alone is a buffer. `operands[t]` / `users[t]`: the positions making t's operands and
    reading its results; `boundary(t)`: t's result must be a buffer (a program output, a
    loop's or a branch's value)."""
    fu = _Fusions()
    for c in range(len(nodes) - 1, -1, -1):
        if c in fu.of or nodes[c].kind not in ("dot", "reduce"):
            continue
        fid = fu.new(c)
        if nodes[c].kind == "reduce" and nodes[c].large:
            _grow(fu, fid, nodes, operands, users, region, boundary)
    return [(ms, fu.root[fid]) for fid, ms in fu.members.items() if len(ms) > 1]


def _joins(t: int, nodes: Sequence[Node], region: Sequence[Hashable], here: Hashable) -> bool:
    n = nodes[t]
    return region[t] == here and (n.kind == "dot" or (n.kind in ("op", "reduce") and n.large))


def _hoisted_fits(op: int, fu: _Fusions, fid: int, nodes: Sequence[Node], operands: Sequence[Sequence[int]],
                  users: Sequence[Sequence[int]], boundary: Callable[[int], bool]) -> bool:
    """XLA's simplifier moves a negation below a reduction (sum(-x) is -sum(x)), so the
    reduction reads the negation's operand: a negation joins only where that operand could too
    (or is an argument); else the model keeps the negation as the buffer XLA keeps its operand."""
    if not nodes[op].hoists:
        return True
    inside = fu.members[fid] | {op}
    return all(not boundary(p) and nodes[p].kind and all(u in inside for u in users[p]) for p in operands[op])


def _grow(fu: _Fusions, fid: int, nodes: Sequence[Node], operands: Sequence[Sequence[int]],
          users: Sequence[Sequence[int]], region: Sequence[Hashable], boundary: Callable[[int], bool]) -> None:
    here = region[fu.root[fid]]
    queue = [fu.root[fid]]
    while queue:
        x = queue.pop(0)
        for op in operands[x]:
            inside = fu.members[fid]
            if op in inside or boundary(op) or not _joins(op, nodes, region, here):
                continue
            if not all(u in inside for u in users[op]) or not _hoisted_fits(op, fu, fid, nodes, operands, users, boundary):
                continue
            other = fu.of.get(op)
            if other is None:
                fu.of[op] = fid
                inside.add(op)
                queue.append(op)
            elif fu.root[other] == op:  # a fusion whose root only this one reads
                queue += sorted(fu.take(fid, other))
        r = fu.root[fid]
        if x != r or boundary(r) or len(users[r]) != 1:
            continue
        u = users[r][0]
        if u in fu.members[fid] or not _joins(u, nodes, region, here):
            continue
        other = fu.of.get(u)
        if other is None:
            fu.of[u] = fid
            fu.members[fid].add(u)
        else:
            root = fu.root[other]
            queue += sorted(fu.take(fid, other))
            u = root
        fu.root[fid] = u
        queue.append(u)


@dataclass(frozen=True)
class Fusion:
    """One library fusion of a program: the keys it computes inside and the ones it writes
    (its root), and what fusion.stored said of them all, for a plan that breaks it (broken)."""

    inside: frozenset[Key]
    roots: frozenset[Key]
    before: dict[Key, bool]
    feeds: frozenset[Key] = frozenset()  # values made outside it that it reads: buffers

    @property
    def stored(self) -> dict[Key, bool]:
        return {k: False for k in self.inside} | {k: True for k in self.roots | self.feeds}


def fused_keys(tl: Timeline, boundary: set[Key]) -> list[Fusion]:
    """The library fusions of `tl`'s program (fused_inside), in `tl`'s order, as keys;
    `boundary`: keys that must be buffers."""
    prog, seq = tl.program, tl.seq
    made = {k: t for t, ks in enumerate(tl.first) for k in ks}
    devices = math.prod(tl.spaces.mesh.sizes)
    nodes: list[Node] = []
    operands: list[list[int]] = []
    users: list[list[int]] = [[] for _ in seq]
    for t, e in enumerate(seq):
        ops: list[int] = []
        for a in e.inputs:
            p = made.get(tl.key(a)) if isinstance(a, int) else None
            if p is not None and p < t and p not in ops:
                ops.append(p)
                users[p].append(t)
        operands.append(ops)
        nodes.append(_node(e, prog, devices) if tl.first[t] and len(e.outputs) == 1 else Node("", False))
        if (e.name == "dot_general" and _transposed_lhs(e, seq, made, tl.key)) or tl.masks(e):
            nodes[-1] = Node("", True)  # a transposed left operand; a masking multiply (a select)
    making = _making(tl)
    fusions = [(ms, root) for ms, root in fused_inside(nodes, operands, users, [e.region for e in seq],
                                                       lambda t: any(k in boundary for k in tl.first[t]))
               if _drops_a_buffer(ms - {root}, nodes, tl)
               or any(_recomputed_feed(tl, k, making, tl.stored.get(k, True)) for t in _fed(ms, operands, seq)
                      for k in tl.first[t])]
    out = []
    for ms, root in fusions:
        inside = frozenset(k for t in ms if t != root for k in tl.first[t])
        roots = frozenset(tl.first[root])
        feeds = frozenset(k for t in _fed(ms, operands, seq) for k in tl.first[t])
        out.append(Fusion(inside, roots, {k: tl.stored.get(k, True) for k in inside | roots | feeds}, feeds))
    return out


def _fed(ms: set[int], operands: Sequence[Sequence[int]], seq: Sequence[Equation]) -> set[int]:
    """The positions making what a fusion's members read from outside it, looked through views
    (a bitcast of a buffer is that buffer): YNNPACK reads them as buffers, which XLA's loop
    fusions cannot be fused into (a layer norm's normalised input, computed again by each
    elementwise reader, is written out once for the kernel computing its gain's gradient)."""
    out: set[int] = set()
    for t in ms:
        for pos, p in enumerate(operands[t]):
            if p not in ms and fusion.negated_sum_operand(seq[t], pos, seq[p]) is not None:
                p = operands[p][0] if operands[p] else None  # the sum reads its operand (Timeline.hoisted)
            while p is not None and p not in ms and seq[p].name in _BITCASTS:
                p = operands[p][0] if operands[p] else None  # None: a view of an argument
            if p is not None and p not in ms:
                out.add(p)
    return out


# views XLA makes bitcasts, and layout pins it drops: what they read is the buffer
_BITCASTS = YNN_VIEWS | {"sharding_constraint", "stop_gradient", "copy", "copy_p"}


def broken(tl: Timeline, produced: dict[Key, int]) -> dict[Key, bool]:
    """What a plan's layouts undo: a fusion with a value split down to one element along a
    dimension is the program's static choice again. XLA drops that dimension from its products
    with reshapes it lays out as copies, which split the fusion (attention with its heads split
    over every device keeps two copies of the scores)."""
    out: dict[Key, bool] = {}
    for f in tl.fusions:
        if any(_degenerate(tl, k, produced.get(k)) for k in f.before):
            out.update(f.before)
    return out


def _degenerate(tl: Timeline, k: Key, lid: int | None) -> bool:
    if lid is None:
        return False
    shape = tuple(tl.program.values[tl.rep[k]].shape)
    local = tl.spaces.layouts[lid].shard_shape(shape, tl.spaces.mesh)
    return any(n == 1 < g for n, g in zip(local, shape, strict=True))


def _node(e: Equation, prog: Program, devices: int) -> Node:
    vals = [prog.values[a] for a in e.inputs if isinstance(a, int)]
    out = prog.values[e.outputs[0]]
    return classify(e, [tuple(v.shape) for v in vals], [dtype_name(v.dtype) for v in vals], tuple(out.shape),
                    dtype_name(out.dtype), devices)


def _transposed_lhs(e: Equation, seq: Sequence[Equation], made: dict[Key, int], key: Callable[[int], Key | None]
                    ) -> bool:
    """XLA folds a transpose into the product that reads it (fusion.folds_into_dots): a
    transposed left operand, which YNNPACK does not take."""
    a = e.inputs[0]
    p = made.get(key(a)) if isinstance(a, int) else None
    return p is not None and seq[p].name == "transpose"


def fed_reads(tl: Timeline) -> set[tuple[int, Key]]:
    """(position, key) where a member of a library fusion reads a value made outside it, which
    YNNPACK's kernel reads as a buffer (_fed), not as a producer fused into it."""
    member = {k: f for f in tl.fusions for k in f.inside | f.roots}
    out: set[tuple[int, Key]] = set()
    for t, ks in enumerate(tl.first):
        f = next((member[k] for k in ks if k in member), None)
        for a in tl.seq[t].inputs if f is not None else ():
            k = tl.key(a) if isinstance(a, int) else None
            if k is not None and k in f.feeds:  # type: ignore[union-attr]
                out.add((t, k))
    return out


def fed_duplicates(tl: Timeline) -> set[Key]:
    """The feeds of library fusions that their kernels' reads alone make buffers and that XLA
    computes again in their other readers (_recomputed_feed)."""
    making = _making(tl)
    return {k for f in tl.fusions for k in f.feeds if _recomputed_feed(tl, k, making, f.before.get(k, True))}


def _making(tl: Timeline) -> dict[Key, Equation]:
    return {k: tl.seq[t] for t, ks in enumerate(tl.first) for k in ks}


def _recomputed_feed(tl: Timeline, k: Key, making: dict[Key, Equation], stored: bool) -> bool:
    """Is `k`, read by a library fusion from outside it, a value fusion.stored leaves to its
    readers' loop fusions (`stored` False) that XLA may compute again (fusion.duplicable)? It
    writes one for the kernel and its loop fusions compute the value again from its operands:
    a group norm's centred values are stored for the variance's kernel and computed again by
    the normalisation, which keeps the convolution's output live too. A feed that is not
    duplicable is read stored by all its readers, and one of them writes in place into it as
    it dies (`(pred - y)` and its gradient's product), which costs no more than fusing it."""
    e = making.get(k)
    return e is not None and not stored and fusion.duplicable(e, tl.operand_producers(e, making), tl.program)


def _drops_a_buffer(inside: set[int], nodes: Sequence[Node], tl: Timeline) -> bool:
    """Does the fusion keep a value inside that fusion.stored makes a buffer, other than a
    reduction's small result? A reduction and the views below it are the same buffers either
    way, and the model keeps its own order of them."""
    return any(nodes[t].kind != "reduce" and any(tl.stored.get(k, True) for k in tl.first[t]) for t in inside)
