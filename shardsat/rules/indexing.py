"""Factor signatures of the indexing primitives: gather and the scatter family.

An equation that produces or consumes a pending sum is run on shards (inside shard_map) by
re-binding the primitive to the local blocks, with only size params localized (runtime/local.py).
So a factor may be split only where that local bind is exact: indices are never offset to a
shard's range, and no operand is counted on one shard only. Everything else runs on global
arrays, partitioned by XLA.

gather (`jnp.take`, `x[idx]`, `table[tokens]`, `take_along_axis`, a vmapped dynamic_slice):
  * each batch dim of `indices` (every dim but the trailing index vector) and the result dim it
    becomes share a factor; an operand batching dim shares it too;
  * an operand dim sliced whole (an embedding's feature dim) and the result's offset dim share a
    factor (if it is indexed, the only start in range is 0: clamped or filled, each shard knows);
  * every other operand dim needs replication: an indexed dim (an embedding's vocabulary), a dim
    sliced to another size, and its offset dim; so does the index vector dim. (The
    vocabulary-parallel lookup, the indexed dim as a reduction factor, is exact only if each
    shard offsets the indices to its rows and zeros the others; the local bind does not.)
  * linear in the operand, unless out-of-range slices are filled with a value whose sum over
    shards differs from itself (fill mode with a fill other than 0 or NaN).
  The mode (clip / fill / promise_in_bounds) does not change the factors.

scatter, scatter-add, scatter-sub, scatter-mul, scatter-min, scatter-max (never run on shards
with a pending sum, see below, so XLA partitions them on global arrays):
  * operand and result dims share a factor, shardable where each shard can apply its part of
    every update on its own: an operand batching dim (shared with indices and updates), a window
    dim the updates cover whole (shared with the updates; if indexed, the only start in range is
    0), or an indexed dim whose window is one element wide (each shard applies the updates whose
    index falls in its range: updates and indices stay replicated there; XLA does this with no
    collective). Other operand dims need replication, and so does the update window dim mapped
    to them;
  * each scatter (batch) dim of the updates shares a factor with its indices dim, and needs
    replication. For scatter-add / scatter-sub it would be a reduction factor (each shard
    scatters its updates, the sum over shards is the result) only if the operand were counted
    once: carried as a pending sum on the same axes, or zeroed on all shards but the first. The
    strategy enumerator cannot tie an operand's pending sum to a factor's axes, and the local
    bind adds the replicated operand on every shard, so it is not claimed;
  * no linear groups: scatter-add is linear in (operand, updates) together and scatter-mul in
    its operand, but a pending sum would run the scatter on shards, where a split indexed dim is
    wrong (global indices into a local block). Splitting the indexed dim is kept instead.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .primitives import EqnTypes, _sig
from .signature import DimFactors, FactorSignature

SCATTERS = ("scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter_sub", "scatter-mul", "scatter_mul",
            "scatter-min", "scatter_min", "scatter-max", "scatter_max")


class Factors:
    """Collects factor sizes and kinds while a builder names dims; size-1 factors are dropped."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.need: set[str] = set()
        self.reduction: set[str] = set()

    def __call__(self, name: str, size: int, *, need: bool = False, reduction: bool = False) -> DimFactors:
        if size == 1:
            return ()
        if self.sizes.setdefault(name, size) != size:
            raise ValueError(f"factor {name} has sizes {self.sizes[name]} and {size}")
        if need:
            self.need.add(name)
        if reduction:
            self.reduction.add(name)
        return (name,)

    def sig(self, t: EqnTypes, operands: list[Any], results: list[Any], **kw: Any) -> FactorSignature:
        return _sig(t, operands, results, sizes=self.sizes, need_replication=frozenset(self.need),
                    reduction=frozenset(self.reduction), **kw)


def summable(dtype: Any) -> bool:
    """Whether a pending partial sum of this dtype means anything (not for booleans)."""
    try:
        return np.dtype(dtype) != np.dtype(bool)
    except TypeError:
        return False


def fill_sums_to_itself(t: EqnTypes) -> bool:
    """A gather in fill mode fills out-of-range slices on every shard: a pending sum of the
    operand stays exact only if the fill is 0 or NaN."""
    if "FILL" not in str(t.params.get("mode", "")):
        return True
    fill = t.params.get("fill_value")
    if fill is None:
        return bool(np.issubdtype(np.dtype(t.out_dtypes[0]), np.inexact))
    value = complex(fill)
    return value == 0 or np.isnan(value)


