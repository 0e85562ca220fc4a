"""An extraction as the program's equations see it: the layout each value is produced in, the
resharding step that makes each other layout it is read in, which equal values are computed once,
and which strategy each equation runs with. Lowering (runtime/lower.py) and the plan's costing
(extract/plancost.py) both read this, so it is worked out once, here, and not in the Plan."""

from __future__ import annotations

from dataclasses import dataclass

from ..egraph.export import ExportedGraph, NodeKind
from ..egraph.layout import SpaceTable
from ..egraph.program import Equation, Program
from ..errors import ShardsatError
from ..rules.apply import RuleTables
from .result import Extraction, ReshardStep


@dataclass(frozen=True)
class EqnRun:
    """One bind of an equation with one strategy: operand layouts and the outputs it yields."""

    eqn: int
    operand_layouts: tuple[int, ...]  # per non-literal operand
    outputs: tuple[tuple[int, int], ...]  # (output index, produced layout)


@dataclass(frozen=True)
class Assignment:
    produced: dict[int, int]  # value id -> the layout it is produced in
    parent: dict[tuple[int, int], ReshardStep]  # (value id, layout) -> the step that makes it
    canon: dict[int, int]  # value id -> the equal value that computes it
    runs: list[EqnRun]  # in program order
    arg_layouts: list[int | None]  # per flat argument: produced, else its pin's; None: replicated


def assign(program: Program, graph: ExportedGraph, tables: RuleTables, spaces: SpaceTable, ex: Extraction,
           arg_pins: dict[int, frozenset[int]]) -> Assignment:
    produced, parent = _steps(program, graph, ex)
    canon = _canon(program, graph, tables, ex)
    runs = _runs(program, graph, tables, spaces, ex, canon)
    args = [produced.get(vid, pinned_layout(spaces, arg_pins, pos)) for pos, vid in enumerate(program.args)]
    return Assignment(produced, parent, canon, runs, args)


def pinned_layout(spaces: SpaceTable, arg_pins: dict[int, frozenset[int]], pos: int) -> int | None:
    """The layout an argument the plan never reads is passed in: its pin's (of a partial pin,
    the one that splits least)."""
    lays = arg_pins.get(pos)
    if not lays:
        return None
    table = spaces.layouts.layouts
    return min(lays, key=lambda lid: (len(table[lid].used_axes()), lid))


def _steps(prog: Program, g: ExportedGraph, ex: Extraction) -> tuple[dict[int, int],
                                                                       dict[tuple[int, int], ReshardStep]]:
    produced: dict[int, int] = {}
    parent: dict[tuple[int, int], ReshardStep] = {}
    for vid in range(len(prog.values)):
        grp = g.value_group.get(prog.alias(vid))
        if grp is not None and grp in ex.choices:
            produced[vid] = ex.choices[grp].layout
            for step in ex.choices[grp].steps:
                parent[(vid, step.dst)] = step
    # a folded loop's repeats read their carry through the carry input's resharding tree
    for scan in prog.scans:
        for cin, members in scan.members.items():
            grp = g.value_group.get(cin)
            if scan.folded and cin in scan.carry_in and grp in ex.choices:
                for m in members:
                    if isinstance(m, int):
                        for step in ex.choices[grp].steps:
                            parent.setdefault((m, step.dst), step)
    return produced, parent


def _base_key(tables: RuleTables, vid: int) -> str | None:
    key = tables.output_key.get(vid)
    return None if key is None else key.rpartition("#")[0]


def _chosen_base(g: ExportedGraph, ex: Extraction, grp: int) -> str | None:
    ch = ex.choices.get(grp)
    if ch is None or NodeKind(int(g.node_kind[ch.node])) != NodeKind.LOCAL:
        return None
    key = g.node_key[ch.node]
    return None if key is None else key.rpartition("#")[0]


def _chosen_reads(g: ExportedGraph, ex: Extraction, grp: int) -> tuple[int, ...] | None:
    """The value groups the chosen production of `grp` reads, in operand order."""
    ch = ex.choices.get(grp)
    return None if ch is None else tuple(int(g.class_group[c]) for c in g.children(ch.node))


def _operand_groups(prog: Program, g: ExportedGraph, v: int) -> tuple[int, ...] | None:
    """The value groups the equation producing `v` reads (literals left out), as _chosen_reads."""
    eqn = prog.values[v].producer
    if eqn is None:
        return None
    ins = [a for a in prog.equations[eqn].inputs if isinstance(a, int)]
    groups = [g.value_group.get(prog.alias(a)) for a in ins]
    return None if any(x is None for x in groups) else tuple(int(x) for x in groups)  # type: ignore[arg-type]


