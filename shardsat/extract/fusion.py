"""Which values XLA materialises in memory, after its fusion passes.

XLA fuses chains of elementwise ops (with broadcasts, reshapes, slices, pads, concatenations
and transposes) into one kernel that writes only its result: the intermediates never exist as
buffers. A value is materialised when something cannot read it from inside a fused kernel: a
contraction, a sort or a collective reads whole buffers; a loop or branch boundary, a program
output or an in-place update needs one. An expensive elementwise op (exp, log, tanh, divide,
rsqrt, ...) read by several kernels is computed once and stored, not recomputed in each
(XLA's `InstructionFusion::IsExpensive`); a cheap one is duplicated into each reader (stored as
well where a reader cannot fuse it, if it is effectively unary: `duplicable`). XLA:CPU
also keeps a reduction over major dimensions apart from its producer. Each primitive's
PrimitiveRule (rules/registry.py) states its kind: the memory model's view of
`xla/service/instruction_fusion.cc` and `cpu/cpu_instruction_fusion.cc`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence

from ..egraph.program import SCAN_PSEUDO, Equation, Literal, Program
from ..rules.primitives import prng_impl, threefry_partitionable
from ..rules.registry import rule_for
from ..rules.rule import Fuse

# results XLA may write into an operand's buffer when that operand dies there (a sort sorts its
# operand's buffer in place)
INPLACE_KINDS = frozenset({Fuse.CHEAP, Fuse.EXPENSIVE, Fuse.INPLACE})


def in_place(eqn: Equation) -> bool:
    return kind(eqn) in INPLACE_KINDS or rule_for(eqn.primitive).sorts_in_place


def kind(eqn: Equation) -> Fuse:
    """The op's fusion kind, from its PrimitiveRule (an unknown scatter variant updates in place)."""
    fuse = rule_for(eqn.primitive).fuse
    return Fuse.INPLACE if fuse == Fuse.OPAQUE and eqn.name.startswith("scatter") else fuse


def reads_whole(eqn: Equation, pos: int, rank: int, library: bool = False) -> bool:
    """Does this reader need its operand `pos` (of rank `rank`) materialised, unable to fuse its
    producer? `library`: a reduction XLA:CPU hands to YNNPACK (ynn_reduce)."""
    k = kind(eqn)
    if k == Fuse.OPAQUE:
        return True
    if k in (Fuse.INPLACE, Fuse.GATHER):  # the updated buffer, the table; updates and indices fuse
        return pos == 0
    if k == Fuse.REDUCE:  # XLA:CPU fuses producers into reductions of the minor dimension only
        return library or (rank > 0 and (rank - 1) not in tuple(eqn.params.get("axes", ())))
    return False


# XLA:CPU runs a large f32 add / max / min reduction as a YNNPACK kernel (ynn_support.cc,
# IsReduceOpOffloadedToYnn), which reads a whole buffer: the reduced operand is materialised
# whatever the reduced dimensions, unless its producer is one XLA leaves to its own fusion (a
# multiply, which the library fusion takes in, or a view-like op).
YNN_REDUCERS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
YNN_MIN_ELEMENTS = 32 * 1024
YNN_KEPT_PRODUCERS = frozenset({"mul", "square", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                                "slice", "concatenate", "convert_element_type"})


def ynn_reduce(eqn: Equation, shape: tuple[int, ...], dtype: object, producer: Equation | None,
               masks: bool = False) -> bool:
    """Is this reduction (of an operand of `shape` and `dtype`, made by `producer`; None: an
    argument) a YNNPACK kernel that reads its operand as a buffer? The size test is on the
    global operand: a shard under the threshold is a small buffer either way. `masks`: the
    producer multiplies by a converted boolean, which XLA's algebraic simplifier turns into a
    select (no longer a multiply)."""
    if eqn.name not in YNN_REDUCERS or not eqn.params.get("axes") or str(dtype) != "float32":
        return False
    n = 1
    for d in shape:
        n *= int(d)
    if n < YNN_MIN_ELEMENTS:
        return False
    if producer is None:
        return True
    if producer.name == "integer_pow":  # x ** 2 is a multiply in HLO
        return producer.params.get("y") != 2
    return producer.name not in YNN_KEPT_PRODUCERS or masks


