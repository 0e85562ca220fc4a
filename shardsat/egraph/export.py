"""Export a saturated e-graph as flat arrays for extraction.

Reads egglog's tables directly (a frozen snapshot) instead of the JSON serializer: no text, no
per-node Python objects beyond one pass. One class per `At(value, layout)`; one node per `Dist`
e-node; local ops' operand lists are resolved to their operand classes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
from egglog import EGraph

from .schema import At, Dist, DList, Val


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
        return NodeKind.ALL_GATHER <= self <= NodeKind.ALL_TO_ALL


_KINDS = {
    Dist.place: NodeKind.PLACE,
    Dist.local: NodeKind.LOCAL,
    Dist.all_gather: NodeKind.ALL_GATHER,
    Dist.dyn_slice: NodeKind.DYN_SLICE,
    Dist.all_reduce: NodeKind.ALL_REDUCE,
    Dist.reduce_scatter: NodeKind.REDUCE_SCATTER,
    Dist.all_to_all: NodeKind.ALL_TO_ALL,
}


@dataclass
class ExportedGraph:
    """The saturated e-graph as arrays. Node parameters: for PLACE `a`=arg position, `b`=layout;
    for LOCAL `key`, `a`=strategy; for collectives `a`=axes mask, `b`=dim, `c`=second dim."""

    class_group: np.ndarray  # int32 [C]: value e-class of each class
    class_layout: np.ndarray  # int32 [C]
    group_values: list[list[int]]  # program value ids in each value e-class
    node_class: np.ndarray  # int32 [N]
    node_kind: np.ndarray  # int8 [N]
    node_key: list[str | None]  # LOCAL: equation key; OTHER: constructor name
    node_a: np.ndarray  # int64 [N]
    node_b: np.ndarray
    node_c: np.ndarray
    child_ptr: np.ndarray  # int64 [N+1] CSR into child_idx
    child_idx: np.ndarray  # int32: child class ids
    value_group: dict[int, int]  # program value id -> group
    unbuilt_nodes: int = 0  # resharding e-nodes left out (export(reshard=False))

    @property
    def num_classes(self) -> int:
        return len(self.class_group)

    @property
    def num_nodes(self) -> int:
        return len(self.node_class)

    @property
    def size(self) -> int:
        """E-nodes of the e-graph, counting any left out: what the search's effort scales with."""
        return len(self.node_class) + self.unbuilt_nodes

    @property
    def num_groups(self) -> int:
        return len(self.group_values)

    def children(self, n: int) -> np.ndarray:
        return self.child_idx[self.child_ptr[n] : self.child_ptr[n + 1]]



def _egg_name(egraph: EGraph, fn: Any) -> str:
    return egraph._callable_to_egg(fn)[1]  # egglog 13.x; isolated here on purpose


def export(egraph: EGraph, reshard: bool = True) -> ExportedGraph:
    """reshard=False counts the resharding e-nodes but leaves them out: the greedy extractor
    prices resharding from the rule tables' layout graph, and they are most of the nodes."""
    raw = egraph._egraph  # the bindings-level e-graph
    frozen = raw.freeze()
    fns = frozen.functions
    to_i64 = raw.value_to_i64

    def rows(fn: Any) -> list[Any]:
        f = fns.get(_egg_name(egraph, fn))
        return [r for r in f.rows if not r.subsumed] if f is not None else []

    # value e-classes
    group_of_val: dict[Any, int] = {}
    group_values: list[list[int]] = []
    value_group: dict[int, int] = {}
    for r in rows(Val.ref):
        g = group_of_val.get(r.output)
        if g is None:
            g = group_of_val[r.output] = len(group_values)
            group_values.append([])
        vid = to_i64(r.inputs[0])
        group_values[g].append(vid)
        value_group[vid] = g
    # layout classes
    class_of_dist: dict[Any, int] = {}
    cg: list[int] = []
    cl: list[int] = []
    for r in rows(At):
        if r.output in class_of_dist:
            continue
        g = group_of_val.get(r.inputs[0])
        if g is None:  # a value with no program name (made by a user rewrite)
            g = group_of_val[r.inputs[0]] = len(group_values)
            group_values.append([])
        class_of_dist[r.output] = len(cg)
        cg.append(g)
        cl.append(to_i64(r.inputs[1]))
    # operand lists
    cons = {r.output: (r.inputs[0], r.inputs[1]) for r in rows(DList.cons)}
    nils = {r.output for r in rows(DList.nil)}

    def resolve(dl: Any) -> list[int] | None:
        """Operand classes of a list, or None while the list is not fully built (a search that
        stopped early)."""
        out = []
        while dl in cons:
            head, dl = cons[dl]
            c = class_of_dist.get(head)
            if c is None:
                return None
            out.append(c)
        return out if dl in nils else None

    node_class: list[int] = []
    node_kind: list[int] = []
    node_key: list[str | None] = []
    na: list[int] = []
    nb: list[int] = []
    nc: list[int] = []
    ptr = [0]
    kids: list[int] = []
    dist_sort = None
    unbuilt = 0
    for fn, kind in _KINDS.items():
        name = _egg_name(egraph, fn)
        f = fns.get(name)
        if f is None:
            continue
        dist_sort = f.output_sort
        if kind.is_reshard and not reshard:
            unbuilt += sum(1 for r in f.rows
                           if not r.subsumed and r.output in class_of_dist and r.inputs[0] in class_of_dist)
            continue
        place, local, code = kind == NodeKind.PLACE, kind == NodeKind.LOCAL, int(kind)  # once per function
        for r in f.rows:
            if r.subsumed:
                continue
            c = class_of_dist.get(r.output)
            if c is None:
                continue
            ins = r.inputs
            key = None
            a = b = cc = 0
            children: list[int] | None = []
            if place:
                a, b = to_i64(ins[0]), to_i64(ins[1])
            elif local:
                key = raw.value_to_string(ins[0])
                a = to_i64(ins[1])
                children = resolve(ins[2])
            else:
                child = class_of_dist.get(ins[0])
                children = None if child is None else [child]
                vals = [to_i64(x) for x in ins[1:]]
                vals += [0] * (3 - len(vals))
                a, b, cc = vals[:3]
            if children is None:
                continue
            node_class.append(c)
            node_kind.append(code)
            node_key.append(key)
            na.append(a)
            nb.append(b)
            nc.append(cc)
            kids.extend(children)
            ptr.append(len(kids))
    # constructors of sort Dist added by user rules
    known = {_egg_name(egraph, fn) for fn in _KINDS}
    for name, f in fns.items():
        if name in known or f.output_sort != dist_sort or f.is_let_binding:
            continue
        if name == _egg_name(egraph, At):
            continue
        for r in f.rows:
            c = class_of_dist.get(r.output)
            if c is None or r.subsumed:
                continue
            children = [class_of_dist[x] for x, s in zip(r.inputs, f.input_sorts, strict=True)
                        if s == dist_sort and x in class_of_dist]
            node_class.append(c)
            node_kind.append(int(NodeKind.OTHER))
            node_key.append(name)
            na.append(0)
            nb.append(0)
            nc.append(0)
            kids.extend(children)
            ptr.append(len(kids))
    return _canonical(ExportedGraph(
        class_group=np.asarray(cg, dtype=np.int32),
        class_layout=np.asarray(cl, dtype=np.int32),
        group_values=group_values,
        node_class=np.asarray(node_class, dtype=np.int32),
        node_kind=np.asarray(node_kind, dtype=np.int8),
        node_key=node_key,
        node_a=np.asarray(na, dtype=np.int64),
        node_b=np.asarray(nb, dtype=np.int64),
        node_c=np.asarray(nc, dtype=np.int64),
        child_ptr=np.asarray(ptr, dtype=np.int64),
        child_idx=np.asarray(kids, dtype=np.int32),
        value_group=value_group,
        unbuilt_nodes=unbuilt,
    ))


