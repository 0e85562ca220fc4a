"""A prior over layouts that needs no training: the standard families, propagated.

Each standard family (extract/families.py) places the arguments; then each equation, in program
order, takes the strategy that costs least given its operands' layouts: its local work (the cost
model's) plus, for each operand it wants in another layout, a resharding estimate. That is
sharding propagation as GSPMD does it, once per family. What narrowing keeps of a value is every
layout a family gives it or asks of it; the search then mixes families per value, and prices
every layout it keeps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..egraph.layout import Layout, Space, SpaceTable
from ..egraph.program import Literal, Program
from ..rules.apply import KeyInfo, RuleTables
from .cost import CostModel
from .families import family_layouts, state_variants


@dataclass(frozen=True)
class _Kind:
    """One equation kind's strategies as arrays."""

    ins: np.ndarray  # (strategies, operands) layout ids
    outs: np.ndarray  # (strategies, results) layout ids
    work: np.ndarray  # (strategies,) seconds of local work


class _Propagation:
    """One program's propagation state: per equation kind its strategies as arrays, and the
    resharding estimates and choices already made (families and identical layers share them)."""

    def __init__(self, program: Program, spaces: SpaceTable, tables: RuleTables, model: CostModel,
                 width: int) -> None:
        self.program, self.spaces, self.tables, self.model, self.width = program, spaces, tables, model, width
        self.kinds: dict[str, _Kind] = {}
        self.moves: dict[tuple[str, int, int], np.ndarray] = {}  # (kind, operand, source) -> per strategy
        self.codes: dict[int, np.ndarray] = {}
        self.columns: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.chosen: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
        self.carry_init = {c: i for r in program.scans for c, i in zip(r.carry_in, r.init, strict=True)
                           if isinstance(i, int)}

    def kind(self, key: str, info: KeyInfo) -> _Kind:
        k = self.kinds.get(key)
        if k is None:
            sts = info.strategies
            n_out = len(info.result_spaces)
            work = [sum(self.model.local_work(f"{key}#{o}", s)[0] for o in range(n_out)) for s in range(len(sts))]
            k = self.kinds[key] = _Kind(np.array([st.ins for st in sts], dtype=np.int64).reshape(len(sts), -1),
                                        np.array([st.outs for st in sts], dtype=np.int64).reshape(len(sts), -1),
                                        np.array(work))
        return k

    def moves_from(self, key: str, i: int, space: Space, col: np.ndarray, src: int) -> np.ndarray:
        """Seconds to reshard operand i from `src` to each layout of `col`, roughly: nothing
        where the target only splits src further (a local slice), else the larger side over the
        slowest link (twice from a pending sum)."""
        hit = self.moves.get((key, i, src))
        if hit is not None:
            return hit
        code, partial, nbytes = self._codes(key, i, space, col)
        c_src, p_src, b_src = self._code(src), bool(self.spaces.layouts[src].partial), self.spaces.shard_bytes(space, src)
        used = c_src >= 0
        finer = ~partial & (not p_src) & (code[:, used] == c_src[used]).all(axis=1)
        finer |= col == src
        prof, names = self.model.profile, self.spaces.mesh.names
        active = self.spaces.mesh.active
        bw = min(prof.link(names[x]) for x in active)
        lat = max(prof.latency(names[x]) for x in active)
        cost = (2.0 if p_src else 1.0) * (np.maximum(nbytes, b_src) / bw + lat)
        hit = self.moves[(key, i, src)] = np.where(finer, 0.0, cost)
        return hit

    def _code(self, lid: int) -> np.ndarray:
        """Per mesh axis: 16 * dimension + position in it for a split axis, -2 pending, -1 unused."""
        hit = self.codes.get(lid)
        if hit is not None:
            return hit
        lay = self.spaces.layouts[lid]
        code = np.full(len(self.spaces.mesh.names), -1, dtype=np.int64)
        for d, axes in enumerate(lay.dims):
            for pos, a in enumerate(axes):
                code[a] = 16 * d + pos
        for a in lay.partial:
            code[a] = -2
        self.codes[lid] = code
        return code

    def _codes(self, key: str, i: int, space: Space, col: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        hit = self.columns.get((key, i))
        if hit is None:
            table = self.spaces.layouts
            uniq, inv = np.unique(col, return_inverse=True)
            code = np.array([self._code(int(lid)) for lid in uniq]).reshape(len(uniq), -1)
            partial = np.array([bool(table[int(lid)].partial) for lid in uniq])
            nbytes = np.array([self.spaces.shard_bytes(space, int(lid)) for lid in uniq], dtype=float)
            hit = self.columns[(key, i)] = (code[inv], partial[inv], nbytes[inv])
        return hit

    def best(self, key: str, info: KeyInfo, ops: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Operand and result layouts of the `self.width` cheapest strategies given the operands'
        layouts, cheapest first (rows)."""
        hit = self.chosen.get((key, ops))
        if hit is not None:
            return hit
        k = self.kind(key, info)
        cost = k.work.copy()
        spaces = [sp for sp in info.operand_spaces if sp is not None]
        for i, (sp, src) in enumerate(zip(spaces, ops, strict=True)):
            cost += self.moves_from(key, i, sp, k.ins[:, i], src)
        top = np.argsort(cost, kind="stable")[:self.width]
        hit = self.chosen[(key, ops)] = (k.ins[top], k.outs[top])
        return hit

    def run(self, start: dict[int, Layout], keep: dict[int, set[int]]) -> None:
        """Propagate one family's argument layouts (flat position -> layout) through the program,
        adding what each value is given and asked for to `keep`."""
        prog, table = self.program, self.spaces.layouts
        lay: dict[int, int] = {}
        for pos, vid in enumerate(prog.args):
            if pos in start:
                lay[vid] = table.intern(start[pos])
        for eqn in prog.equations:
            if all(o in prog.aliases for o in eqn.outputs):
                continue
            key = self.tables.output_key[eqn.outputs[0]].rpartition("#")[0]
            info = self.tables.keys[key]
            reads = [prog.alias(a) for a in eqn.inputs if not isinstance(a, Literal)]
            ops = tuple(self._layout(lay, v) for v in reads)
            ins, outs = self.best(key, info, ops)
            for v, src, lids in zip(reads, ops, ins.T, strict=True):
                keep[v].add(src)
                keep[v].update(lids.tolist())
            for o, lids in zip(eqn.outputs, outs.T, strict=True):
                lay[o] = int(lids[0])
                keep[o].update(lids.tolist())

    def _layout(self, lay: dict[int, int], vid: int) -> int:
        """A value's layout so far: a scan carry starts as its initial value; anything not yet
        placed is replicated."""
        if vid not in lay and vid in self.carry_init:
            lay[vid] = lay.get(self.program.alias(self.carry_init[vid]), -1)
        lid = lay.get(vid, -1)
        if lid < 0:
            v = self.program.values[vid]
            lid = lay[vid] = self.spaces.space(v.shape, v.dtype).layouts[0]
        return lid


def propagated_layouts(program: Program, spaces: SpaceTable, tables: RuleTables, model: CostModel,
                       ties: list[tuple[int, int]], width: int = 1) -> dict[int, set[int]]:
    """Per value, the layouts any standard family's propagation gives it or asks of it, with
    those of each equation's `width` cheapest strategies (the cheapest one propagates)."""
    keep: dict[int, set[int]] = defaultdict(set)
    prop = _Propagation(program, spaces, tables, model, width)
    starts = [start for _, start in family_layouts(program, spaces, ties, tables)] + state_variants(program, spaces, ties)
    for start in starts:
        prop.run(start, keep)
    return keep