def _canon(prog: Program, g: ExportedGraph, tables: RuleTables, ex: Extraction) -> dict[int, int]:
    """Values the e-graph proved equal (identical equations, or a rewrite's two sides) are
    computed once, by an equation of the production the plan chose: of its kind, and of those
    the one reading the production's operands (two sides of a rewrite may be equations of one
    kind, `(x @ a) @ b` and `x @ (a @ b)`, and only one reads what the plan computes); only
    within one region: a scan body recomputes per iteration."""
    canon: dict[int, int] = {}
    for grp, vids in enumerate(g.group_values):
        chosen = _chosen_base(g, ex, grp)
        reads = _chosen_reads(g, ex, grp)
        first: dict[int | None, int] = {}
        for v in sorted(vids, key=lambda v: (_base_key(tables, v) != chosen, _operand_groups(prog, g, v) != reads, v)):
            canon[v] = first.setdefault(prog.values[v].region, v)
    for scan in prog.scans:  # a replayed repeat's value is computed once like its body value
        if scan.folded:
            for b, members in scan.members.items():
                cb = canon.get(b, b)
                if cb != b and cb in scan.members:
                    for m, cm in zip(members, scan.members[cb], strict=True):
                        if isinstance(m, int) and isinstance(cm, int):
                            canon[m] = cm
    return canon


def _runs(prog: Program, g: ExportedGraph, tables: RuleTables, spaces: SpaceTable, ex: Extraction,
          canon: dict[int, int]) -> list[EqnRun]:
    runs: list[EqnRun] = []
    done: set[int] = set()
    for eqn in prog.equations:
        # an equal value's own equation computes it (see _canon), or one did already
        if eqn.outputs and all(canon.get(o, o) in done or canon.get(o, o) != o for o in eqn.outputs):
            continue
        if eqn.effects and not eqn.outputs:  # a debug print: run on whole operands
            ins = tuple(spaces.space(prog.values[a].shape, prog.values[a].dtype).layouts[0]
                        for a in eqn.inputs if isinstance(a, int))
            runs.append(EqnRun(eqn.index, ins, ()))
            continue
        by_strategy = _strategies(g, tables, ex, eqn)
        info, _ = tables.info(tables.output_key[eqn.outputs[0]]) if eqn.outputs else (None, 0)
        for s, outs in by_strategy.items():
            st = info.strategies[s]  # type: ignore[union-attr]
            runs.append(EqnRun(eqn.index, st.ins, tuple(outs)))
            done.update(canon.get(eqn.outputs[k], eqn.outputs[k]) for k, _ in outs)
    return runs


def _strategies(g: ExportedGraph, tables: RuleTables, ex: Extraction,
                eqn: Equation) -> dict[int, list[tuple[int, int]]]:
    """The equation's outputs the plan computes with it, by the strategy each is produced with."""
    by_strategy: dict[int, list[tuple[int, int]]] = {}
    for k, out in enumerate(eqn.outputs):
        grp = g.value_group.get(out)
        if grp is None or grp not in ex.choices:
            continue
        node = ex.choices[grp].node
        okey = tables.output_key[out]
        nkey = g.node_key[node]
        if NodeKind(int(g.node_kind[node])) != NodeKind.LOCAL or nkey is None:
            raise ShardsatError(
                f"The plan computes `{eqn.name}` at {eqn.source} by an e-node no equation of the program makes "
                f"({NodeKind(int(g.node_kind[node])).name.lower()}): an egglog ruleset in rules= made two different "
                "values equal, or a term no equation computes. Consider checking the rulesets' rules (a "
                "shardsat.Rewrite states an identity that check_rule can test).")
        if nkey.rpartition("#")[0] != okey.rpartition("#")[0]:
            if any(_base_key(tables, v) == nkey.rpartition("#")[0] for v in g.group_values[grp]):
                continue  # an equal value's equation (the other side of a rewrite) computes it
            raise ShardsatError(
                f"The plan computes `{eqn.name}` at {eqn.source} through a rewritten term "
                f"({nkey}) that no equation of the program computes; write the rewrite as a "
                f"shardsat.Rewrite so both sides are equations."
            )
        by_strategy.setdefault(int(g.node_a[node]), []).append((k, ex.choices[grp].layout))
    return by_strategy
