"""Factor signatures of JAX primitives: one builder per primitive, all elementwise ops share one.

A builder sees the equation's types and params and returns a FactorSignature over all operands
(literal scalars included). Everything about one primitive's sharding is its signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .signature import FactorSignature, TensorFactors


@dataclass(frozen=True)
class EqnTypes:
    """What a signature builder may look at."""

    name: str
    params: Mapping[str, Any]
    in_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[Any, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[Any, ...]
    literal: tuple[bool, ...]
    literal_values: tuple[Any, ...] = ()

    @property
    def out_size(self) -> int:
        return math.prod(self.out_shapes[0]) if self.out_shapes else 0


Builder = Callable[[EqnTypes], FactorSignature]


def _sig(t: EqnTypes, operands: list[TensorFactors], results: list[TensorFactors], **kw: Any) -> FactorSignature:
    sizes: dict[str, int] = {}
    for tensors, shapes in ((operands, t.in_shapes), (results, t.out_shapes)):
        for fac, shape in zip(tensors, shapes, strict=True):
            for fs, n in zip(fac, shape, strict=True):
                if len(fs) == 1:
                    sizes.setdefault(fs[0], n)
    for k, v in kw.pop("sizes", {}).items():
        sizes[k] = v
    sig = FactorSignature(tuple(operands), tuple(results), sizes, name=t.name, **kw)
    return sig.validate(t.in_shapes, t.out_shapes)


def _dims(prefix: str, rank: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(rank)]


def _is_float(dtype: Any) -> bool:
    try:
        return np.issubdtype(np.dtype(dtype), np.inexact)
    except TypeError:
        return False


# ---- elementwise -----------------------------------------------------------------------------

def elementwise(t: EqnTypes) -> FactorSignature:
    """Dims of equal size share a factor (broadcast operands skip theirs). Which operands a
    pending sum passes through is the op's own: its PrimitiveRule's `linear` adds it."""
    shape = t.out_shapes[0]
    fac = _dims("d", len(shape))
    operands: list[TensorFactors] = []
    for s in t.in_shapes:
        if len(s) == 0:
            operands.append(())
        else:
            operands.append(tuple((f,) if n == m else () for f, n, m in zip(fac, s, shape, strict=True)))
    results = [tuple((f,) for f in fac) for _ in t.out_shapes]
    return _sig(t, operands, results, flops=float(t.out_size * max(1, len(t.in_shapes) - 1)))


# ---- contractions and reductions -------------------------------------------------------------

def dot_general(t: EqnTypes) -> FactorSignature:
    (lc, rc), (lb, rb) = t.params["dimension_numbers"]
    lr, rr = len(t.in_shapes[0]), len(t.in_shapes[1])
    lhs: list[tuple[str, ...]] = [()] * lr
    rhs: list[tuple[str, ...]] = [()] * rr
    out: list[tuple[str, ...]] = []
    reduction = []
    for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
        lhs[a] = rhs[b] = (f"b{i}",)
        out.append((f"b{i}",))
    for i, (a, b) in enumerate(zip(lc, rc, strict=True)):
        lhs[a] = rhs[b] = (f"k{i}",)
        reduction.append(f"k{i}")
    for i in range(lr):
        if i not in lc and i not in lb:
            lhs[i] = (f"m{i}",)
            out.append((f"m{i}",))
    for i in range(rr):
        if i not in rc and i not in rb:
            rhs[i] = (f"n{i}",)
            out.append((f"n{i}",))
    k = math.prod(t.in_shapes[0][a] for a in lc)
    return _sig(t, [tuple(lhs), tuple(rhs)], [tuple(out)], reduction=frozenset(reduction),
                linear=((0,), (1,)), flops=2.0 * t.out_size * k)


def ragged_dot_general(t: EqnTypes) -> FactorSignature:
    """A grouped matrix product (lax.ragged_dot: an MoE's experts): rows of the lhs's ragged
    dimension belong to consecutive groups of group_sizes. Like dot_general, batch, free and
    contracted dimensions split (XLA partitions them so), but the ragged dimension and the
    groups stay whole: a device's rows find their group by global position. Where the ragged
    dimension is contracted (the weight gradient) the result gains the group dimension first."""
    rdn = t.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    ragged, groups = tuple(rdn.lhs_ragged_dimensions), tuple(rdn.rhs_group_dimensions)
    if len(ragged) != 1 or ragged[0] in lb:
        raise ValueError(f"ragged dimensions {ragged} with batch dimensions {tuple(lb)}: no rule yet")
    r = ragged[0]
    lr, rr = len(t.in_shapes[0]), len(t.in_shapes[1])
    lhs: list[tuple[str, ...]] = [()] * lr
    rhs: list[tuple[str, ...]] = [()] * rr
    out: list[tuple[str, ...]] = [("g",)] if r in lc else []
    whole = {"g", "r"}
    for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
        lhs[a] = rhs[b] = (f"b{i}",)
        out.append((f"b{i}",))
    for i, (a, b) in enumerate(zip(lc, rc, strict=True)):
        lhs[a] = rhs[b] = ("r",) if a == r else (f"k{i}",)
    for i in range(lr):
        if i not in lc and i not in lb:
            lhs[i] = ("r",) if i == r else (f"m{i}",)
            out.append(lhs[i])
    for d in groups:
        rhs[d] = ("g",)
    for i in range(rr):
        if i not in rc and i not in rb and i not in groups:
            rhs[i] = (f"n{i}",)
            out.append((f"n{i}",))
    if len(t.in_shapes[2]) != len(lb) + 1:
        raise ValueError(f"group_sizes of shape {t.in_shapes[2]} with {len(lb)} batch dimensions: no rule yet")
    group_sizes = (*((f"b{i}",) for i in range(len(lb))), ("g",))
    reduction = frozenset(f"k{i}" for i, a in enumerate(lc) if a != r)
    free_n = math.prod(t.in_shapes[1][i] for i in range(rr) if i not in rc and i not in rb and i not in groups)
    return _sig(t, [tuple(lhs), tuple(rhs), group_sizes], [tuple(out)], reduction=reduction,
                need_replication=frozenset(whole), linear=((0,), (1,)),
                flops=2.0 * math.prod(t.in_shapes[0]) * free_n)


def _reduce(t: EqnTypes, *, summed: bool) -> FactorSignature:
    axes = tuple(t.params["axes"])
    fac = _dims("d", len(t.in_shapes[0]))
    kept = [(f,) for i, f in enumerate(fac) if i not in axes]
    red = frozenset(fac[i] for i in axes)
    operand = tuple((f,) for f in fac)
    n_in = math.prod(t.in_shapes[0])
    if summed:
        return _sig(t, [operand], [tuple(kept)], reduction=red, linear=((0,),), flops=float(n_in))
    results = [tuple(kept) for _ in t.out_shapes]
    return _sig(t, [operand] * len(t.in_shapes), results, need_replication=red, flops=float(n_in))


def reduce_sum(t: EqnTypes) -> FactorSignature:
    return _reduce(t, summed=True)


def reduce_other(t: EqnTypes) -> FactorSignature:
    return _reduce(t, summed=False)


def argminmax(t: EqnTypes) -> FactorSignature:
    return _reduce(t, summed=False)


def positional_collective(t: EqnTypes) -> FactorSignature:
    """psum, pmax or pmin over positional axes (what vmap makes of one over its named axis): a
    sum, max or min of those dimensions. Over a named mesh axis it is the user's own
    collective: replicated."""
    axes = tuple(t.params.get("axes", ()))
    if len(t.in_shapes) != 1 or not axes or not all(isinstance(a, int) for a in axes):
        return replicated(t)
    return _reduce(t, summed=t.name == "psum")


def reduce_generic(t: EqnTypes) -> FactorSignature:
    """lax.reduce with the user's combiner over n operands and n scalar initial values: the
    reduced dimensions whole (the combiner runs within a shard, nothing combines partial
    results), the others split alike on every operand and result."""
    axes = frozenset(int(a) for a in t.params["dimensions"])
    n = len(t.out_shapes)
    fac = _dims("d", len(t.in_shapes[0]))
    operand = tuple((f,) for f in fac)
    kept = tuple((f,) for i, f in enumerate(fac) if i not in axes)
    if len(t.in_shapes) != 2 * n or any(s != t.in_shapes[0] for s in t.in_shapes[:n]):
        return replicated(t)
    return _sig(t, [operand] * n + [()] * n, [kept] * n, need_replication=frozenset(fac[i] for i in axes),
                flops=float(n * math.prod(t.in_shapes[0])))


def cumulative(t: EqnTypes) -> FactorSignature:
    axis = int(t.params["axis"])
    fac = _dims("d", len(t.in_shapes[0]))
    ten = tuple((f,) for f in fac)
    linear = ((0,),) if t.name == "cumsum" else ()
    return _sig(t, [ten], [ten], need_replication=frozenset({fac[axis]}), linear=linear,
                flops=float(t.out_size))


# ---- data movement ---------------------------------------------------------------------------

def broadcast_in_dim(t: EqnTypes) -> FactorSignature:
    shape = t.out_shapes[0]
    bdims = tuple(t.params["broadcast_dimensions"])
    fac = _dims("d", len(shape))
    in_shape = t.in_shapes[0]
    operand = tuple((fac[o],) if in_shape[i] == shape[o] else () for i, o in enumerate(bdims))
    extra = [()] * (len(t.in_shapes) - 1)  # dynamic shape operands (unused in static programs)
    return _sig(t, [operand, *extra], [tuple((f,) for f in fac)], linear=((0,),), flops=0.0)


def transpose(t: EqnTypes) -> FactorSignature:
    perm = tuple(t.params["permutation"])
    fac = _dims("d", len(t.in_shapes[0]))
    return _sig(t, [tuple((f,) for f in fac)], [tuple((fac[p],) for p in perm)], linear=((0,),))


def squeeze(t: EqnTypes) -> FactorSignature:
    dims = set(t.params["dimensions"])
    fac = _dims("d", len(t.in_shapes[0]))
    operand = tuple(() if i in dims else (f,) for i, f in enumerate(fac))
    result = tuple((f,) for i, f in enumerate(fac) if i not in dims)
    return _sig(t, [operand], [result], linear=((0,),))


def expand_dims(t: EqnTypes) -> FactorSignature:
    dims = set(t.params["dimensions"])
    out_rank = len(t.out_shapes[0])
    it = iter(_dims("d", len(t.in_shapes[0])))
    result = tuple(() if i in dims else (next(it),) for i in range(out_rank))
    operand = tuple(r for r in result if r)
    return _sig(t, [operand], [result], linear=((0,),))


def reshape_factors(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[TensorFactors, TensorFactors, dict[str, int], frozenset[str]]:
    """Factor a reshape: dims of equal running product form groups; inside a group, a common
    refinement of both sides' dims into factors (major first). Where none exists, the group is
    one need-replication blob."""
    ins: list[list[str]] = [[] for _ in in_shape]
    outs: list[list[str]] = [[] for _ in out_shape]
    sizes: dict[str, int] = {}
    blobs: set[str] = set()
    i = j = 0
    counter = 0
    while i < len(in_shape) or j < len(out_shape):
        # skip size-1 dims: they carry no factor
        if i < len(in_shape) and in_shape[i] == 1:
            i += 1
            continue
        if j < len(out_shape) and out_shape[j] == 1:
            j += 1
            continue
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                gj.append(j)
                pj *= out_shape[j]
        i += 1
        j += 1
        gi = [d for d in gi if in_shape[d] != 1]
        gj = [d for d in gj if out_shape[d] != 1]
        # common refinement by cumulative products
        cut_in = np.cumprod([in_shape[d] for d in gi]).tolist()
        cut_out = np.cumprod([out_shape[d] for d in gj]).tolist()
        cuts = sorted(set(cut_in) | set(cut_out))
        ok = all(b % a == 0 for a, b in zip([1, *cuts[:-1]], cuts, strict=True))
        if ok:
            prev = 1
            names = []
            for c in cuts:
                name = f"r{counter}"
                counter += 1
                sizes[name] = c // prev
                names.append((name, c))
                prev = c
            for dims, cum, tgt in ((gi, cut_in, ins), (gj, cut_out, outs)):
                lo = 1
                for d, hi in zip(dims, cum, strict=True):
                    tgt[d] = [n for n, c in names if lo < c <= hi]
                    lo = hi
        else:
            # No common refinement: the major-most factor shared by both sides is still safe to
            # split (the gcd of the leading dims); the rest stays replicated.
            g = math.gcd(in_shape[gi[0]], out_shape[gj[0]])
            lead = f"r{counter}"
            counter += 1
            sizes[lead] = g
            for dims, shape, tgt in ((gi, in_shape, ins), (gj, out_shape, outs)):
                rest = f"r{counter}"
                counter += 1
                sizes[rest] = shape[dims[0]] // g
                blobs.add(rest)
                tgt[dims[0]] = [lead, rest] if sizes[rest] > 1 else [lead]
                if sizes[rest] == 1:
                    blobs.discard(rest)
                    del sizes[rest]
                for d in dims[1:]:
                    name = f"r{counter}"
                    counter += 1
                    sizes[name] = shape[d]
                    blobs.add(name)
                    tgt[d] = [name]
    return (tuple(tuple(x) for x in ins), tuple(tuple(x) for x in outs), sizes, frozenset(blobs))


def reshape(t: EqnTypes) -> FactorSignature:
    ins, outs, sizes, blobs = reshape_factors(t.in_shapes[0], t.out_shapes[0])
    extra = [()] * (len(t.in_shapes) - 1)
    return _sig(t, [ins, *extra], [outs], sizes=sizes, need_replication=blobs, linear=((0,),))


def iota(t: EqnTypes) -> FactorSignature:
    # the counted dimension stays whole: a shard would count from 0, not from its offset
    fac = _dims("d", len(t.out_shapes[0]))
    counted = fac[int(t.params["dimension"])]
    return _sig(t, [() for _ in t.in_shapes], [tuple((f,) for f in fac)], need_replication=frozenset({counted}),
                flops=float(t.out_size))


# threefry2x32 per output word: 20 rounds of add, rotate (two shifts and an or) and xor, and
# five key injections; an estimate, for the compute a split draw saves
THREEFRY_OPS = 110


def random_bits(t: EqnTypes) -> FactorSignature:
    """jax.random's bits: with jax_threefry_partitionable (the default since jax 0.5) each
    element's bits are threefry of the key and the element's own index, so any dimension can be
    split and each device draws only its block (XLA's partitioner slices the index iota). A batch
    of keys shares its dimensions with the leading ones of the result. Other generators (rbg)
    and the non-partitionable threefry draw replicated."""
    if not (prng_impl(t.in_dtypes[0]) == "threefry2x32" and threefry_partitionable()):
        return replicated(t)
    fac = _dims("d", len(t.out_shapes[0]))
    key = tuple((f,) for f in fac[:len(t.in_shapes[0])])
    return _sig(t, [key], [tuple((f,) for f in fac)], flops=float(t.out_size * THREEFRY_OPS))


def prng_impl(key_dtype: Any) -> str | None:
    """The PRNG implementation of a key array's dtype (threefry2x32, rbg, unsafe_rbg); None
    for any other dtype."""
    return getattr(getattr(key_dtype, "_impl", None), "name", None)


def threefry_partitionable() -> bool:
    """jax_threefry_partitionable: threefry's bits by each element's own index (jax's default)."""
    import jax

    return bool(jax.config.jax_threefry_partitionable)


def _same_except(t: EqnTypes, fixed: set[int], operand_idx: list[int],
                 linear: tuple[tuple[int, ...], ...] = ((0,),)) -> FactorSignature:
    """Operands in `operand_idx` and the result share dims, except dims in `fixed` or of another
    size, which get their own need-replication factor. Other operands (scalar indices) have none."""
    out_shape = t.out_shapes[0]
    sizes: dict[str, int] = {}
    need: set[str] = set()

    def tensor(tag: str, shape: tuple[int, ...]) -> TensorFactors:
        dims: list[tuple[str, ...]] = []
        for d, n in enumerate(shape):
            if d in fixed or n != out_shape[d]:
                if n == 1:
                    dims.append(())
                    continue
                name = f"{tag}_{d}"
                sizes[name] = n
                need.add(name)
                dims.append((name,))
            else:
                dims.append((f"d{d}",))
        return tuple(dims)

    operands = [tensor(f"x{i}", s) if i in operand_idx else tuple(() for _ in s)
                for i, s in enumerate(t.in_shapes)]
    result = tensor("y", out_shape)
    return _sig(t, operands, [result], sizes=sizes, need_replication=frozenset(need), linear=linear)


def slice_(t: EqnTypes) -> FactorSignature:
    in_shape, out_shape = t.in_shapes[0], t.out_shapes[0]
    strides = t.params.get("strides") or (1,) * len(in_shape)
    fixed = {d for d in range(len(in_shape)) if in_shape[d] != out_shape[d] or strides[d] != 1}
    return _same_except(t, fixed, [0])


def pad(t: EqnTypes) -> FactorSignature:
    cfg = t.params["padding_config"]
    fixed = {d for d, (lo, hi, it) in enumerate(cfg) if lo or hi or it}
    # A pending sum passes through padding only if every device pads with a literal zero.
    zero_pad = len(t.literal) > 1 and t.literal[1] and not np.asarray(t.literal_values[1]).any()  # complex too
    linear: tuple[tuple[int, ...], ...] = ((0,),) if zero_pad else ()
    return _same_except(t, fixed, [0], linear=linear)


def dynamic_slice(t: EqnTypes) -> FactorSignature:
    in_shape, out_shape = t.in_shapes[0], t.out_shapes[0]
    fixed = {d for d in range(len(in_shape)) if in_shape[d] != out_shape[d]}
    return _same_except(t, fixed, [0])


def dynamic_update_slice(t: EqnTypes) -> FactorSignature:
    in_shape, upd = t.in_shapes[0], t.in_shapes[1]
    fixed = {d for d in range(len(in_shape)) if in_shape[d] != upd[d]}
    return _same_except(t, fixed, [0, 1], linear=((0, 1),))


def concatenate(t: EqnTypes) -> FactorSignature:
    dim = int(t.params["dimension"])
    return _same_except(t, {dim}, list(range(len(t.in_shapes))), linear=(tuple(range(len(t.in_shapes))),))


def stack(t: EqnTypes) -> FactorSignature:
    """jnp.stack (jax >= 0.10): operands side by side along a new axis, which stays whole."""
    axis = int(t.params["axis"])
    fac = _dims("d", len(t.in_shapes[0]))
    operand = tuple((f,) for f in fac)
    result = (*operand[:axis], ("n",), *operand[axis:])
    n = len(t.in_shapes)
    return _sig(t, [operand] * n, [result], sizes={"n": n}, need_replication=frozenset({"n"}),
                linear=(tuple(range(n)),))


def unstack(t: EqnTypes) -> FactorSignature:
    """The transpose of stack: one result per index of `axis`, which stays whole."""
    axis = int(t.params["axis"])
    fac = _dims("d", len(t.out_shapes[0]))
    result = tuple((f,) for f in fac)
    operand = (*result[:axis], ("n",), *result[axis:])
    return _sig(t, [operand], [result] * len(t.out_shapes), sizes={"n": t.in_shapes[0][axis]},
                need_replication=frozenset({"n"}), linear=((0,),))


def tile(t: EqnTypes) -> FactorSignature:
    """jnp.tile (jax >= 0.10): a dimension repeated more than once stays whole."""
    reps = tuple(t.params["reps"])
    shape = t.in_shapes[0]
    if len(reps) != len(shape):
        raise ValueError(f"tile: {len(reps)} reps for an operand of rank {len(shape)}")
    operand: list[tuple[str, ...]] = []
    result: list[tuple[str, ...]] = []
    sizes: dict[str, int] = {}
    for d, r in enumerate(reps):
        if r == 1:
            operand.append((f"d{d}",))
            result.append((f"d{d}",))
        else:
            operand.append((f"i{d}",) if shape[d] > 1 else ())
            result.append((f"o{d}",))
            sizes[f"o{d}"] = shape[d] * r
            if shape[d] > 1:
                sizes[f"i{d}"] = shape[d]
    need = frozenset(k for k in sizes)
    return _sig(t, [tuple(operand)], [tuple(result)], sizes=sizes, need_replication=need, linear=((0,),))


def optimization_barrier(t: EqnTypes) -> FactorSignature:
    """Identity on each operand. Operands of one shape share factors (a remat barrier over a
    layer's activations keeps them in one layout); operands of other shapes have their own."""
    by_shape: dict[tuple[int, ...], int] = {}
    tensors = []
    for s in t.in_shapes:
        g = by_shape.setdefault(tuple(s), len(by_shape))
        tensors.append(tuple((f"s{g}_{d}",) for d in range(len(s))))
    return _sig(t, tensors, list(tensors), linear=(tuple(range(len(t.in_shapes))),))


def device_put(t: EqnTypes) -> FactorSignature:
    """jax.device_put of one value, or of several (a tuple: jax.scipy.sparse.linalg.cg puts its
    state so): an identity on each. Operands of one shape are elementwise together, as before;
    of other shapes, each has its own factors (the elementwise signature cannot pair them)."""
    if len({tuple(s) for s in t.in_shapes}) <= 1:
        return elementwise(t)
    return optimization_barrier(t)


def rev(t: EqnTypes) -> FactorSignature:
    return _same_except(t, set(t.params["dimensions"]), [0])


def sort(t: EqnTypes) -> FactorSignature:
    dim = int(t.params["dimension"])
    fac = _dims("d", len(t.in_shapes[0]))
    ten = tuple((f,) for f in fac)
    return _sig(t, [ten] * len(t.in_shapes), [ten] * len(t.out_shapes), need_replication=frozenset({fac[dim]}),
                flops=float(t.out_size * max(1, math.ceil(math.log2(max(2, t.in_shapes[0][dim]))))))


def top_k(t: EqnTypes) -> FactorSignature:
    # XLA's partitioner all-gathers a batch-split top_k on CPU: keep it replicated so the plan
    # predicts what runs.
    return replicated(t)


# Linear algebra on stacks of matrices: the rank of operand 0's core (the trailing dimensions one
# problem reads); every operand and result has the same leading batch dimensions before its core.
LINALG_CORE = {"cholesky": 2, "eigh": 2, "eig": 2, "qr": 2, "svd": 2, "lu": 2, "triangular_solve": 2,
               "geqrf": 2, "householder_product": 2, "lu_pivots_to_permutation": 1, "tridiagonal_solve": 1}


def batched_linalg(t: EqnTypes) -> FactorSignature:
    """Batch dimensions split, each problem's own dimensions whole. XLA partitions the batch of
    these library calls without a collective (jax marks them batch-partitionable; measured on
    CPU: no gather for a batch-split cholesky, eigh, qr, svd, lu or triangular_solve)."""
    nb = len(t.in_shapes[0]) - LINALG_CORE[t.name]
    batch = tuple(t.in_shapes[0][:nb])
    shapes = [*t.in_shapes, *t.out_shapes]
    if nb <= 0 or any(len(s) < nb or tuple(s[:nb]) != batch for s in shapes):
        return replicated(t)
    fac = _dims("b", nb)
    core: dict[str, int] = {}

    def tensor(tag: str, shape: tuple[int, ...]) -> TensorFactors:
        own = []
        for d, n in enumerate(shape[nb:]):
            core[f"{tag}_{d}"] = n
            own.append((f"{tag}_{d}",))
        return (*((f,) for f in fac), *own)

    operands = [tensor(f"i{k}", s) for k, s in enumerate(t.in_shapes)]
    results = [tensor(f"o{k}", s) for k, s in enumerate(t.out_shapes)]
    n = max(t.in_shapes[0][nb:], default=1)
    return _sig(t, operands, results, sizes=core, need_replication=frozenset(core),
                flops=float(math.prod(batch) * n ** 3))


def split(t: EqnTypes) -> FactorSignature:
    axis = int(t.params["axis"])
    rank = len(t.in_shapes[0])
    fac = _dims("d", rank)
    operand = tuple(("sin",) if d == axis else (f,) for d, f in enumerate(fac))
    results = []
    sizes: dict[str, int] = {"sin": t.in_shapes[0][axis]}
    for k, s in enumerate(t.out_shapes):
        results.append(tuple((f"s{k}",) if d == axis else (f,) for d, f in enumerate(fac)))
        sizes[f"s{k}"] = s[axis]
    need = frozenset(sizes)
    return _sig(t, [operand], results, sizes=sizes, need_replication=need, linear=((0,),))


def clamp(t: EqnTypes) -> FactorSignature:
    return elementwise(t)


def bitcast_convert_type(t: EqnTypes) -> FactorSignature:
    if t.in_shapes[0] == t.out_shapes[0]:
        return elementwise(t)
    # width change adds or drops a minor dimension: keep it whole
    a, b = t.in_shapes[0], t.out_shapes[0]
    common = min(len(a), len(b))
    fac = _dims("d", common)
    operand = tuple((f,) for f in fac) + ((("w_in",),) if len(a) > common else ())
    result = tuple((f,) for f in fac) + ((("w_out",),) if len(b) > common else ())
    sizes = {}
    if len(a) > common:
        sizes["w_in"] = a[-1]
    if len(b) > common:
        sizes["w_out"] = b[-1]
    return _sig(t, [operand], [result], sizes=sizes, need_replication=frozenset(sizes))


def replicated(t: EqnTypes) -> FactorSignature:
    """Every dimension of every operand and result replicated: the fallback signature."""
    operands = []
    sizes: dict[str, int] = {}
    for i, s in enumerate(t.in_shapes):
        dims = []
        for d, n in enumerate(s):
            name = f"i{i}_{d}"
            if n != 1:
                sizes[name] = n
                dims.append((name,))
            else:
                dims.append(())
        operands.append(tuple(dims))
    results = []
    for i, s in enumerate(t.out_shapes):
        dims = []
        for d, n in enumerate(s):
            name = f"o{i}_{d}"
            if n != 1:
                sizes[name] = n
                dims.append((name,))
            else:
                dims.append(())
        results.append(tuple(dims))
    sig = FactorSignature(tuple(operands), tuple(results), sizes, need_replication=frozenset(sizes),
                          name=f"{t.name} (replicated)")
    return sig.validate(t.in_shapes, t.out_shapes)


# ---- scan plumbing (pseudo-primitives of egraph/program.py) ----------------------------------
# Pending sums never cross a scan boundary: lax.scan moves arrays, not per-device parts.

def scan_slice(t: EqnTypes) -> FactorSignature:
    """xs[i]: the iteration dimension stays whole (each iteration reads its own slice)."""
    fac = _dims("d", len(t.out_shapes[0]))
    operand = (("it",), *((f,) for f in fac))
    return _sig(t, [operand], [tuple((f,) for f in fac)], sizes={"it": t.in_shapes[0][0]},
                need_replication=frozenset({"it"}))


def cond_merge(t: EqnTypes) -> FactorSignature:
    """A cond's result: every branch's result in the result's layout; the branch index (operand
    0) replicated, so all devices take the same branch. No pending sum crosses the boundary."""
    fac = tuple((f,) for f in _dims("d", len(t.out_shapes[0])))
    return _sig(t, [(), *([fac] * (len(t.in_shapes) - 1))], [fac])


def scan_stack(t: EqnTypes) -> FactorSignature:
    """ys: an iteration's output, written into its slot of the stacked result."""
    fac = _dims("d", len(t.in_shapes[0]))
    result = (("it",), *((f,) for f in fac))
    return _sig(t, [tuple((f,) for f in fac)], [result], sizes={"it": t.out_shapes[0][0]},
                need_replication=frozenset({"it"}))

