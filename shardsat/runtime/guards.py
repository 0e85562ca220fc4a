"""Operands rewritten before an equation is bound, where XLA's partitioner or simplifier would
otherwise compute something else than the program (found by a robustness hunt; jax 0.10,
XLA:CPU, 8 devices; plain jax.jit with the same sharding constraints is wrong the same way).

* A scatter whose operand the plan splits along an indexed dimension with a one-element window
  (rules/indexing.py lets each shard apply the updates that fall in its block). XLA rewrites a
  one-element scatter into a dynamic-update-slice whose skipped case writes back "the old
  element", read from the unsplit array the operand was sliced from at an index the update's
  own clamping does not match: `jnp.roll(t, -1).at[-1].set(-100)` on a 1-D array split 8 ways
  rewrote the last element of every shard. An optimization barrier on the operand keeps that
  read on the shard's own block.
* dynamic_slice and dynamic_update_slice clamp their start indices into range. Where the plan
  splits the result of a slice along a sliced dimension, XLA merges the two slices into one per
  shard and clamps per shard: a start past the end gave rows [9..15, 15] for jax.jit's [8..15].
  The starts are clamped here first, as the primitive would (so every later merge is in range).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..egraph.layout import Layout, MeshAxes
from ..rules.indexing import SCATTERS

Shape = tuple[int, ...]


def guarded(eqn: Any, operands: list[Any], shapes: list[Shape], operand_lid: int | None,
            layouts: Sequence[Layout], axes: MeshAxes) -> list[Any]:
    """The operands to bind `eqn` to (`shapes`: their global shapes; `operand_lid`: the first
    operand's planned layout)."""
    if eqn.name == "dynamic_slice":
        sizes = eqn.params["slice_sizes"]
        return [operands[0], *_clamped(operands[1:], shapes[0], sizes)]
    if eqn.name == "dynamic_update_slice":
        return [operands[0], operands[1], *_clamped(operands[2:], shapes[0], shapes[1])]
    if split_indexed(eqn, operand_lid, layouts, axes, shapes):
        return [jax.lax.optimization_barrier(operands[0]), *operands[1:]]
    return operands


def _clamped(starts: list[Any], shape: Shape, sizes: Sequence[int]) -> list[Any]:
    return [jnp.clip(s, 0, n - k).astype(jnp.result_type(s)) for s, n, k in zip(starts, shape, sizes, strict=True)]


def split_indexed(eqn: Any, operand_lid: int | None, layouts: Sequence[Layout], axes: MeshAxes,
                  shapes: list[Shape]) -> bool:
    """Whether `eqn` is a scatter with a one-element window along an indexed operand dimension
    that the operand's layout splits. `shapes`: (operand, indices, updates)."""
    if eqn.name not in SCATTERS or operand_lid is None:
        return False
    dn = eqn.params["dimension_numbers"]
    spec = layouts[operand_lid].spec(axes)
    entries = list(spec) + [None] * (len(shapes[0]) - len(spec))
    return any(entries[d] is not None and _window(dn, d, shapes[0], shapes[2]) == 1
               for d in dn.scatter_dims_to_operand_dims)


def _window(dn: Any, d: int, op_shape: Shape, upd_shape: Shape) -> int:
    """The update window's size along operand dimension d (1 where d is inserted)."""
    if d in dn.inserted_window_dims:
        return 1
    window_op = [k for k in range(len(op_shape)) if k not in dn.inserted_window_dims and k not in dn.operand_batching_dims]
    return int(upd_shape[dn.update_window_dims[window_op.index(d)]])


__all__ = ["guarded", "split_indexed"]