def _canonical(g: ExportedGraph) -> ExportedGraph:
    """Renumber groups, classes and nodes in an order that depends only on the program, not on
    egglog's internal ids: extraction's tie-breaking is then the same run to run."""
    group_key = [min(vs) if vs else 1 << 62 for vs in g.group_values]
    gorder = sorted(range(g.num_groups), key=lambda x: (group_key[x], x))
    gnew = np.empty(g.num_groups, dtype=np.int32)
    gnew[gorder] = np.arange(g.num_groups, dtype=np.int32)
    cg = gnew[g.class_group] if g.num_classes else g.class_group
    corder = np.lexsort((g.class_layout, cg)) if g.num_classes else np.arange(0)
    cnew = np.empty(g.num_classes, dtype=np.int32)
    cnew[corder] = np.arange(g.num_classes, dtype=np.int32)
    child_idx = cnew[g.child_idx] if len(g.child_idx) else g.child_idx
    n = g.num_nodes
    nclass = cnew[g.node_class] if n else g.node_class
    # node order: class, kind, key, params, first child (two nodes never tie on all of these)
    names = sorted({k for k in g.node_key if k is not None})
    name_id = {k: i for i, k in enumerate(names)}
    key_id = np.asarray([name_id[k] + 1 if k is not None else 0 for k in g.node_key], dtype=np.int64)
    counts = np.diff(g.child_ptr)
    first_kid = np.where(counts > 0, child_idx[np.minimum(g.child_ptr[:-1], max(len(child_idx) - 1, 0))]
                         if len(child_idx) else -1, -1)
    norder = np.lexsort((first_kid, g.node_c, g.node_b, g.node_a, key_id, g.node_kind, nclass)) if n else np.arange(0)
    lengths = counts[norder]
    new_ptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(new_ptr[-1])
    gather = np.repeat(g.child_ptr[:-1][norder] - new_ptr[:-1], lengths) + np.arange(total)
    flat = child_idx[gather] if total else np.zeros(0, dtype=np.int32)
    ptr = new_ptr
    return ExportedGraph(
        class_group=cg[corder].astype(np.int32),
        class_layout=g.class_layout[corder],
        group_values=[sorted(g.group_values[x]) for x in gorder],
        node_class=nclass[norder].astype(np.int32) if n else nclass,
        node_kind=g.node_kind[norder] if n else g.node_kind,
        node_key=[g.node_key[i] for i in norder],
        node_a=g.node_a[norder] if n else g.node_a,
        node_b=g.node_b[norder] if n else g.node_b,
        node_c=g.node_c[norder] if n else g.node_c,
        child_ptr=np.asarray(ptr, dtype=np.int64),
        child_idx=np.asarray(flat, dtype=np.int32),
        value_group={v: int(gnew[grp]) for v, grp in g.value_group.items()},
        unbuilt_nodes=g.unbuilt_nodes,
    )