# views XLA makes bitcasts: a library fusion reads through them to the op that feeds them
YNN_VIEWS = frozenset({"reshape", "squeeze", "expand_dims"})
# elementwise ops YNNPACK runs inside its fusion (ynn_support.cc's unary and binary op maps)
YNN_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "max", "min", "neg", "abs", "exp", "log", "tanh",
                             "logistic", "sqrt", "rsqrt", "square", "floor", "ceil", "round", "sign"})


LiteralKey = tuple[str, str, tuple[int, ...]]  # a scalar literal's value, dtype and the shape it is broadcast to


def ynn_literal_broadcast(op: Equation, down: bool = False) -> bool:
    """Is `op`, an op a library reduction's fusion takes in (the one beneath it, looked through
    views, or with `down` its reader), one whose scalar literal operand may stay a buffer?
    XLA broadcasts the literal to the op's shape, and CSE makes one broadcast of every equal
    literal at that shape; the library fusion takes in only producers whose users are all
    inside it, so a broadcast another op also reads (a relu's 0.0, which its gradient's
    comparison reads too) is materialised by its own loop fusion (`wrapped_broadcast` feeding
    a `ynn_fusion` in an XLA:CPU dump): a full-size buffer the breadth-first schedule writes at
    the start, as it reads only a constant. A multiply is taken in only downwards (beneath the
    reduction it keeps the reduction XLA's own, ynn_reduce)."""
    if op.name not in YNN_ELEMENTWISE or (op.name == "mul" and not down):
        return False
    return any(isinstance(a, Literal) for a in op.inputs) and any(isinstance(a, int) for a in op.inputs)


def stored(eqn: Equation, readers: list[Equation], whole_read: bool, boundary: bool,
           reshape: bool = False, kernels: int | None = None) -> bool:
    """Is the result of `eqn` a buffer? `readers`: the equations that read it; `whole_read`: one
    of them cannot fuse it; `boundary`: it leaves the program or crosses a region boundary;
    `reshape`: a reduction of size-1 dimensions only, which XLA's simplifier makes a reshape;
    `kernels`: how many kernels its readers are computed in (None: one per reader). XLA fuses
    consumers first, so an expensive op whose readers all end in one kernel (a gelu's tanh,
    read by several ops of its gradient) is fused into it once, not stored."""
    k = Fuse.CHEAP if reshape else kind(eqn)
    if not boundary and folds_into_dots(eqn, readers):
        return False
    if boundary or whole_read or k in (Fuse.REDUCE, Fuse.INPLACE, Fuse.OPAQUE) or not readers:
        return True
    if eqn.name == "broadcast_in_dim" and any(r.name == "reshape" for r in readers):
        return True  # a reshape that interleaves broadcast dimensions is no bitcast: XLA:CPU writes it out
    if k in (Fuse.EXPENSIVE, Fuse.GATHER):
        n = len({id(r) for r in readers}) if kernels is None else kernels
        return n > 1 or any(rule_for(r.primitive).rereads for r in readers)
    if rule_for(eqn.primitive).fused_once:
        return len({id(r) for r in readers}) > 1
    return False


def negated_sum_operand(eqn: Equation, pos: int, producer: Equation | None) -> int | None:
    """The value a sum reads in place of its operand `pos` made by `producer`, or None: XLA's
    algebraic simplifier makes `reduce(-x)` `-reduce(x)`, so the reduction reads `x` (whole
    where it cannot fuse it: a YNNPACK sum of a scatter's result) and the negation, of the
    small reduced value, is no buffer of `x`'s size (log_softmax's backward pass sums its
    negated gradient so)."""
    if eqn.name != "reduce_sum" or pos != 0 or producer is None or producer.name != "neg" or not producer.inputs:
        return None
    x = producer.inputs[0]
    return x if isinstance(x, int) else None


def duplicable(eqn: Equation, producers: Sequence[Equation | None], prog: Program) -> bool:
    """May XLA compute this cheap elementwise op again inside each consumer that fuses it, while
    a consumer that cannot (a product, a library reduction) reads it stored? Only where that
    adds no memory traffic (InstructionFusion::ComputeGloballyUnfusible): the op is effectively
    unary (its other operands broadcasts, iotas or scalars: `x + pos[None]`), or its operands
    are no larger than its result. A residual sum `x + f(x)` read by the next product is not:
    each reader reads it stored. `producers`: per value operand, the equation making it."""
    if kind(eqn) != Fuse.CHEAP or not eqn.outputs or eqn.name in LAYOUT_OPS or eqn.name in SCAN_PSEUDO:
        return False  # a loop's slices and stacks are its plumbing, not ops XLA fuses
    out = prog.values[eqn.outputs[0]]
    vals = [prog.values[a] for a in eqn.inputs if isinstance(a, int)]
    relevant = sum(1 for v, p in zip(vals, producers, strict=True)
                   if (p is None or p.name not in ("broadcast_in_dim", "iota")) and len(v.shape) >= len(out.shape)
                   and 1 < _elements(v.shape) >= _elements(out.shape))  # fewer: a broadcast in HLO
    return relevant <= 1 or sum(_elements(v.shape) for v in vals) <= _elements(out.shape)