def gather(t: EqnTypes) -> FactorSignature:
    dn = t.params["dimension_numbers"]
    slice_sizes = tuple(int(s) for s in t.params["slice_sizes"])
    op_shape, idx_shape = t.in_shapes[0], t.in_shapes[1]
    out_shape = t.out_shapes[0]
    ivd = len(idx_shape) - 1  # JAX's index vector dim is always the last one
    offset_dims = tuple(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims)
    op_batch = tuple(dn.operand_batching_dims)
    idx_batch = tuple(dn.start_indices_batching_dims)
    linear_ok = summable(t.out_dtypes[0]) and fill_sums_to_itself(t)
    F = Factors()

    indices: list[DimFactors] = [F(f"b{j}", idx_shape[j]) for j in range(ivd)]
    indices.append(F("iv", idx_shape[ivd], need=True))
    out: list[DimFactors] = [()] * len(out_shape)
    batch_out = [d for d in range(len(out_shape)) if d not in offset_dims]
    if len(batch_out) != ivd:
        raise ValueError(f"gather: {len(batch_out)} result batch dims for {ivd} indices batch dims")
    for j, d in enumerate(batch_out):
        out[d] = indices[j]
    operand: list[DimFactors] = [()] * len(op_shape)
    window = [d for d in range(len(op_shape)) if d not in collapsed and d not in op_batch]
    if len(window) != len(offset_dims):
        raise ValueError("gather: offset dims do not match the operand's window dims")
    out_of = dict(zip(window, offset_dims, strict=True))
    for d, n in enumerate(op_shape):
        if d in op_batch:
            operand[d] = indices[idx_batch[op_batch.index(d)]]
        elif slice_sizes[d] == n and d not in out_of:  # a collapsed dim of size 1: nothing to split
            operand[d] = ()
        elif slice_sizes[d] == n:  # sliced whole (if indexed, the only start in range is 0)
            operand[d] = out[out_of[d]] = F(f"o{d}", n)
        else:
            operand[d] = F(f"x{d}", n, need=True)
            if d in out_of:
                out[out_of[d]] = F(f"y{d}", slice_sizes[d], need=True)
    return F.sig(t, [tuple(operand), tuple(indices)], [tuple(out)],
                 linear=((0,),) if linear_ok else (), flops=float(t.out_size))


def scatter(t: EqnTypes) -> FactorSignature:
    """Every scatter primitive: operands (operand, indices, updates), one result."""
    dn = t.params["dimension_numbers"]
    op_shape, idx_shape, upd_shape = t.in_shapes[0], t.in_shapes[1], t.in_shapes[2]
    ivd = len(idx_shape) - 1
    window_upd = tuple(dn.update_window_dims)
    inserted = set(dn.inserted_window_dims)
    indexed = set(dn.scatter_dims_to_operand_dims)
    op_batch = tuple(dn.operand_batching_dims)
    idx_batch = tuple(dn.scatter_indices_batching_dims)
    F = Factors()

    indices: list[DimFactors] = []
    for j in range(ivd):
        if j in idx_batch:
            d = op_batch[idx_batch.index(j)]
            indices.append(F(f"o{d}", idx_shape[j]))
        else:
            indices.append(F(f"s{j}", idx_shape[j], need=True))
    indices.append(F("iv", idx_shape[ivd], need=True))
    updates: list[DimFactors] = [()] * len(upd_shape)
    scatter_upd = [u for u in range(len(upd_shape)) if u not in window_upd]
    if len(scatter_upd) != ivd:
        raise ValueError(f"scatter: {len(scatter_upd)} update scatter dims for {ivd} indices batch dims")
    for j, u in enumerate(scatter_upd):
        updates[u] = indices[j]
    window_op = [d for d in range(len(op_shape)) if d not in inserted and d not in op_batch]
    if len(window_op) != len(window_upd):
        raise ValueError("scatter: update window dims do not match the operand's window dims")
    upd_of = dict(zip(window_op, window_upd, strict=True))
    operand: list[DimFactors] = []
    for d, n in enumerate(op_shape):
        if d in op_batch:
            operand.append(F(f"o{d}", n))
        elif d in upd_of:
            u = upd_of[d]
            if upd_shape[u] == n:  # covered whole (if indexed, the only start in range is 0)
                operand.append(F(f"o{d}", n))
                updates[u] = operand[d]
            elif upd_shape[u] == 1 and d in indexed:
                operand.append(F(f"o{d}", n))
            else:
                operand.append(F(f"o{d}", n, need=True))
                updates[u] = F(f"w{u}", upd_shape[u], need=True)
        else:  # an inserted window dim: one element wide
            operand.append(F(f"o{d}", n, need=d not in indexed))
    return F.sig(t, [tuple(operand), tuple(indices), tuple(updates)], [tuple(operand)],
                 flops=float(math.prod(upd_shape)))
