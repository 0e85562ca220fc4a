"""A plan as a record: what extraction chose, in terms that outlive the e-graph.

A Plan lowers and explains itself from the program, the rule tables and, of the e-graph and the
extraction, only the choices: per value e-class its producing e-node (kind, equation key,
strategy), the layout it yields and the resharding steps to the layouts its consumers need. Those
choices are saved as JSON and restored onto a fresh trace of the same program: the tables are
rebuilt (cheap, no saturation) and the e-graph is replaced by one node per chosen e-class.

Layouts are written by mesh axis names, so a record does not depend on the order in which a
process interned them. Strategies are saved by index and checked against their result layout on
restore: a record written by a shardsat whose rules enumerate strategies differently is refused,
not misread.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from ..egraph.export import ExportedGraph, NodeKind
from ..egraph.fingerprint import Fingerprint
from ..egraph.layout import Layout, MeshAxes, SpaceTable
from ..egraph.program import Program
from ..errors import ShardsatError
from ..extract.result import Bound, Extraction, GroupChoice, ReshardStep
from ..limits import StopReason
from ..rules.apply import RuleTables

if TYPE_CHECKING:
    from .plan import Plan, Report

RECORD_VERSION = 1
_EXTRACTION_META = ("total_s", "method", "seconds", "sweeps", "notes", "gap", "lower_bound_s", "exact_status")


@dataclass(frozen=True)
class Origin:
    """Where a plan's program came from, for saving it: the traced program's fingerprint, and
    what was done to it before planning (folding, rewrites by name)."""

    fingerprint: Fingerprint
    folded: bool
    rewrites: tuple[str, ...] = ()
    options_key: str | None = None  # the cache key of the options it was planned with (cache_dir)


class _Layouts:
    """Layouts of a record, numbered in order of first use and written by axis names."""

    def __init__(self, layouts: list[Layout], axes: MeshAxes) -> None:
        self.layouts, self.axes = layouts, axes
        self.index: dict[int, int] = {}

    def __call__(self, lid: int | None) -> int | None:
        if lid is None:
            return None
        return self.index.setdefault(lid, len(self.index))

    def table(self) -> list[list[Any]]:
        out = []
        for lid in self.index:  # insertion order: the local index
            lay = self.layouts[lid]
            out.append([[[self.axes.names[a] for a in d] for d in lay.dims], [self.axes.names[a] for a in lay.partial]])
        return out


def decisions(plan: Plan) -> dict[str, Any]:
    """The plan's choices (no timings): what every process of a multi-host job must agree on,
    and the part of a saved plan its fingerprint covers."""
    lay = _Layouts(plan.layouts, plan.axes)
    out = _decisions(plan, lay)
    out["layouts"] = lay.table()
    return out


def _decisions(plan: Plan, lay: _Layouts) -> dict[str, Any]:
    ex, g = plan.extraction, plan.graph
    names = plan.axes.names
    choices = []
    for grp in sorted(ex.choices):
        ch = ex.choices[grp]
        steps = [[int(s.kind), lay(s.src), lay(s.dst), [names[a] for a in s.axes], s.dim, s.dim2] for s in ch.steps]
        key, a = g.node_key[ch.node], int(g.node_a[ch.node])
        if g.node_kind[ch.node] == NodeKind.LOCAL:  # a narrowed kind's, as the whole spaces' tables have it
            key, a = plan.tables.whole(key, a)
        choices.append([grp, int(g.node_kind[ch.node]), key, a, lay(ch.layout),
                        [lay(d) for d in ch.demanded], ch.weight, steps])
    return {
        "groups": [list(map(int, vs)) for vs in g.group_values],
        "choices": choices,
        "roots": [lay(r) for r in ex.root_layouts],
        "carry": [[int(v), lay(lid)] for v, lid in sorted(ex.carry_layouts.items())],
        "arg_pins": [[pos, sorted(lay(x) for x in lids)] for pos, lids in sorted(plan.arg_pins.items())],
        "ties": [list(t) for t in plan.ties],
        "state_argnums": list(plan.state_argnums),
    }


def digest(dec: dict[str, Any]) -> str:
    """sha256 of a plan's decisions (decisions()), as canonical JSON."""
    return hashlib.sha256(json.dumps(dec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def record(plan: Plan) -> tuple[dict[str, Any], str]:
    """decisions() plus what restoring needs beyond them: per-node and per-step seconds (the
    plan's cost without re-pricing), the "next best" alternatives explain() shows, the
    extraction's summary and the search report; and the decisions' digest."""
    ex = plan.extraction
    lay = _Layouts(plan.layouts, plan.axes)
    rec = _decisions(plan, lay)
    plan_digest = digest({**rec, "layouts": lay.table()})
    rec["seconds"] = [[ex.choices[grp].node_seconds, [[s.seconds, s.moved_bytes, s.buffer_bytes]
                                                      for s in ex.choices[grp].steps]] for grp in sorted(ex.choices)]
    rec["alternatives"] = [[grp, lay(lid), extra] for grp, (lid, extra) in sorted(ex.why_not().items())]
    rec["layouts"] = lay.table()
    rec["extraction"] = {k: getattr(ex, k) for k in _EXTRACTION_META}
    bound = plan.report.bound.settle()  # before asdict, which would copy what computes it
    rep = {k: v for k, v in asdict(plan.report).items() if k != "bound"}
    rep.update(stop_reason=plan.report.stop_reason.value, gap=bound.gap, lower_bound_s=bound.lower_bound_s)
    rec["report"] = rep
    return rec, plan_digest


def _layout(entry: list[Any], axes: MeshAxes) -> Layout:
    dims, partial = entry
    try:
        return Layout(tuple(tuple(axes.names.index(n) for n in d) for d in dims),
                      tuple(axes.names.index(n) for n in partial))
    except ValueError as e:
        raise ShardsatError(f"A saved plan names a mesh axis the mesh does not have ({e}). Consider planning "
                            "again for this mesh.") from e


@dataclass
class Restored:
    """What a Plan is built from, read back from a record."""

    graph: ExportedGraph
    extraction: Extraction
    arg_pins: dict[int, frozenset[int]]
    ties: list[tuple[int, int]]
    state_argnums: list[int]


def restore(rec: dict[str, Any], program: Program, spaces: SpaceTable, tables: RuleTables) -> Restored:
    """The record on a fresh trace of its program, with its rule tables rebuilt."""
    lids = [spaces.layouts.intern(_layout(e, spaces.mesh)) for e in rec["layouts"]]

    def lid(i: int | None) -> int | None:
        return None if i is None else lids[i]

    groups = [list(vs) for vs in rec["groups"]]
    if any(v >= len(program.values) for vs in groups for v in vs):
        raise ShardsatError("A saved plan names values the traced program does not have. Consider planning again.")
    choices: dict[int, GroupChoice] = {}
    kinds, keys, params, node_group = [], [], [], []
    for (grp, kind, key, a, layout, demanded, weight, steps), (secs, step_secs) in zip(
            rec["choices"], rec["seconds"], strict=True):
        node = len(kinds)
        kinds.append(kind)
        keys.append(key)
        params.append(a)
        node_group.append(grp)
        rs = [ReshardStep(NodeKind(k), lid(src), lid(dst), tuple(spaces.mesh.names.index(n) for n in ax), dim, dim2,
                          _num(sec), moved, buf)
              for (k, src, dst, ax, dim, dim2), (sec, moved, buf) in zip(steps, step_secs, strict=True)]
        choices[grp] = GroupChoice(grp, node, lid(layout), tuple(lid(d) for d in demanded), rs, _num(secs), weight)
        if kind == NodeKind.LOCAL:
            _check_strategy(tables, key, a, lid(layout))
    graph = _graph(groups, node_group, kinds, keys, params, choices)
    for a in program.aliases:  # folded loop members take their representative's value group
        rep = program.alias(a)
        if rep in graph.value_group:
            graph.value_group[a] = graph.value_group[rep]
    meta = dict(rec["extraction"])
    meta["total_s"] = _num(meta["total_s"])
    bound = Bound(meta.pop("gap", None), meta.pop("lower_bound_s", None))
    ex = Extraction(choices=choices, root_layouts=[lid(r) for r in rec["roots"]], bound=bound, **meta)
    ex.alternatives = {grp: (lid(layout), _num(extra)) for grp, layout, extra in rec["alternatives"]}
    ex.carry_layouts = {v: lid(layout) for v, layout in rec["carry"]}
    return Restored(graph, ex, {pos: frozenset(lid(x) for x in xs) for pos, xs in rec["arg_pins"]},
                    [(a, k) for a, k in rec["ties"]], list(rec["state_argnums"]))


def _num(x: float | None) -> float:
    """JSON has no infinity: the writer stores it as null."""
    return float("inf") if x is None else float(x)


def _check_strategy(tables: RuleTables, key: str, strategy: int, layout: int | None) -> None:
    try:
        info, k = tables.info(key)
        ok = info.strategies[strategy].outs[k] == layout
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise ShardsatError(
            f"A saved plan runs equation {key} with strategy {strategy}, which this shardsat's rules do not "
            "give that layout (the plan was saved by another version, or planned with other rules=). "
            "Consider planning again, with the same rules= as when it was saved.")


def _graph(groups: list[list[int]], node_group: list[int], kinds: list[int], keys: list[str | None],
           params: list[int], choices: dict[int, GroupChoice]) -> ExportedGraph:
    """An e-graph of the chosen nodes only: one class and one node per chosen e-class."""
    n = len(kinds)
    return ExportedGraph(
        class_group=np.asarray(node_group, dtype=np.int32),
        class_layout=np.asarray([choices[g].layout for g in node_group], dtype=np.int32),
        group_values=groups,
        node_class=np.arange(n, dtype=np.int32),
        node_kind=np.asarray(kinds, dtype=np.int8),
        node_key=keys,
        node_a=np.asarray(params, dtype=np.int64),
        node_b=np.zeros(n, dtype=np.int64),
        node_c=np.zeros(n, dtype=np.int64),
        child_ptr=np.zeros(n + 1, dtype=np.int64),
        child_idx=np.zeros(0, dtype=np.int32),
        value_group={v: g for g, vs in enumerate(groups) for v in vs},
    )


def report_from(rep: dict[str, Any], report_cls: type[Report]) -> Report:
    """A saved search report (fields this version does not know are dropped)."""
    known = {f.name for f in fields(report_cls)}
    kw = {k: v for k, v in rep.items() if k in known}
    kw["stop_reason"] = StopReason(kw["stop_reason"])
    return report_cls(**kw, bound=Bound(rep.get("gap"), rep.get("lower_bound_s")))
