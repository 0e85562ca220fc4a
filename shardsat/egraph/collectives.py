"""Collective kinds as objects: everything the pipeline knows about one kind of resharding step.

Each `CollectiveKind` says which layouts it connects (its edges), the egglog constructor and
table that put it in the e-graph, the bytes it moves (the cost model's alpha-beta term), how it
runs (jax.lax inside shard_map), the HLO ops XLA emits for it, its colour in the HTML view and
the flags the memory model reads. `COLLECTIVES`, keyed by `NodeKind`, is the one registry the
rules, extract and runtime stages read instead of per-kind `if` chains, so a new kind is one
entry here (plus its `Dist` constructor in schema.py, which egglog needs as a declared method).

Kinds are stored in saved plans by their `NodeKind` value: never renumber; add new kinds after
`NodeKind.OTHER`. The registry's order is the order of the egglog rules and table loads.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np
from egglog import i64, relation

from .layout import Layout, MeshAxes
from .schema import Dist


class NodeKind(enum.IntEnum):
    PLACE = 0
    LOCAL = 1
    ALL_GATHER = 2
    DYN_SLICE = 3
    ALL_REDUCE = 4
    REDUCE_SCATTER = 5
    ALL_TO_ALL = 6
    OTHER = 7

    @property
    def is_reshard(self) -> bool:
        """A collective (resharding) kind: one entry of `COLLECTIVES`."""
        return self in COLLECTIVES


class StepLike(Protocol):
    """The parameters of one resharding step that lowering reads (runtime's `Step`)."""

    axes: tuple[int, ...]
    dim: int
    dim2: int


# (dst layout, axes, dim, dim2) of each edge from one layout; `free`: mesh axes it does not use
Edge = tuple[Layout, tuple[int, ...], int, int]
Edges = Callable[[Layout, tuple[int, ...]], Iterator[Edge]]
Lower = Callable[[Any, StepLike, MeshAxes, bool], Any]


@dataclass(frozen=True)
class CollectiveKind:
    """One kind of resharding step. `params`: its parameters after the source, in the order of
    both the `Dist` constructor and the egglog `table` row (space, src, *params, dst); "axes" is
    the mesh-axes bitmask, "dim"/"dim2" the dimensions of the step."""

    node: NodeKind
    name: str  # display name, as in Collective.kind, explain() and the egglog rule name
    constructor: Callable[..., Dist]
    table: Callable[..., Any]  # egglog relation of the rows (space, src, *params, dst)
    params: tuple[str, ...]
    edges: Edges
    # bytes each device sends, from (n-1)/n, source and destination shard bytes; None: a local
    # copy priced as HBM traffic of the destination
    moved: Callable[[float, int, int], float] | None
    lower: Lower
    colour: str  # in the HTML cost chart
    hlo_op: str | None  # the HLO op it appears as (None: not a collective in HLO)
    hlo_tuple: bool = False  # XLA's combiners merge it into tuple-shaped ops
    cpu_via_all_reduce: bool = False  # XLA:CPU runs it as an all-reduce of the whole buffer + a slice
    sums: bool = False  # reduces pending partial sums (XLA:CPU's all-reduce combiner merges these)
    fuses: bool = False  # a view its reader fuses: the reader reads the source buffer
    transposes_minor: bool = False  # gathering a minor dimension leaves a raw buffer and a copy
    copied_once: bool = False  # read transposed, its result is copied once into the readers' order, then freed
    cpu_sliced_send: bool = False  # XLA:CPU sends source-sized sliced copies beside the result

    def whole_buffer_on(self, platform: str) -> bool:
        """Does XLA on `platform` run it as an all-reduce of the whole buffer and a slice (the
        whole buffer is a temporary)? XLA:GPU and TPU have a native reduce-scatter."""
        return self.cpu_via_all_reduce and platform == "cpu"

    def combines_on(self, platform: str) -> bool:
        """Can XLA on `platform` merge independent collectives of this kind into one (one latency
        for all)? XLA:CPU has only an all-reduce combiner: six independent all-gathers (or
        all-to-alls) compile to six, six all-reduces to one; its reduce-scatter is an all-reduce.
        XLA:GPU and TPU also combine all-gathers and reduce-scatters."""
        return self.sums if platform == "cpu" else True

    def sliced_send_on(self, platform: str) -> bool:
        """Does XLA on `platform` copy the source into n slices and return n pieces (a tuple
        all-to-all)? XLA:GPU takes an array all-to-all as it is."""
        return self.cpu_sliced_send and platform == "cpu"

    @property
    def local(self) -> bool:
        """No communication: counted as compute, not as a collective."""
        return self.moved is None


def _table(name: str, params: int) -> Callable[..., Any]:
    """An egglog relation (space, src, *params, dst) of i64 columns."""
    return relation(name, *([i64] * (params + 3)))


def _with_dim(lay: Layout, d: int, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(axes if i == d else x for i, x in enumerate(lay.dims))


def _subsets(items: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [c for r in range(1, len(items) + 1) for c in itertools.combinations(items, r)]


def _axis_index(ax: tuple[int, ...], axes: MeshAxes) -> Any:
    """Linear index of this device over `ax` (major first), inside shard_map."""
    idx = 0
    for a in ax:
        idx = idx * axes.sizes[a] + jax.lax.axis_index(axes.names[a])
    return idx


def _local_slice(v: Any, step: StepLike, axes: MeshAxes) -> Any:
    """This device's block of `v` along `step.dim` for `step.axes`."""
    n = math.prod(axes.sizes[a] for a in step.axes)
    size = v.shape[step.dim] // n
    return jax.lax.dynamic_slice_in_dim(v, _axis_index(step.axes, axes) * size, size, step.dim)


# -- edges: the layouts one step of each kind away -------------------------------------------
def _gather_edges(lay: Layout, free: tuple[int, ...]) -> Iterator[Edge]:
    """Gather the minor k axes of a dimension."""
    for d, axes in enumerate(lay.dims):
        for k in range(1, len(axes) + 1):
            yield Layout(_with_dim(lay, d, axes[:-k]), lay.partial), axes[-k:], d, 0


def _slice_edges(lay: Layout, free: tuple[int, ...]) -> Iterator[Edge]:
    """Split a dimension further over one free axis (minor to its current axes)."""
    for d, axes in enumerate(lay.dims):
        for a in free:
            if not axes or a > axes[-1]:
                yield Layout(_with_dim(lay, d, (*axes, a)), lay.partial), (a,), d, 0


def _all_to_all_edges(lay: Layout, free: tuple[int, ...]) -> Iterator[Edge]:
    """Move a dimension's minor axis to another dimension (minor there too)."""
    for d, axes in enumerate(lay.dims):
        if not axes:
            continue
        a = axes[-1]
        for d2, axes2 in enumerate(lay.dims):
            if d2 != d and (not axes2 or a > axes2[-1]):
                dims = list(_with_dim(lay, d, axes[:-1]))
                dims[d2] = (*axes2, a)
                yield Layout(tuple(dims), lay.partial), (a,), d, d2


def _reduce_edges(lay: Layout, free: tuple[int, ...]) -> Iterator[Edge]:
    """Sum any non-empty subset of the pending partial-sum axes."""
    for sub in _subsets(lay.partial):
        rest = tuple(a for a in lay.partial if a not in sub)
        yield Layout(lay.dims, rest), sub, 0, 0


def _scatter_edges(lay: Layout, free: tuple[int, ...]) -> Iterator[Edge]:
    """Sum a subset of the partial-sum axes, leaving a dimension split over them (minor)."""
    for sub in _subsets(lay.partial):
        rest = tuple(a for a in lay.partial if a not in sub)
        for d, axes in enumerate(lay.dims):
            if not axes or sub[0] > axes[-1]:
                yield Layout(_with_dim(lay, d, (*axes, *sub)), rest), sub, d, 0


# -- lowering: the step on a local shard, inside shard_map -----------------------------------
def _names(step: StepLike, axes: MeshAxes) -> tuple[str, ...]:
    return tuple(axes.names[a] for a in step.axes)


def _lower_gather(v: Any, step: StepLike, axes: MeshAxes, cpu: bool) -> Any:
    return jax.lax.all_gather(v, _names(step, axes), axis=step.dim, tiled=True)


def _lower_slice(v: Any, step: StepLike, axes: MeshAxes, cpu: bool) -> Any:
    return _local_slice(v, step, axes)


def _lower_reduce(v: Any, step: StepLike, axes: MeshAxes, cpu: bool) -> Any:
    return jax.lax.psum(v, _names(step, axes))


def _lower_scatter(v: Any, step: StepLike, axes: MeshAxes, cpu: bool) -> Any:
    if cpu:
        # XLA:CPU has no native reduce-scatter on minor dimensions (it becomes an all-to-all
        # and a local sum); the all-reduce + slice form is what it emits under jit too.
        return _local_slice(jax.lax.psum(v, _names(step, axes)), step, axes)
    return jax.lax.psum_scatter(v, _names(step, axes), scatter_dimension=step.dim, tiled=True)


def _lower_all_to_all(v: Any, step: StepLike, axes: MeshAxes, cpu: bool) -> Any:
    return jax.lax.all_to_all(v, _names(step, axes), split_axis=step.dim2, concat_axis=step.dim, tiled=True)


# ring algorithms: all-gather and reduce-scatter move (n-1)/n of the full buffer, all-reduce
# twice that, all-to-all (n-1)/n of the shard
_ORDER = (
    CollectiveKind(NodeKind.ALL_GATHER, "all-gather", Dist.all_gather, _table("GatherT", 2), ("axes", "dim"),
                   _gather_edges, lambda frac, b_src, b_dst: frac * b_dst, _lower_gather, "#f28e2b",
                   "all-gather", hlo_tuple=True, transposes_minor=True, copied_once=True),
    CollectiveKind(NodeKind.DYN_SLICE, "dynamic-slice", Dist.dyn_slice, _table("SliceT", 2), ("axes", "dim"),
                   _slice_edges, None, _lower_slice, "#9c755f", None, fuses=True),
    CollectiveKind(NodeKind.ALL_REDUCE, "all-reduce", Dist.all_reduce, _table("ReduceT", 1), ("axes",),
                   _reduce_edges, lambda frac, b_src, b_dst: 2 * frac * b_src, _lower_reduce, "#e15759",
                   "all-reduce", hlo_tuple=True, sums=True),
    CollectiveKind(NodeKind.REDUCE_SCATTER, "reduce-scatter", Dist.reduce_scatter, _table("ScatterT", 2),
                   ("axes", "dim"), _scatter_edges, lambda frac, b_src, b_dst: frac * b_src, _lower_scatter,
                   "#76b7b2", "reduce-scatter", hlo_tuple=True, cpu_via_all_reduce=True, sums=True),
    CollectiveKind(NodeKind.ALL_TO_ALL, "all-to-all", Dist.all_to_all, _table("AllToAllT", 3),
                   ("axes", "dim", "dim2"), _all_to_all_edges, lambda frac, b_src, b_dst: frac * b_src,
                   _lower_all_to_all, "#b07aa1", "all-to-all", cpu_sliced_send=True),
)

COLLECTIVES: dict[NodeKind, CollectiveKind] = {k.node: k for k in _ORDER}
RESHARD_CODES: frozenset[int] = frozenset(int(k) for k in COLLECTIVES)  # plain ints for hot loops
BY_NAME: dict[str, CollectiveKind] = {k.name: k for k in _ORDER}


def reshard_mask(kinds: np.ndarray) -> np.ndarray:
    """Which entries of a node-kind array are collectives (vectorised `NodeKind.is_reshard`)."""
    return np.isin(kinds, np.fromiter(sorted(RESHARD_CODES), dtype=np.int64))


def row_params(kind: CollectiveKind, mask: int, dim: int, dim2: int) -> tuple[int, ...]:
    """A step's parameters in the order of `kind.params` (its table row and constructor)."""
    values = {"axes": mask, "dim": dim, "dim2": dim2}
    return tuple(values[p] for p in kind.params)
