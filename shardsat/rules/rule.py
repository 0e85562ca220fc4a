"""`PrimitiveRule`: everything the pipeline knows about one primitive, in one object.

The rules stage reads its factor signature (and the linearity a pending partial sum passes
through), the cost model whether XLA fuses it and whether it is a contraction, the lowering how
to rewrite its size params on shards and whether it is the user's own layout pin. Rules are
registered once (rules/registry.py) and found by the `Primitive` object, else by its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from ..errors import InvalidSignatureError
from .primitives import Builder, EqnTypes
from .signature import FactorSignature

Shape = tuple[int, ...]
Groups = tuple[tuple[int, ...], ...]
# (params, [(global, local) shape per operand], [(global, local) shape per result]) -> params
Localizer = Callable[[dict[str, Any], list[tuple[Shape, Shape]], list[tuple[Shape, Shape]]], dict[str, Any]]
LinearFn = Callable[[EqnTypes], Groups]


class Fuse(IntEnum):
    """How XLA's fusion passes treat an op (the memory model's view, extract/fusion.py)."""

    CHEAP = 0  # elementwise-like, duplicated into every reader
    EXPENSIVE = 1  # elementwise but stored when several kernels read it
    REDUCE = 2  # a fusion root that reads fused producers and writes a (smaller) buffer
    GATHER = 3  # reads a materialised table; fuses into one reader
    INPLACE = 4  # updates a buffer in place (scatter, dynamic-update-slice)
    OPAQUE = 5  # reads and writes whole buffers (dot, conv, sort, collectives, loops)


@dataclass(frozen=True)
class PrimitiveRule:
    """One primitive as the pipeline sees it. `builder` None with `unsupported` set: listed as
    deliberately unsupported (the reason is shown); both None: no rule (fallback applies)."""

    name: str
    builder: Builder | None = None
    unsupported: str | None = None
    # operand groups a pending partial sum passes through unchanged, from the equation's types;
    # None: the builder's signature says (most builders state their own)
    linear: LinearFn | None = None
    elementwise: bool = False  # pointwise arithmetic: counted in the optimizer update's FLOPs
    fusible: bool = False  # XLA fuses it into neighbours: charged for writing its result only
    heavy: bool = False  # a contraction: collectives between two of them cannot be combined
    writes_slot: bool = False  # writes its operand into one slot of a larger buffer (scan ys)
    localize: Localizer | None = None  # rewrites params naming global sizes to shard sizes
    pin: str | None = None  # the user's layout pin: the param holding the pinned sharding
    fuse: Fuse = Fuse.OPAQUE  # what XLA's fusion makes of it (which results are buffers)
    sorts_in_place: bool = False  # opaque, yet writes its result into a dying operand's buffer
    rereads: bool = False  # reads each operand element many times (broadcast, pad, tile)
    # fused into one reader and computed once there, else stored (it invalidates XLA's emitter cache)
    fused_once: bool = False
    # a prefix scan jax lowers to a reduce-window over the whole axis (cumsum, ...), which XLA
    # runs in blocks with a block-order copy of its operand (extract/fusion.blocked_scan)
    prefix_scan: bool = False

    def signature(self, t: EqnTypes) -> FactorSignature:
        """The factor signature of one equation: the builder's, with this rule's linearity."""
        if self.builder is None:
            raise InvalidSignatureError(f"`{self.name}` has no signature builder.")
        sig = self.builder(t)
        if self.linear is None:
            return sig
        groups = self.linear(t)
        for group in groups:
            for i in group:
                if not 0 <= i < len(sig.operands):
                    raise InvalidSignatureError(f"signature `{sig.name}`: linear group {group} names operand {i}.")
        return dataclasses.replace(sig, linear=groups)


# ---- linearity -------------------------------------------------------------------------------

def all_operands(t: EqnTypes) -> Groups:
    """A sum (add, sub): partial sums pass through when every operand carries one."""
    return (tuple(range(len(t.in_shapes))),)


def first_operand(t: EqnTypes) -> Groups:
    """A unary linear op (neg, copy, a pin) or a divide's numerator."""
    return ((0,),)


def each_operand(t: EqnTypes) -> Groups:
    """A product (mul): linear in either operand alone."""
    return ((0,), (1,))


def select_cases(t: EqnTypes) -> Groups:
    """select_n: linear in the cases together (not the predicate)."""
    return (tuple(range(1, len(t.in_shapes))),)


def none(t: EqnTypes) -> Groups:
    return ()


def float_convert(t: EqnTypes) -> Groups:
    """A conversion to a float type keeps sums (not from bool, not to an integer type)."""
    import numpy as np

    from .primitives import _is_float

    ok = _is_float(t.out_dtypes[0]) and np.dtype(t.in_dtypes[0]) != np.dtype(bool)
    return ((0,),) if ok else ()


def groups(spec: Sequence[Sequence[int]]) -> LinearFn:
    """Fixed operand groups (what register_signature's `linear` states)."""
    fixed = tuple(tuple(int(i) for i in g) for g in spec)
    return lambda t: fixed


# ---- localisation of size params --------------------------------------------------------------

def _replace_full(sizes: Sequence[int], global_shape: Shape, local_shape: Shape) -> tuple[int, ...]:
    """Entries equal to a split dimension's global size become its local size."""
    out = []
    for s, g, loc in zip(sizes, global_shape, local_shape, strict=True):
        out.append(loc if (g != loc and s == g) else s)
    return tuple(out)


def result_shape(name: str) -> Localizer:
    """The param `name` states the result's shape: it becomes the local result shape."""
    def fn(params: dict[str, Any], ins: list[tuple[Shape, Shape]], outs: list[tuple[Shape, Shape]]) -> dict[str, Any]:
        return {**params, name: tuple(outs[0][1])}

    return fn


def operand_sizes(name: str) -> Localizer:
    """The param `name` states sizes along the first operand's dims: full ones shrink to shards."""
    def fn(params: dict[str, Any], ins: list[tuple[Shape, Shape]], outs: list[tuple[Shape, Shape]]) -> dict[str, Any]:
        g, loc = ins[0]
        return {**params, name: _replace_full(params[name], g, loc)}

    return fn
