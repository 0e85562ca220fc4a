"""The cost model: seconds per e-node, from the work the rules stage describes.

A local op costs its roofline time on one device: max(FLOPs / flop rate, bytes / HBM rate).
Contractions, reductions and indexing ops read their operands and write their result; ops XLA
fuses into their neighbours (elementwise, broadcasts, reshapes, transposes, converts, selects)
are charged for writing their result only, since their operands stay in registers of the fused
kernel. A collective costs alpha-beta time on the mesh axes it spans: the axes' latency plus the
bytes each device moves over the slowest of those links (each kind's `moved` in
`shardsat/egraph/collectives.py`, ring algorithms). XLA combines collectives that are independent
of the compute chain (those that only depend on inputs, like gathering weights, or only feed cheap
ops, like reducing gradients for the update) into large groups: such a collective pays latency in
proportion to its share of a combined group (`combine_threshold_bytes`), not once per tensor. A
kind that moves nothing (a dynamic slice) is a local copy.
Costs are per node, so a shared node is paid once by DAG extraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..egraph.collectives import COLLECTIVES, RESHARD_CODES, NodeKind
from ..egraph.export import ExportedGraph
from ..egraph.layout import MeshAxes, SpaceTable
from ..rules.apply import RuleTables
from ..rules.registry import rule_for
from .profile import DeviceProfile


@dataclass(frozen=True)
class CollectiveCost:
    seconds: float
    moved_bytes: float  # bytes each device sends
    buffer_bytes: int  # per-device bytes of the larger side


class CostModel:
    def __init__(self, profile: DeviceProfile, spaces: SpaceTable, tables: RuleTables) -> None:
        self.profile = profile
        self.spaces = spaces
        self.mesh: MeshAxes = spaces.mesh
        self.tables = tables
        self._local: dict[tuple[str, int], tuple[float, float, float]] = {}
        self._coll: dict[tuple[NodeKind, tuple[int, ...], int, int, int, bool], CollectiveCost] = {}

    # -- local ops ---------------------------------------------------------------------------
    def local_work(self, output_key: str, strategy: int) -> tuple[float, float, float]:
        """(seconds, flops, bytes) per device of one local op (one output of an equation)."""
        hit = self._local.get((output_key, strategy))
        if hit is not None:
            return hit
        info, k = self.tables.info(output_key)
        st = info.strategies[strategy]
        n_out = len(info.result_spaces)
        flops = info.signature.flops / st.split / n_out
        nbytes = 0.0
        rule = rule_for(info.signature.name)
        if rule.writes_slot:  # each iteration writes its own slot: the operand's bytes
            ops = [sp for sp in info.operand_spaces if sp is not None]
            nbytes = float(self.spaces.shard_bytes(ops[0], st.ins[0]))
        else:
            if not rule.fusible:  # XLA fuses it: its operands stay in registers
                ops = [sp for sp in info.operand_spaces if sp is not None]
                for sp, lid in zip(ops, st.ins, strict=True):
                    nbytes += self.spaces.shard_bytes(sp, lid)
                nbytes /= n_out
            nbytes += self.spaces.shard_bytes(info.result_spaces[k], st.outs[k])
        p = self.profile
        seconds = max(flops / p.flops_per_s, nbytes / p.hbm_bytes_per_s)
        out = (seconds, flops, nbytes)
        self._local[(output_key, strategy)] = out
        return out

    # -- collectives --------------------------------------------------------------------------
    def collective(self, kind: NodeKind, axes: tuple[int, ...], space_id: int, src: int, dst: int,
                   combinable: bool = False) -> CollectiveCost:
        key = (kind, axes, space_id, src, dst, combinable)
        hit = self._coll.get(key)
        if hit is None:
            hit = self._coll[key] = self._collective(kind, axes, space_id, src, dst, combinable)
        return hit

    def _collective(self, kind: NodeKind, axes: tuple[int, ...], space_id: int, src: int, dst: int,
                    combinable: bool) -> CollectiveCost:
        sp = self.spaces.spaces[space_id]
        b_src = self.spaces.shard_bytes(sp, src)
        b_dst = self.spaces.shard_bytes(sp, dst)
        moved_fn = COLLECTIVES[kind].moved
        if moved_fn is None:  # a local copy
            return CollectiveCost(b_dst / self.profile.hbm_bytes_per_s, 0.0, b_dst)
        n = self.mesh.size(axes)
        frac = (n - 1) / n
        moved = moved_fn(frac, b_src, b_dst)
        names = [self.mesh.names[a] for a in axes]
        bw = min(self.profile.link(a) for a in names)
        lat = max(self.profile.latency(a) for a in names)
        if combinable and COLLECTIVES[kind].combines_on(self.profile.combining or self.mesh.platform):
            share = max(b_src, b_dst) / self.profile.combine_threshold_bytes
            lat *= min(1.0, max(share, 1.0 / self.profile.combine_max))
        return CollectiveCost(lat + moved / bw, moved, max(b_src, b_dst))

    # -- all nodes ----------------------------------------------------------------------------
    def node_costs(self, g: ExportedGraph, value_space: list[int], combinable: frozenset[int] = frozenset()) -> np.ndarray:
        """Seconds per e-node. `combinable`: value groups whose collectives XLA can combine."""
        cost = np.zeros(g.num_nodes)
        group_space = g.group_spaces(value_space)
        kinds = g.node_kind.tolist()
        node_class = g.node_class.tolist()
        class_group = g.class_group.tolist()
        class_layout = g.class_layout.tolist()
        na = g.node_a.tolist()
        ptr = g.child_ptr.tolist()
        kids = g.child_idx.tolist()
        unmask: dict[int, tuple[int, ...]] = {}
        # plain ints: comparing list items with an IntEnum, or building NodeKind(kind) per node,
        # was a quarter of this loop on a 900k-node e-graph
        place, local = int(NodeKind.PLACE), int(NodeKind.LOCAL)
        kind_of = {int(k): k for k in NodeKind}
        seconds: dict[tuple[int, int, int, int, int, bool], float] = {}
        for n in range(g.num_nodes):
            kind = kinds[n]
            if kind == place:
                continue
            if kind == local:
                cost[n] = self.local_work(g.node_key[n], na[n])[0]  # type: ignore[arg-type]
            elif kind in RESHARD_CODES:
                c = node_class[n]
                grp = class_group[c]
                key = (kind, na[n], group_space[grp], class_layout[kids[ptr[n]]], class_layout[c], grp in combinable)
                hit = seconds.get(key)
                if hit is None:
                    axes = unmask.get(na[n])
                    if axes is None:
                        axes = unmask[na[n]] = self.mesh.unmask(na[n])
                    hit = seconds[key] = self.collective(kind_of[kind], axes, key[2], key[3], key[4], key[5]).seconds
                cost[n] = hit
            else:
                cost[n] = math.inf  # user constructors need a cost (see shardsat.rules)
        return cost
