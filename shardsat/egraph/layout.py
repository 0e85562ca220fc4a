"""Layouts: how a logical tensor lies on the mesh.

A layout gives, for each tensor dimension, the mesh axes it is split over (in mesh order, the
major axis first) and the set of axes over which the value is a pending partial sum. Only layouts
whose split sizes divide the dimension exist: shardsat never pads or silently replicates.
Layouts are interned to small integers so the e-graph can carry them as `i64`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from ..errors import InvalidMeshError
from .program import is_extended, itemsize


@dataclass(frozen=True)
class MeshAxes:
    """The mesh as the planner sees it: axis names and sizes. Axes of size 1 are never used.
    `platform` (the devices' jax platform) says how XLA compiles the plan there: which collectives
    its combiners merge (the cost model), how it lowers some primitives (the memory model's dense
    ragged_dot on CPU). Equal meshes of two platforms compare equal but may plan differently."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    platform: str = field(default="cpu", compare=False)

    @staticmethod
    def from_mesh(mesh: Mesh) -> MeshAxes:
        names = tuple(str(n) for n in mesh.axis_names)
        if not names:
            raise InvalidMeshError("The mesh has no axes. Consider jax.make_mesh((8,), ('data',)).")
        if len(set(names)) != len(names):
            raise InvalidMeshError(f"Mesh axis names repeat: {names}.")
        sizes = tuple(int(mesh.shape[n]) for n in names)
        return MeshAxes(names, sizes, str(mesh.devices.flat[0].platform))

    @functools.cached_property
    def active(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.sizes) if s > 1)

    @property
    def num_devices(self) -> int:
        return int(np.prod(self.sizes))

    def size(self, axes: tuple[int, ...] | frozenset[int]) -> int:
        n = 1
        for a in axes:
            n *= self.sizes[a]
        return n

    def mask(self, axes: tuple[int, ...]) -> int:
        return sum(1 << a for a in axes)

    def unmask(self, mask: int) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.names)) if mask >> a & 1)

    def label(self, axes: tuple[int, ...]) -> str:
        return ",".join(self.names[a] for a in axes) if axes else "-"


@dataclass(frozen=True, order=True)
class Layout:
    dims: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...] = ()

    @property
    def rank(self) -> int:
        return len(self.dims)

    def used_axes(self) -> frozenset[int]:
        return frozenset(a for d in self.dims for a in d) | frozenset(self.partial)

    def split_axes(self) -> tuple[int, ...]:
        return tuple(sorted(a for d in self.dims for a in d))

    def shard_shape(self, shape: tuple[int, ...], mesh: MeshAxes) -> tuple[int, ...]:
        return tuple(n // mesh.size(d) for n, d in zip(shape, self.dims, strict=True))

    def spec(self, mesh: MeshAxes) -> PartitionSpec:
        entries: list[Any] = []
        for d in self.dims:
            if not d:
                entries.append(None)
            elif len(d) == 1:
                entries.append(mesh.names[d[0]])
            else:
                entries.append(tuple(mesh.names[a] for a in d))
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def physical_spec(self, mesh: MeshAxes) -> PartitionSpec:
        """The spec of the array that carries this layout inside shard_map: a pending sum is
        stacked on a leading dimension split over its partial axes (one slot per device)."""
        base = self.spec(mesh)
        if not self.partial:
            return base
        entries = list(base) + [None] * (self.rank - len(base))
        return PartitionSpec(tuple(mesh.names[a] for a in self.partial), *entries)

    def describe(self, mesh: MeshAxes) -> str:
        s = str(self.spec(mesh)).replace("PartitionSpec", "P")
        if self.partial:
            s += f" +partial({mesh.label(self.partial)})"
        return s

    @staticmethod
    def replicated(rank: int) -> Layout:
        return Layout(((),) * rank, ())


@dataclass
class LayoutTable:
    """Interns layouts to integer ids (shared by every value of a plan)."""

    layouts: list[Layout] = field(default_factory=list)
    ids: dict[Layout, int] = field(default_factory=dict)

    def intern(self, layout: Layout) -> int:
        lid = self.ids.get(layout)
        if lid is None:
            lid = len(self.layouts)
            self.layouts.append(layout)
            self.ids[layout] = lid
        return lid

    def __getitem__(self, lid: int) -> Layout:
        return self.layouts[lid]


@dataclass(frozen=True)
class Space:
    """The layouts of all values with one (shape, dtype); or of those a prior narrowed to the same
    subset of them (`SpaceTable.narrow`)."""

    id: int
    shape: tuple[int, ...]
    dtype: Any
    layouts: tuple[int, ...]  # layout ids, replicated first

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)


def partial_allowed(dtype: Any) -> bool:
    """Pending sums need an additive dtype: not bool, not PRNG keys."""
    if is_extended(dtype):
        return False
    return np.dtype(dtype) != np.dtype(bool)


