"""Export a saturated e-graph as flat arrays for extraction.

Reads egglog's tables directly (a frozen snapshot) instead of the JSON serializer: no text, no
per-node Python objects beyond one pass. One class per `At(value, layout)`; one node per `Dist`
e-node; local ops' operand lists are resolved to their operand classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from egglog import EGraph

from .collectives import COLLECTIVES, NodeKind
from .schema import At, Dist, DList, Val

_KINDS = {
    Dist.place: NodeKind.PLACE,
    Dist.local: NodeKind.LOCAL,
    **{k.constructor: k.node for k in COLLECTIVES.values()},
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

    def group_spaces(self, value_space: list[int]) -> list[int]:
        """Per value group: the layout space of its values (-1: a group of no program value);
        `value_space`: per program value, as saturation assigned them."""
        return [value_space[vs[0]] if vs else -1 for vs in self.group_values]



def _egg_name(egraph: EGraph, fn: Any) -> str:
    return egraph._callable_to_egg(fn)[1]  # egglog 13.x; isolated here on purpose


class _Snapshot:
    """A frozen view of egglog's tables: every export step reads rows from the same snapshot."""

    def __init__(self, egraph: EGraph) -> None:
        self.egraph = egraph
        self.raw = egraph._egraph  # the bindings-level e-graph
        self.functions = self.raw.freeze().functions
        self.to_i64 = self.raw.value_to_i64

    def name(self, fn: Any) -> str:
        return _egg_name(self.egraph, fn)

    def rows(self, fn: Any) -> list[Any]:
        """The live (not subsumed) rows of a function's table."""
        f = self.functions.get(self.name(fn))
        return [r for r in f.rows if not r.subsumed] if f is not None else []


@dataclass
class _Classes:
    """Value e-classes (groups) and the layout classes `At(value, layout)` in them, keyed by egglog
    value: what every node row is resolved against."""

    group_of_val: dict[Any, int] = field(default_factory=dict)
    group_values: list[list[int]] = field(default_factory=list)  # program value ids per group
    value_group: dict[int, int] = field(default_factory=dict)
    class_of_dist: dict[Any, int] = field(default_factory=dict)
    class_group: list[int] = field(default_factory=list)
    class_layout: list[int] = field(default_factory=list)

    def group(self, val: Any) -> int:
        """The group of an egglog value, opened on first sight."""
        g = self.group_of_val.get(val)
        if g is None:
            g = self.group_of_val[val] = len(self.group_values)
            self.group_values.append([])
        return g


def _classes(snap: _Snapshot) -> _Classes:
    """Groups from the program's value names, then one class per `At` row."""
    out = _Classes()
    for r in snap.rows(Val.ref):
        g = out.group(r.output)
        vid = snap.to_i64(r.inputs[0])
        out.group_values[g].append(vid)
        out.value_group[vid] = g
    for r in snap.rows(At):
        if r.output in out.class_of_dist:
            continue
        g = out.group(r.inputs[0])  # new for a value with no program name (made by a user rewrite)
        out.class_of_dist[r.output] = len(out.class_group)
        out.class_group.append(g)
        out.class_layout.append(snap.to_i64(r.inputs[1]))
    return out


@dataclass
class _Nodes:
    """The exported e-nodes so far, column by column, with their children in CSR form."""

    node_class: list[int] = field(default_factory=list)
    node_kind: list[int] = field(default_factory=list)
    node_key: list[str | None] = field(default_factory=list)
    a: list[int] = field(default_factory=list)
    b: list[int] = field(default_factory=list)
    c: list[int] = field(default_factory=list)
    ptr: list[int] = field(default_factory=lambda: [0])
    kids: list[int] = field(default_factory=list)

    def add(self, cls: int, kind: int, key: str | None, a: int, b: int, c: int, children: list[int]) -> None:
        self.node_class.append(cls)
        self.node_kind.append(kind)
        self.node_key.append(key)
        self.a.append(a)
        self.b.append(b)
        self.c.append(c)
        self.kids.extend(children)
        self.ptr.append(len(self.kids))