# layout ops the memory model prices elsewhere (transposed copies, bitcasts): not duplicated here
LAYOUT_OPS = frozenset({"transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "iota"})


def _elements(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def folds_into_dots(eqn: Equation, readers: list[Equation]) -> bool:
    """A matrix transpose read only by products without batch dimensions: XLA:CPU folds it into
    their dimension numbers (TransposeFolding, IsRowColumnTransposeDotOperand), so it is no
    buffer; the product reads the untransposed matrix (`x @ w.T` reads `w`)."""
    if eqn.name != "transpose" or tuple(eqn.params.get("permutation", ())) != (1, 0) or not readers:
        return False
    return all(r.name == "dot_general" and not any(r.params["dimension_numbers"][1]) for r in readers)


def flattened_product(eqn: Equation, ranks: tuple[int, ...]) -> bool:
    """A product with several free dimensions on an operand (given the operands' ranks): XLA
    computes it as a matrix product (DotDecomposer) whose result is a bitcast of a buffer of
    another shape, so an elementwise reader cannot write into it as it dies
    (CanShareOperandBufferWithUser wants equal shapes): `tanh(x @ w)` for a 3-D `x`."""
    if eqn.name != "dot_general" or len(ranks) != 2:
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return ranks[0] - len(lc) - len(lb) > 1 or ranks[1] - len(rc) - len(rb) > 1


# XLA emits a fused op at most this many times in one kernel (FusionNodeIndexingEvaluation::
# kAllowedCodeDuplication); past it the op is not fused there and is stored
ALLOWED_DUPLICATION = 15


def over_duplicated(seq: Sequence[Equation], first: Sequence[Sequence[Hashable]], stored: dict[Hashable, bool],
                    key: Callable[[int], Hashable | None], shape: Callable[[int], tuple[int, ...]]) -> list[Hashable]:
    """Values a kernel would compute more than ALLOWED_DUPLICATION times, which XLA therefore
    stores (each is marked in `stored` and returned). A fused value is computed once per way its
    readers index it: a reader of the same shape (elementwise) or a transpose passes its own
    indexings on, one that changes the shape (a slice, a pad, a broadcast) is a new one. A tree
    of strided slices (the levels of lax.associative_scan) doubles the count at each level.
    A pad or a concatenation (`fused_once`) is computed once or stored. Kernels are visited from
    the last; a value stored here starts its own kernel."""
    made = {k: t for t, ks in enumerate(first) for k in ks}
    out: list[Hashable] = []
    for root in range(len(seq) - 1, -1, -1):
        if first[root] and any(stored.get(k, True) for k in first[root]):
            out += _kernel_duplicates(seq, root, made, stored, key, shape)
    return out


def _kernel_duplicates(seq: Sequence[Equation], root: int, made: dict[Hashable, int], stored: dict[Hashable, bool],
                       key: Callable[[int], Hashable | None], shape: Callable[[int], tuple[int, ...]]) -> list[Hashable]:
    """over_duplicated for the kernel whose root is the equation at `root`: walks its fused
    producers from the last, counting each one's emissions (XLA's index usage count)."""
    users: dict[int, set[int]] = {root: {-1}}  # position -> the positions indexing it anew (-1: the kernel)
    count = {-1: 1}
    heap, seen, out = [-root], {root}, []
    while heap:
        t = -heapq.heappop(heap)  # every reader of t in the kernel comes later: its count is known
        count[t] = sum(count[u] for u in users[t])
        limit = 1 if rule_for(seq[t].primitive).fused_once else ALLOWED_DUPLICATION
        if t != root and count[t] > limit:
            for k in made_keys(seq[t], key):
                stored[k] = True
                out.append(k)
            continue
        e = seq[t]
        for a in e.inputs:
            k = key(a) if isinstance(a, int) else None
            p = made.get(k) if k is not None else None
            if p is None or p >= t or stored.get(k, True):
                continue
            passes = e.name == "transpose" or not e.outputs or tuple(shape(e.outputs[0])) == tuple(shape(a))
            users.setdefault(p, set()).update(users[t] if passes else {t})
            if p not in seen:
                seen.add(p)
                heapq.heappush(heap, -p)
    return out


def made_keys(eqn: Equation, key: Callable[[int], Hashable | None]) -> list[Hashable]:
    """The keys of an equation's results."""
    return [k for o in eqn.outputs if (k := key(o)) is not None]


# XLA:CPU leaves a concatenation of more operands than this unfused (cpu_instruction_fusion.cc)
MAX_FUSED_CONCAT_OPERANDS = 8


def unfused_concatenation(eqn: Equation, shape: tuple[int, ...], itemsize: int) -> bool:
    """Is this a concatenation XLA:CPU runs as a copy of its own (its operands and result are
    buffers)? One along the minor dimension (at least 64 bytes along it, 2 KiB in all: fused,
    it would branch in the innermost loop) or of more than 8 operands. `shape`: the result's."""
    if eqn.name != "concatenate":
        return False
    if len(eqn.inputs) > MAX_FUSED_CONCAT_OPERANDS:
        return True
    d, n = int(eqn.params.get("dimension", -1)), 1
    for s in shape:
        n *= int(s)
    return len(shape) > 1 and d == len(shape) - 1 and shape[d] * itemsize >= 64 and n * itemsize >= 2048


def may_transpose(eqn: Equation) -> bool:
    """Can XLA copy an operand of this equation into another dimension order (a dot or a
    convolution of two operands)? The copies themselves depend on the shard shapes."""
    return eqn.name in ("dot_general", "conv_general_dilated") and len(eqn.inputs) == 2


def transposed_operands(eqn: Equation, shapes: tuple[tuple[int, ...], ...]) -> dict[int, tuple[int, ...]]:
    """Operands of a dot XLA:CPU copies into another dimension order, given their shard shapes.
    A dot that is not canonical (several contracting or free dimensions on an operand, batch
    dimensions not leading) is rewritten to [batch, free, contracting] x [batch, contracting,
    free] (DotDecomposer). An operand already in that order up to size-1 dimensions (a bitcast)
    is not copied; one with a single free and a single contracting dimension behind leading
    batch dimensions is read as it is (the transpose folds into the dot), unless a batch
    dimension has one element: the dot then loses that dimension behind a reshape and the
    transpose stays a copy (probed on XLA:CPU: an expert weight [1, d, f] split over experts is
    copied as [f, d], the same weight [8, d, f] is not). A convolution's operands are
    transposed into the layout its kernel takes (see _conv_transposed). Returns each copied
    operand's new dimension order, less its size-1 dimensions: copies of one buffer in one order
    are one copy (CSE; a weight's forward and backward dots share it)."""
    if eqn.name == "conv_general_dilated" and len(shapes) == 2:
        return _conv_transposed(eqn, tuple(len(s) for s in shapes))
    if eqn.name != "dot_general" or len(shapes) != 2:
        return {}
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    sides = ((lc, lb, shapes[0]), (rc, rb, shapes[1]))
    if all(len(c) <= 1 and len(s) <= len(b) + 2 and [int(d) for d in b] == list(range(len(b)))
           for c, b, s in sides):
        return {}  # canonical: the dot takes its operands as they are
    degenerate = any(shapes[0][int(d)] == 1 for d in lb)
    out = {}
    for pos, (contract, batch, shape) in enumerate(sides):
        free = [d for d in range(len(shape)) if d not in contract and d not in batch]
        order = [int(d) for d in ([*batch, *free, *contract] if pos == 0 else [*batch, *contract, *free])]
        moved = [d for d in order if shape[d] != 1]
        if moved == sorted(moved):
            continue  # a bitcast
        single = len(contract) <= 1 and len(free) <= 1 and [int(d) for d in batch] == list(range(len(batch)))
        if single and not degenerate:
            continue
        out[pos] = tuple(moved)
    return out


def _conv_transposed(eqn: Equation, ranks: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """XLA:CPU convolves an input laid out (batch, spatial..., feature) with a kernel laid out
    (spatial..., in-feature, out-feature): an operand whose dimension numbers say otherwise
    (the weight gradient's convolution swaps batch and feature) is transposed into a copy."""
    dn = eqn.params.get("dimension_numbers")
    if dn is None or not hasattr(dn, "lhs_spec"):
        return {}
    lhs, rhs = tuple(int(d) for d in dn.lhs_spec), tuple(int(d) for d in dn.rhs_spec)
    orders = {0: (lhs[0], *lhs[2:], lhs[1]), 1: (*rhs[2:], rhs[1], rhs[0])}
    return {pos: order for pos, order in orders.items() if order != tuple(range(ranks[pos]))}


# XLA's ReduceWindowRewriter splits a prefix scan (jax lowers cumsum, cummax, ... to a
# reduce-window over the whole axis) into blocks of this many elements
SCAN_BASE_LENGTH = 16


def blocked_scan(eqn: Equation, shape: tuple[int, ...]) -> bool:
    """Does XLA run this cumulative op as a blocked scan (`ReduceWindowRewriter`)? Then the
    operand is copied into [..., blocks, 16] order and scanned within the blocks, and the block
    totals scanned again: one more operand-sized buffer beside the result (cumsum along 2048 on
    2x4: 4.3 MiB of temps, the model had 0). `shape`: the operand's shard shape."""
    if not rule_for(eqn.primitive).prefix_scan:
        return False
    axis = int(eqn.params.get("axis", 0))
    return 0 <= axis < len(shape) and shape[axis] > SCAN_BASE_LENGTH


# platforms whose lowering of lax.ragged_dot is a grouped product (jax registers one for gpu
# and tpu); elsewhere jax lowers it densely
RAGGED_NATIVE = frozenset({"gpu", "tpu", "cuda", "rocm"})


def dense_ragged_operands(eqn: Equation, platform: str) -> tuple[int, ...]:
    """The operands of a ragged_dot_general XLA materialises once per group: jax's default
    lowering (lax.py `_ragged_dot_general_impl`, CPU) masks the operand with the ragged
    dimension into a (groups, *shape) buffer for a dense dot: the lhs where the ragged dimension
    is free, both operands where it is contracted (a weight gradient), none where it is a batch
    dimension. Measured on 8 CPU devices: an MoE layer's temp 8.5 MiB, the lhs x 8 groups 8 MiB."""
    if eqn.name != "ragged_dot_general" or platform in RAGGED_NATIVE:
        return ()
    nums = eqn.params["ragged_dot_dimension_numbers"]
    (l_contract, _), (l_batch, _) = nums.dot_dimension_numbers
    ragged = nums.lhs_ragged_dimensions[0]
    if ragged in l_batch:
        return ()
    return (0, 1) if ragged in l_contract else (0,)


def threefry_words(eqn: Equation, key_dtype: object, platform: str) -> tuple[int, int]:
    """(held, instant): 32-bit words per element of a `random_bits` result XLA holds. jax draws
    bits with threefry2x32 over two counter words per element (jax_threefry_partitionable, the
    default) and xors the two into the bits, a step each reader fuses: the two words live until
    the bits' last reader. On CPU jax rolls the rounds into a while loop whose body writes two
    new words beside its state: two more at the draw. Measured on 8 CPU devices: dropout drawn
    for a 1024x4096 activation held 64 MiB of temporaries, 4 words per element. Without
    partitionable threefry jax hashes half as many counters, each giving two words: one word
    per element, and one more at the draw (32 MiB there). rbg keys draw with XLA's
    RngBitGenerator, which writes the bits alone (16.4 MiB there: counted as 64 before)."""
    if eqn.name != "random_bits" or prng_impl(key_dtype) != "threefry2x32":
        return (0, 0)
    held = 2 if threefry_partitionable() else 1
    return (held, held) if platform == "cpu" else (held, 0)


HALF_FLOATS = frozenset({"bfloat16", "float16"})
PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def widened_values(eqn: Equation, dtypes: Sequence[str], platform: str) -> tuple[int, ...]:
    """Positions among `eqn`'s operands then results (of these dtypes) whose buffers XLA:CPU
    keeps in float32: it has no half-precision products, so it computes a bf16 / f16 dot or
    convolution in f32, its operands converted (the conversion fused into their producers)
    and its result converted back in each reader. Measured on 8 CPU devices: an MLP step in
    bf16 held 28 MiB of temporaries where its bf16 values were 12 MiB."""
    if platform != "cpu" or eqn.name not in PRODUCTS:
        return ()
    return tuple(i for i, d in enumerate(dtypes) if d in HALF_FLOATS)
