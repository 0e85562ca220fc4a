"""The standard layout families experts write by hand, as argument pins.

Each family places every argument: the batch (positional arguments that are not state or
weights) split on its leading dimension, weights and optimizer state replicated or split. The
search completes each family like a user's pinned plan, releases the pins and keeps the
cheapest plan (see extract/search.py), so that no pinned standard layout is cheaper than the
free plan (every family on small e-graphs; on big ones as many as a work budget allows, in
order of promise):

* dp(S): the batch over axes S, state replicated (all-reduced gradients);
* zero1(S): dp(S), optimizer state split over S (its largest dimension; ZeRO-1/2 are the same
  argument layouts: they differ in intermediates, which the search chooses);
* fsdp(S): dp(S), weights and optimizer state split over S (ZeRO-3);
* tp(a)+dp(R): the batch over the other axes R, every weight's Megatron dimension over `a`
  (extract/megatron.py, from the program's factors: the heads of attention projections, the
  hidden width of an MLP pair, the vocabulary; without the rule tables, the largest dimension);
* fsdp(R)+tp(a): tp(a)+dp(R), each weight's largest other dimension over R as well;
* tp(M): every weight's Megatron dimension over the whole mesh M, the batch free;
* replicated: every argument whole, intermediates free.

S ranges over every non-empty set of mesh axes (more than one device each), `a` over each axis.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..egraph.export import ExportedGraph
from ..egraph.layout import Layout, SpaceTable
from ..egraph.program import Program
from ..egraph.ties import resolve_ties
from ..rules.apply import RuleTables
from .megatron import tensor_ranks
from .structure import heavy_roles


@dataclass(frozen=True)
class Family:
    name: str
    pins: dict[int, frozenset[int]]  # input group -> its layout (one), as a pin

    @property
    def tensor_axis(self) -> str | None:
        """The axis `a` of tp(a)+dp(R) or fsdp(R)+tp(a) (family_layouts makes the names); None for
        the others."""
        found = _TP.search(self.name)
        return found.group(1) if found else None

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor_axis is not None

    @property
    def whole_mesh(self) -> bool:
        """tp(M): tensor parallelism over the whole mesh, nothing else."""
        return self.name.startswith("tp(") and "+" not in self.name


_TP = re.compile(r"(?:^|\+)tp\(([^)]*)\)")


@dataclass(frozen=True)
class Roles:
    """The flat arguments by role: batch, weights (a contraction reads them), other state."""

    batch: tuple[int, ...]
    weights: tuple[int, ...]
    state: tuple[int, ...]


def roles(program: Program, ties: list[tuple[int, int]]) -> Roles:
    """With loop-carried state, the state is what is tied and the rest is batch; a step that
    returns its state untied is read the same way (state_argnums="auto"'s ties). Without state
    (a forward pass), the batch is the positional arguments every leaf of which has a leading
    dimension an output keeps; the other arguments are weights."""
    before, _ = heavy_roles(program)
    ties = ties or resolve_ties(program, "auto", program.name)
    if ties:
        tied = {a for a, _ in ties}
        state = [a for a in range(len(program.args)) if a in tied]
        return Roles(tuple(a for a in range(len(program.args)) if a not in tied),
                     tuple(a for a in state if before[program.args[a]]),
                     tuple(a for a in state if not before[program.args[a]]))
    lead = {program.values[o].shape[0] for o in program.outputs if isinstance(o, int) and program.values[o].shape}
    batch, weights, start = [], [], 0
    for count in program.arg_counts:
        positions = range(start, start + count)
        start += count
        shapes = [program.values[program.args[a]].shape for a in positions]
        (batch if all(s and s[0] in lead for s in shapes) else weights).extend(positions)
    return Roles(tuple(batch), tuple(weights), ())


def _split(shape: tuple[int, ...], dims: list[int], axes_per_dim: list[tuple[int, ...]],
           spaces: SpaceTable) -> Layout:
    """`axes_per_dim[i]` (those of them that divide, in mesh order) on dimension `dims[i]`."""
    out: list[tuple[int, ...]] = [()] * len(shape)
    for d, axes in zip(dims, axes_per_dim, strict=True):
        kept: list[int] = []
        for a in axes:
            if shape[d] % spaces.mesh.size((*kept, a)) == 0:
                kept.append(a)
        out[d] = tuple(kept)
    return Layout(tuple(out), ())


def _tensor_rank(rank: tuple[int, int]) -> tuple[int, int, int]:
    """(contracted between activations, in no other weight's class, weights sharing the class):
    a class of one weight is an edge of the program (an MLP chain's input features), not a
    block's hidden width; it comes after the shared ones (the vocabulary, whose embedding has
    it alone, has only the residual stream to compete with)."""
    flagged, sharing = rank
    return flagged, int(sharing == 1), sharing


def _by_size(shape: tuple[int, ...]) -> list[int]:
    return sorted(range(len(shape)), key=lambda d: (-shape[d], d))


class _Builder:
    """Layouts of one program's arguments on one mesh. `ranks`: per weight and state argument,
    per dimension, its rank for tensor parallelism (extract/megatron.py); without, the largest
    dimension is split."""

    def __init__(self, program: Program, spaces: SpaceTable, ranks: dict[int, list[tuple[int, int]]] | None = None):
        self.program, self.spaces, self.ranks = program, spaces, ranks or {}
        # the residual stream: the class most weights share, where it spans more than a pair
        widest = max((c for r in self.ranks.values() for _, c in r), default=0)
        self.residual = widest if widest > 2 else widest + 1

    def shape(self, pos: int) -> tuple[int, ...]:
        return self.program.values[self.program.args[pos]].shape

    def batch(self, pos: int, axes: tuple[int, ...]) -> Layout:
        shape = self.shape(pos)
        return _split(shape, [0], [axes], self.spaces) if shape else Layout.replicated(0)

    def largest(self, pos: int, axes: tuple[int, ...]) -> Layout:
        """`axes` on the largest dimension."""
        shape = self.shape(pos)
        dims = _by_size(shape)
        if not dims:
            return Layout.replicated(0)
        return _split(shape, dims[:1], [axes], self.spaces)

    def tensor(self, pos: int, tp: tuple[int, ...], rest: tuple[int, ...] = ()) -> Layout:
        """`tp` on the dimension tensor parallelism splits (the best ranked one it divides, not
        the residual stream's), `rest` on the largest other one."""
        shape = self.shape(pos)
        if not shape:
            return Layout.replicated(0)
        n, rank = self.spaces.mesh.size(tp), self.ranks.get(pos)
        dims = [d for d in range(len(shape)) if not rank or rank[d][1] < self.residual]
        if not dims:  # the residual stream's own weights (norm scales, biases) stay whole over tp
            return _split(shape, _by_size(shape)[:1], [rest], self.spaces)
        first = min(dims, key=lambda d: (shape[d] % n != 0, *(_tensor_rank(rank[d]) if rank else ()), -shape[d], d))
        if not rest or len(shape) == 1:
            return _split(shape, [first], [tp], self.spaces)
        second = next(d for d in _by_size(shape) if d != first)
        return _split(shape, [first, second], [tp, rest], self.spaces)

    def nth(self, pos: int, axes: tuple[int, ...], j: int) -> Layout:
        """`axes` on the j-th largest dimension (the smallest, if fewer)."""
        shape = self.shape(pos)
        dims = _by_size(shape)
        if not dims:
            return Layout.replicated(0)
        return _split(shape, [dims[min(j, len(dims) - 1)]], [axes], self.spaces)

    def whole(self, pos: int) -> Layout:
        return Layout.replicated(len(self.shape(pos)))


def family_layouts(program: Program, spaces: SpaceTable, ties: list[tuple[int, int]],
                   tables: RuleTables | None = None) -> list[tuple[str, dict[int, Layout]]]:
    """(name, flat argument position -> layout) of each standard family on this mesh (see the
    module docstring), without duplicates. With the rule `tables`, tensor parallelism splits the
    dimensions the program's factors say (extract/megatron.py); else the largest."""
    r = roles(program, ties)
    b = _Builder(program, spaces, None if tables is None else tensor_ranks(program, tables, r.weights, r.state))
    active = spaces.mesh.active
    out = [("replicated", {a: b.whole(a) for a in range(len(program.args))})]
    for k in range(1, len(active) + 1):
        for axes in itertools.combinations(active, k):
            label = spaces.mesh.label(axes)
            batch = {a: b.batch(a, axes) for a in r.batch}
            out.append((f"dp({label})", batch | {a: b.whole(a) for a in r.weights + r.state}))
            if r.state:
                out.append((f"zero1({label})", batch | {a: b.whole(a) for a in r.weights}
                            | {a: b.largest(a, axes) for a in r.state}))
            out.append((f"fsdp({label})", batch | {a: b.largest(a, axes) for a in r.weights + r.state}))
    if len(active) >= 2:
        # tensor parallelism over the whole mesh, the batch free (a small model's best layout
        # on 8 devices is the same on 2x4, and no single-axis family reaches it)
        out.append((f"tp({spaces.mesh.label(active)})", {a: b.tensor(a, active) for a in r.weights + r.state}))
        for tp in active:
            rest = tuple(a for a in active if a != tp)
            batch = {a: b.batch(a, rest) for a in r.batch}
            label, rest_label = spaces.mesh.label((tp,)), spaces.mesh.label(rest)
            out.append((f"tp({label})+dp({rest_label})", batch | {a: b.tensor(a, (tp,)) for a in r.weights + r.state}))
            out.append((f"fsdp({rest_label})+tp({label})",
                        batch | {a: b.tensor(a, (tp,), rest) for a in r.weights + r.state}))
    unique: list[tuple[str, dict[int, Layout]]] = []
    axis_order = {spaces.mesh.label((a,)): i for i, a in enumerate(active)}
    for name, layouts in sorted(out, key=lambda f: _prior(f[0], len(active), axis_order)):
        if all(layouts != seen for _, seen in unique):
            unique.append((name, layouts))
    return unique


def data_parallel_fills(program: Program, spaces: SpaceTable, ties: list[tuple[int, int]]) -> bool:
    """Whether data parallelism over every axis splits every batch argument over the whole mesh;
    where it cannot (a batch of 32 on 64 devices, or no batch), only model parallelism uses every
    device, and the search completes a tensor-parallel family in full (extract/search.py)."""
    b = _Builder(program, spaces)
    arrays = [a for a in roles(program, ties).batch if b.shape(a)]  # a scalar (a learning rate) has no batch
    every = spaces.mesh.active
    return bool(arrays) and all(sum(len(axes) for axes in b.batch(a, every).dims) == len(every) for a in arrays)


def widest_data_parallel(spaces: SpaceTable) -> str:
    """The name of data parallelism over every axis (family_layouts names it): where it fills the
    mesh, the search completes it in full (extract/search.py)."""
    return f"dp({spaces.mesh.label(spaces.mesh.active)})"


def tensor_axis(spaces: SpaceTable, link: Callable[[str], float]) -> str | None:
    """The axis tensor parallelism belongs on: the fastest link (it moves activations every
    layer), ties to the minor axis. The layout space orders each dimension's axes major first
    and reshards the minor ones (egraph/collectives.py), so the same family over another axis
    of the same speed can complete costlier: a 4-layer GPT step on 4x4x4, FSDP + TP over the
    three axes from minor to major, 582, 593 and 910 us pinned. None on a mesh of one device."""
    names = spaces.mesh.names
    if not spaces.mesh.active:
        return None
    return names[max(spaces.mesh.active, key=lambda a: (link(names[a]), a))]


def state_variants(program: Program, spaces: SpaceTable, ties: list[tuple[int, int]]) -> list[dict[int, Layout]]:
    """ZeRO-1 and FSDP over every axis with the state split on its second, third, ... largest
    dimension instead of its largest (flat argument position -> layout): the families pick one
    dimension, and an update can be cheaper on another (a 2x2x2 GPT step's optimizer state on its
    head dimension)."""
    r = roles(program, ties)
    b = _Builder(program, spaces)
    every = spaces.mesh.active
    batch = {a: b.batch(a, every) for a in r.batch}
    out: list[dict[int, Layout]] = []
    rank = max((len(b.shape(a)) for a in r.weights + r.state), default=0)
    for j in range(1, rank):
        out.append(batch | {a: b.whole(a) for a in r.weights} | {a: b.nth(a, every, j) for a in r.state})
        out.append(batch | {a: b.nth(a, every, j) for a in r.weights + r.state})
    return out


def _prior(name: str, axes: int, axis_order: dict[str, int]) -> tuple[int, int]:
    """Families in the order they pay off, where the search has time for only a few: every
    argument replicated with intermediates free (released, the best start of the experts
    benchmark's 2x2x2 GPT step, 4x2 Soft-MoE, conv nets, 8-device llama), ZeRO-1 over every
    axis, then over each axis alone and the other sets (a training step's update on a fraction
    of the state: a 3-layer GPT step on 2x4, 2,614 us released replicated, 2,518 us from
    zero1(data,model), 2,493 from zero1(data)), FSDP + TP (the GPT and llama steps on 2x4, 4x2
    and 2x2x2 pinned), the widest data parallelism (where communication dominates), then the
    rest. On three or more axes ZeRO-1 over each single axis alternates with FSDP + TP with TP
    over that axis, and the other ZeRO-1 sets follow: they are 2^k - 2 families, and before FSDP
    + TP they took the whole budget (a 4-layer GPT step on 4x4x4: 806 us from the replicated
    family; FSDP + TP, never reached, completes to 662 pinned, 648 released)."""
    widest = name.count(",") == axes - 1 and "+" not in name  # over every axis
    if name == "replicated":
        return (0, 0)
    if name.startswith("tp("):
        return (6, 0)
    if name.startswith("zero1") and widest:
        return (1, 0)
    fsdp_tp = "+tp(" in name and name.startswith("fsdp")
    if axes >= 3:
        single = name.startswith("zero1") and "," not in name
        if single or fsdp_tp:
            axis = name.rpartition("(")[2].rstrip(")")
            return (2, 2 * axis_order[axis] + (1 if fsdp_tp else 0))
        if name.startswith("zero1"):
            return (3, 0)
    elif name.startswith("zero1"):
        return (2, 0)
    if fsdp_tp:
        return (3, 0)
    if widest:
        return ({"dp": 4, "fsdp": 5}[name.split("(")[0]], 0)
    if "+" in name:
        return (6, 0)
    return (7, 0)


def families(program: Program, graph: ExportedGraph, spaces: SpaceTable, ties: list[tuple[int, int]],
             user_pins: dict[int, frozenset[int]], tables: RuleTables | None = None) -> list[Family]:
    """The standard families as pins of the e-graph's input groups, leaving out the arguments the
    user pinned (and families that ask two layouts of one group: a folded loop's layers)."""
    out: list[Family] = []
    for name, layouts in family_layouts(program, spaces, ties, tables):
        pins: dict[int, frozenset[int]] = {}
        for pos, lay in layouts.items():
            grp = graph.value_group.get(program.args[pos])
            if grp is None or pos in user_pins:
                continue
            v = program.values[program.args[pos]]
            lid = spaces.layouts.intern(lay)
            space = spaces.of_value(program.args[pos], v.shape, v.dtype)
            if lid not in space.layouts:
                lid = space.layouts[0]
            if pins.setdefault(grp, frozenset({lid})) != frozenset({lid}):
                break
        else:
            if pins and all(pins != f.pins for f in out):
                out.append(Family(name, pins))
    return out