def _operand_lists(snap: _Snapshot, classes: _Classes) -> Callable[[Any], list[int] | None]:
    """A resolver from a `DList` to its operand classes."""
    cons = {r.output: (r.inputs[0], r.inputs[1]) for r in snap.rows(DList.cons)}
    nils = {r.output for r in snap.rows(DList.nil)}

    def resolve(dl: Any) -> list[int] | None:
        """Operand classes of a list, or None while the list is not fully built (a search that
        stopped early)."""
        out = []
        while dl in cons:
            head, dl = cons[dl]
            c = classes.class_of_dist.get(head)
            if c is None:
                return None
            out.append(c)
        return out if dl in nils else None

    return resolve


def _dist_nodes(snap: _Snapshot, classes: _Classes, nodes: _Nodes, reshard: bool) -> tuple[Any, int]:
    """Adds the built-in `Dist` e-nodes; returns the `Dist` sort (None if no such node exists)
    and how many resharding e-nodes were left out."""
    resolve = _operand_lists(snap, classes)
    class_of_dist = classes.class_of_dist
    to_i64 = snap.to_i64
    dist_sort = None
    unbuilt = 0
    for fn, kind in _KINDS.items():
        f = snap.functions.get(snap.name(fn))
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
                key = snap.raw.value_to_string(ins[0])
                a = to_i64(ins[1])
                children = resolve(ins[2])
            else:
                child = class_of_dist.get(ins[0])
                children = None if child is None else [child]
                vals = [to_i64(x) for x in ins[1:]]
                vals += [0] * (3 - len(vals))
                a, b, cc = vals[:3]
            if children is not None:
                nodes.add(c, code, key, a, b, cc, children)
    return dist_sort, unbuilt


def _user_nodes(snap: _Snapshot, classes: _Classes, nodes: _Nodes, dist_sort: Any) -> None:
    """Adds the e-nodes of constructors of sort `Dist` that user rules declared, as OTHER nodes
    keyed by constructor name."""
    class_of_dist = classes.class_of_dist
    known = {snap.name(fn) for fn in _KINDS}
    for name, f in snap.functions.items():
        if name in known or f.output_sort != dist_sort or f.is_let_binding:
            continue
        if name == snap.name(At):
            continue
        for r in f.rows:
            c = class_of_dist.get(r.output)
            if c is None or r.subsumed:
                continue
            children = [class_of_dist[x] for x, s in zip(r.inputs, f.input_sorts, strict=True)
                        if s == dist_sort and x in class_of_dist]
            nodes.add(c, int(NodeKind.OTHER), name, 0, 0, 0, children)


def export(egraph: EGraph, reshard: bool = True) -> ExportedGraph:
    """reshard=False counts the resharding e-nodes but leaves them out: the greedy extractor
    prices resharding from the rule tables' layout graph, and they are most of the nodes."""
    snap = _Snapshot(egraph)
    classes = _classes(snap)
    nodes = _Nodes()
    dist_sort, unbuilt = _dist_nodes(snap, classes, nodes, reshard)
    _user_nodes(snap, classes, nodes, dist_sort)
    return _canonical(ExportedGraph(
        class_group=np.asarray(classes.class_group, dtype=np.int32),
        class_layout=np.asarray(classes.class_layout, dtype=np.int32),
        group_values=classes.group_values,
        node_class=np.asarray(nodes.node_class, dtype=np.int32),
        node_kind=np.asarray(nodes.node_kind, dtype=np.int8),
        node_key=nodes.node_key,
        node_a=np.asarray(nodes.a, dtype=np.int64),
        node_b=np.asarray(nodes.b, dtype=np.int64),
        node_c=np.asarray(nodes.c, dtype=np.int64),
        child_ptr=np.asarray(nodes.ptr, dtype=np.int64),
        child_idx=np.asarray(nodes.kids, dtype=np.int32),
        value_group=classes.value_group,
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