def enumerate_layouts(shape: tuple[int, ...], dtype: Any, mesh: MeshAxes) -> list[Layout]:
    """Every layout of a tensor: each active axis goes to one dimension, to the partial set, or
    nowhere; a dimension's split must divide its size."""
    rank = len(shape)
    if is_extended(dtype) or 0 in shape:
        # a zero-size array has nothing to split (and XLA hands back a split one's shards whole)
        return [Layout.replicated(rank)]
    options: list[int | None] = [None, *range(rank)]
    if partial_allowed(dtype):
        options.append(-1)
    out: list[Layout] = []
    active = mesh.active
    for choice in itertools.product(options, repeat=len(active)):
        dims: list[list[int]] = [[] for _ in range(rank)]
        partial: list[int] = []
        for axis, opt in zip(active, choice, strict=True):
            if opt is None:
                continue
            if opt == -1:
                partial.append(axis)
            else:
                dims[opt].append(axis)
        if all(shape[d] % mesh.size(tuple(dims[d])) == 0 for d in range(rank)):
            out.append(Layout(tuple(tuple(d) for d in dims), tuple(partial)))
    out.sort(key=lambda lay: (len(lay.used_axes()), lay))
    return out


@dataclass
class SpaceTable:
    """Spaces by (shape, dtype), each with its enumerated layouts."""

    mesh: MeshAxes
    layouts: LayoutTable = field(default_factory=LayoutTable)
    spaces: list[Space] = field(default_factory=list)
    ids: dict[tuple[tuple[int, ...], str], int] = field(default_factory=dict)
    _bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    _fast: dict[tuple[Any, Any], int] = field(default_factory=dict)
    # values whose layouts a prior narrowed (egraph/narrow.py): value id -> its own space
    value_spaces: dict[int, Space] = field(default_factory=dict)
    _narrowed: dict[tuple[int, tuple[int, ...]], int] = field(default_factory=dict)

    def space(self, shape: tuple[int, ...], dtype: Any) -> Space:
        try:  # by the dtype object first: str(np.dtype) runs Python code, and this is hot
            sid = self._fast.get((shape, dtype))
        except TypeError:  # an unhashable shape or dtype
            sid = None
        if sid is not None:
            return self.spaces[sid]
        key = (tuple(shape), str(dtype))
        sid = self.ids.get(key)
        if sid is None:
            sid = len(self.spaces)
            lids = tuple(self.layouts.intern(lay) for lay in enumerate_layouts(shape, dtype, self.mesh))
            self.spaces.append(Space(sid, tuple(shape), dtype, lids))
            self.ids[key] = sid
        with contextlib.suppress(TypeError):
            self._fast[(shape, dtype)] = sid
        return self.spaces[sid]

    def of_value(self, vid: int, shape: tuple[int, ...], dtype: Any) -> Space:
        """The space of one program value: its narrowed space if a prior narrowed it, else the
        space of its shape and dtype."""
        sp = self.value_spaces.get(vid)
        return sp if sp is not None else self.space(shape, dtype)

    def narrow(self, vid: int, shape: tuple[int, ...], dtype: Any, keep: frozenset[int]) -> Space:
        """Give value `vid` only the layouts of its space in `keep` (replicated always stays, and
        first). Values narrowed to the same layouts share one space, so equal computations still
        hash-cons."""
        base = self.space(shape, dtype)
        lids = tuple(lid for i, lid in enumerate(base.layouts) if i == 0 or lid in keep)
        if len(lids) == len(base.layouts):
            self.value_spaces.pop(vid, None)
            return base
        sid = self._narrowed.get((base.id, lids))
        if sid is None:
            sid = len(self.spaces)
            self.spaces.append(Space(sid, base.shape, base.dtype, lids))
            self._narrowed[(base.id, lids)] = sid
        self.value_spaces[vid] = self.spaces[sid]
        return self.spaces[sid]

    def shard_bytes(self, space: Space, lid: int) -> int:
        key = (space.id, lid)
        hit = self._bytes.get(key)
        if hit is None:
            lay = self.layouts[lid]
            hit = math.prod(lay.shard_shape(space.shape, self.mesh)) * space.itemsize
            self._bytes[key] = hit
        return hit


def constrained_spec(spec: PartitionSpec, rank: int, free: Any) -> PartitionSpec:
    """The spec a with_sharding_constraint holds its value to: its `unconstrained_dims` (`free`)
    None, so any layout may split them."""
    dims = set(free or ())
    if not dims:
        return spec
    return PartitionSpec(*[None if d in dims else e for d, e in enumerate(list(spec) + [None] * (rank - len(spec)))])


def spec_to_layout(spec: PartitionSpec, shape: tuple[int, ...], axes: MeshAxes) -> tuple[Layout | None, str | None]:
    """The layout a PartitionSpec names, or (None, why not)."""
    if len(spec) > len(shape):
        return None, f"spec has {len(spec)} entries for a rank-{len(shape)} array"
    dims: list[tuple[int, ...]] = []
    used: set[int] = set()
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for d, entry in enumerate(entries):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        idx = []
        for n in names:
            if n not in axes.names:
                return None, f"mesh has no axis {n!r} (axes: {axes.names})"
            a = axes.names.index(n)
            if a in used:
                return None, f"axis {n!r} is used twice"
            used.add(a)
            if axes.sizes[a] > 1:
                idx.append(a)
        if idx != sorted(idx):
            return None, f"dimension {d} lists axes {names} out of mesh order {axes.names}"
        if shape[d] % axes.size(tuple(idx)):
            return None, f"dimension {d} of size {shape[d]} does not divide over {names} ({axes.size(tuple(idx))} ways)"
        dims.append(tuple(idx))
    return Layout(tuple(dims), ()), None



def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axes with Auto axis types: the runtime lowers through jit sharding
    constraints, which Explicit axes would turn into type errors."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
