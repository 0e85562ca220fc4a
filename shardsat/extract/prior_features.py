"""What the learned prior (extract/prior.py) sees of a (value, layout) pair, as numbers that mean
the same on every mesh and program.

A layout is described relative to its value: how much of the mesh (log2 of the devices, over
log2 of the mesh) it splits the value over, and over which kinds of dimension. The kinds come
from the program's factor classes (extract/megatron.py): a dimension of the batch (a class a
batch argument's leading dimension is in), the residual stream (the class most weights share),
a model dimension (a class a few weights share: heads, an MLP's hidden width, the vocabulary), a
dimension contracted between activations or kept whole, and the rest. A value is described by
its role (weight, optimizer state, batch, other argument, intermediate), size, rank, producer and
readers, and its neighbourhood by the mean of its neighbours' descriptions (one hop over the
program graph: the producer's operands and the readers' results).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..egraph.layout import SpaceTable
from ..egraph.program import Literal, Program, itemsize
from ..rules.apply import RuleTables
from ..rules.registry import rule_for
from ..rules.rule import Fuse
from .families import roles
from .megatron import DimFacts, dim_facts
from .structure import heavy_roles

VALUE_FEATURES = 21
LAYOUT_FEATURES = 16
FEATURES = 2 * VALUE_FEATURES + LAYOUT_FEATURES
# dimension kinds, in the order of the layout features that count them
BATCH, RESIDUAL, MODEL, BAD, OTHER = range(5)


@dataclass
class Pairs:
    """Every scored (value, layout) pair of a program: value i (program value values[i]) has the
    layout ids layouts[i] (its space's order), the value features context[i] (its own and its
    neighbours' means) and one row of layout features per layout, rows[i] (shared between
    values of one space and kind of dimensions: read only)."""

    values: list[int]
    layouts: list[tuple[int, ...]]
    context: np.ndarray  # [values, 2 * VALUE_FEATURES]
    rows: list[np.ndarray]  # per value: [layouts, LAYOUT_FEATURES]

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """(x [pairs, FEATURES], offsets [values + 1]): value i's pairs are rows offsets[i]:offsets[i + 1]."""
        offsets = np.zeros(len(self.values) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(r) for r in self.rows])
        if not self.rows:
            return np.zeros((0, FEATURES), np.float32), offsets
        ctx = np.repeat(self.context, np.diff(offsets), axis=0)
        return np.concatenate([ctx, np.concatenate(self.rows)], axis=1).astype(np.float32), offsets


def pair_features(program: Program, spaces: SpaceTable, tables: RuleTables, ties: list[tuple[int, int]],
                  balance: float) -> Pairs:
    """The features of every value with more than one layout (a folded loop's repeats are its
    body's values: left out). `balance`: the profile's FLOPs per byte moved over its slowest
    link (extract/prior.py: profile_balance)."""
    r = roles(program, ties)
    facts = dim_facts(program, tables, r.weights)
    vf = _value_features(program, spaces, r.weights, r.state, r.batch)
    vf[:, 20] = math.log10(max(balance, 1.0)) / 6
    nf = _neighbour_means(program, vf)
    kinds = _DimKinds(program, facts, r.batch)
    table = _LayoutTable(spaces)
    values, layouts, rows = [], [], []
    for vid, v in enumerate(program.values):
        if vid in program.aliases:
            continue
        lids = spaces.space(v.shape, v.dtype).layouts
        if len(lids) < 2:
            continue
        rows.append(table.rows(v.shape, v.dtype, kinds.of(vid)))
        values.append(vid)
        layouts.append(tuple(lids))
    context = np.concatenate([vf[values], nf[values]], axis=1) if values else np.zeros((0, 2 * VALUE_FEATURES))
    return Pairs(values, layouts, context.astype(np.float32), rows)


def _value_features(program: Program, spaces: SpaceTable, weights: tuple[int, ...], state: tuple[int, ...],
                    batch: tuple[int, ...]) -> np.ndarray:
    """[values, VALUE_FEATURES]: size, rank, role, output, contraction roles, producer, readers,
    mesh (the last, the profile's balance, is set by pair_features)."""
    before, after = heavy_roles(program)
    role = {program.args[p]: 0 for p in weights} | {program.args[p]: 1 for p in state}
    role |= {program.args[p]: 2 for p in batch}
    outputs = {o for o in program.outputs if isinstance(o, int)}
    readers = np.zeros(len(program.values))
    for eqn in program.equations:
        for a in eqn.inputs:
            if not isinstance(a, Literal):
                readers[a] += 1
    devices = max(spaces.mesh.size(spaces.mesh.active), 1)
    out = np.zeros((len(program.values), VALUE_FEATURES), np.float32)
    for vid, v in enumerate(program.values):
        f = out[vid]
        nbytes = math.prod(v.shape) * itemsize(v.dtype)  # a PRNG key's too (fuzz seeds 39, 50)
        f[0], f[1] = math.log2(nbytes + 1) / 32, len(v.shape) / 6
        f[2 + (role.get(vid, 3) if v.arg is not None else 4)] = 1.0
        f[7], f[8], f[9] = vid in outputs, before[vid], after[vid]
        f[10 + _producer_kind(program, v.producer)] = 1.0
        f[17] = math.log2(readers[vid] + 1) / 4
        f[18], f[19] = math.log2(devices) / 6, len(spaces.mesh.active) / 4
    return out


def _producer_kind(program: Program, producer: int | None) -> int:
    """0: an argument or constant; 1-5: cheap, expensive, reduction, indexing, other opaque;
    6: a contraction."""
    if producer is None:
        return 0
    rule = rule_for(program.equations[producer].primitive)
    if rule.heavy:
        return 6
    return {Fuse.CHEAP: 1, Fuse.EXPENSIVE: 2, Fuse.REDUCE: 3, Fuse.GATHER: 4, Fuse.INPLACE: 4}.get(rule.fuse, 5)


def _neighbour_means(program: Program, vf: np.ndarray) -> np.ndarray:
    """Per value, the mean features of its neighbours: its producer's operands, its readers' results."""
    total = np.zeros_like(vf)
    count = np.zeros(len(vf))
    for eqn in program.equations:
        ins = [a for a in eqn.inputs if not isinstance(a, Literal)]
        if not ins or not eqn.outputs:
            continue
        s_in, s_out = vf[ins].sum(axis=0), vf[list(eqn.outputs)].sum(axis=0)
        for o in eqn.outputs:
            total[o] += s_in
            count[o] += len(ins)
        for a in ins:
            total[a] += s_out
            count[a] += len(eqn.outputs)
    return (total / np.maximum(count, 1)[:, None]).astype(np.float32)


class _DimKinds:
    """Each dimension's kind (BATCH ... OTHER) from its factor class."""

    def __init__(self, program: Program, facts: DimFacts, batch: tuple[int, ...]) -> None:
        self.program, self.facts = program, facts
        self.batch = {facts.root(program.alias(program.args[p]), 0) for p in batch
                      if program.values[program.args[p]].shape}
        counts = {root: len(ws) for root, ws in facts.sharing.items()}
        top = max(counts.values(), default=0)
        self.residual = {root for root, n in counts.items() if n == top and n > 2}

    def of(self, vid: int) -> list[int]:
        out = []
        for d in range(len(self.program.values[vid].shape)):
            root = self.facts.root(vid, d)
            if root in self.batch:
                out.append(BATCH)
            elif root in self.residual:
                out.append(RESIDUAL)
            elif root in self.facts.bad:
                out.append(BAD)
            elif root in self.facts.sharing:
                out.append(MODEL)
            else:
                out.append(OTHER)
        return out


class _LayoutTable:
    """Per space, what its layouts are regardless of the value: per dimension the share of the
    mesh split over (log2 of the devices over log2 of the mesh), and the kind-free features;
    per (space, dimension kinds), the finished rows. Values share spaces (every layer's weights):
    computed once each."""

    def __init__(self, spaces: SpaceTable) -> None:
        self.spaces = spaces
        self.scale = math.log2(max(spaces.mesh.size(spaces.mesh.active), 2))
        self._share: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._rows: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}

    def rows(self, shape: tuple[int, ...], dtype: object, kinds: list[int]) -> np.ndarray:
        """[layouts, LAYOUT_FEATURES]: the share of the mesh split over, partial, and per kind
        of dimension; split dimensions, the largest, first and last; the minor and major mesh
        axes; replicated; the shard's size and its thinnest split dimension."""
        space = self.spaces.space(shape, dtype)
        key = (space.id, tuple(kinds))
        hit = self._rows.get(key)
        if hit is None:
            share, base = self._space(space.id, shape, dtype, space.layouts)
            hit = base.copy()
            for d, k in enumerate(kinds):
                hit[:, 2 + k] += share[:, d]
            self._rows[key] = hit
        return hit

    def _space(self, sid: int, shape: tuple[int, ...], dtype: object, lids: tuple[int, ...]
               ) -> tuple[np.ndarray, np.ndarray]:
        hit = self._share.get(sid)
        if hit is not None:
            return hit
        mesh, scale, rank = self.spaces.mesh, self.scale, len(shape)
        active = mesh.active
        largest = max(range(rank), key=lambda d: shape[d]) if rank else -1
        nbytes = math.prod(shape) * itemsize(dtype)
        share = np.zeros((len(lids), rank), np.float32)
        base = np.zeros((len(lids), LAYOUT_FEATURES), np.float32)
        for i, lid in enumerate(lids):
            lay = self.spaces.layouts[lid]
            share[i] = [math.log2(mesh.size(axes)) / scale for axes in lay.dims]
            f = base[i]
            f[0], f[1] = share[i].sum(), math.log2(mesh.size(lay.partial)) / scale
            f[7] = np.count_nonzero(share[i]) / max(rank, 1)
            if rank:
                f[8], f[9], f[10] = share[i, largest], share[i, 0], share[i, -1]
            used = lay.used_axes()
            f[11] = float(bool(active) and active[-1] in used)
            f[12] = float(bool(active) and active[0] in used)
            f[13] = float(not used)
            f[14] = math.log2(nbytes / 2 ** (f[0] * scale) + 1) / 32
            split = [shape[d] // mesh.size(axes) for d, axes in enumerate(lay.dims) if axes]
            f[15] = math.log2(min(split)) / 10 if split else 0.0  # how thin the thinnest split dimension gets
        self._share[sid] = (share, base)
        return share, base


__all__ = ["FEATURES", "Pairs", "pair_features"]
