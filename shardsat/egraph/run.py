"""Build the layout e-graph of a Program in egglog and saturate it under limits.

The program enters as tables (see schema.py); the base ruleset here turns them into `Val` terms,
places inputs and maps `At` over operand lists. Partitioning rules come from the rules stage and
are passed to `saturate`. Saturation is bounded by `Limits` and always ends with a `StopReason`.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from egglog import EGraph, Ruleset, String, i64, rewrite, rule, ruleset, set_, union
from egglog.bindings import EggSmolError

from ..errors import InvalidArgumentError
from ..limits import Limits, StopReason
from .layout import SpaceTable
from .program import Literal, Program
from .schema import (
    ArgsFrom,
    At,
    AtList,
    Dist,
    DList,
    LList,
    PlaceT,
    SpaceOf,
    Val,
    ValArgT,
    ValEqT,
    ValInT,
    ValOpT,
    ValSpaceT,
    VList,
)

base_rules = ruleset(name="shardsat_base")


@base_rules.register
def _base(id: i64, pos: i64, n: i64, a: i64, sp: i64, lay: i64, key: String) -> Iterable[Any]:
    yield rule(ValArgT(id, pos), name="arg").then(union(Val.ref(id)).with_(Val.arg(pos)))
    yield rule(ValOpT(id, key, n), name="op").then(
        union(ArgsFrom(id, n)).with_(VList.nil()),
        union(Val.ref(id)).with_(Val.op(key, ArgsFrom(id, 0))),
    )
    yield rule(ValInT(id, pos, a), name="operand").then(
        union(ArgsFrom(id, pos)).with_(VList.cons(Val.ref(a), ArgsFrom(id, pos + 1)))
    )
    yield rule(ValEqT(id, a), name="equal").then(union(Val.ref(id)).with_(Val.ref(a)))
    yield rule(ValSpaceT(id, sp), name="space").then(set_(SpaceOf(Val.ref(id))).to(sp))
    yield rule(ValArgT(id, pos), ValSpaceT(id, sp), PlaceT(sp, lay), name="place").then(
        union(At(Val.ref(id), lay)).with_(Dist.place(pos, lay))
    )


@base_rules.register
def _at_list(v: Val, vs: VList, lay: i64, ls: LList) -> Iterable[Any]:
    yield rewrite(AtList(VList.cons(v, vs), LList.cons(lay, ls))).to(
        DList.cons(At(v, lay), AtList(vs, ls))
    )
    yield rewrite(AtList(VList.nil(), LList.nil())).to(DList.nil())


@dataclass
class SaturationReport:
    """What one saturation did (egg's run report, per iteration)."""

    iterations: int = 0
    stop_reason: StopReason = StopReason.SATURATED
    seconds: float = 0.0
    load_seconds: float = 0.0
    nodes_per_iteration: list[int] = field(default_factory=list)
    matches_per_rule: dict[str, int] = field(default_factory=dict)
    narrowed: int = 0  # (value, layout) pairs a prior left out before saturation (egraph/narrow.py)

    @property
    def nodes(self) -> int:
        return self.nodes_per_iteration[-1] if self.nodes_per_iteration else 0


class EGraphRun:
    """One e-graph for one program on one mesh."""

    def __init__(self, program: Program, spaces: SpaceTable) -> None:
        self.program = program
        self.spaces = spaces
        self.egraph = EGraph()
        self._tmp = tempfile.TemporaryDirectory(prefix="shardsat-")
        self._loaded = 0
        self.value_space: list[int] = [
            spaces.of_value(vid, v.shape, v.dtype).id for vid, v in enumerate(program.values)
        ]
        self.keys: dict[int, str] = {}  # value id -> key of its defining equation output
        self._ref_ids: set[int] = set()
        self._refs = 0

    def close(self) -> None:
        """Free the e-graph here: egglog's EGraph may only be dropped on the thread that made it,
        and a garbage collection may run on an XLA thread (in a custom_partitioning callback)."""
        self._tmp.cleanup()
        del self.egraph

    # -- loading -------------------------------------------------------------------------------
    def load(self, table: Callable[..., Any], rows: Iterable[Sequence[Any]]) -> int:
        """Bulk-insert rows into a relation (one egglog `input` command)."""
        path = os.path.join(self._tmp.name, f"t{self._loaded}.tsv")
        self._loaded += 1
        n = 0
        with open(path, "w") as f:
            for row in rows:
                line = "\t".join(map(_text, row))
                if line.count("\t") != len(row) - 1 or "\n" in line or '"' in line:
                    raise InvalidArgumentError(f"Table row {row!r} holds a tab, newline or quote.")
                f.write(line)
                f.write("\n")
                n += 1
        if n:
            self.egraph.input(table, path)
        return n

    def load_program(self, key_of: Callable[[int], str]) -> None:
        """Register the program's values and equations. `key_of(value id)` names the equation
        output that defines a non-input value (the rules stage computes keys)."""
        prog = self.program
        args = [(vid, pos) for pos, vid in enumerate(prog.args) if vid not in prog.aliases]
        args += [(vid, len(prog.args) + k) for k, vid in enumerate(prog.const_values)]
        base = len(prog.args) + len(prog.const_values)
        args += [(vid, base + k) for k, vid in enumerate(prog.carries)]  # scan carries: placed, tied
        ops, ins = [], []
        for eqn in prog.equations:
            # values that alias another (folded loop members) are not registered at all
            inputs = eqn.inputs
            operands = [prog.alias(a) for a in inputs if not isinstance(a, Literal)]
            for out in eqn.outputs:
                if out in prog.aliases:
                    continue
                key = key_of(out)
                self.keys[out] = key
                ops.append((out, key, len(operands)))
                ins.extend((out, pos, a) for pos, a in enumerate(operands))
        self.load(ValArgT, args)
        self.load(ValOpT, ops)
        self.load(ValInT, ins)
        # spaces of registered values only: a folded loop's other repeats keep their value ids
        # (members), and a Val for each would be an empty e-class
        registered = sorted({vid for vid, _ in args} | {out for out, _, _ in ops}
                            | {x for pair in prog.equivalences for x in map(prog.alias, pair)})
        self.load(ValSpaceT, ((vid, self.value_space[vid]) for vid in registered))
        self._ref_ids = set(registered)  # the Val.ref ids the program has (a user ruleset may add no other)
        self._refs = len(registered)
        self.load(ValEqT, sorted({(prog.alias(a), prog.alias(b)) for a, b in prog.equivalences
                                  if prog.alias(a) != prog.alias(b)}))
        self.load(
            PlaceT,
            ((sp.id, lid) for sp in self.spaces.spaces for lid in sp.layouts
             if not self.spaces.layouts[lid].partial),
        )

    # -- saturation ----------------------------------------------------------------------------
    def node_count(self) -> int:
        return sum(size for _, size in self.egraph.all_function_sizes())

    def saturate(self, rulesets: Sequence[Ruleset], limits: Limits, deadline: float,
                 on_iteration: Callable[[int, int], None] | None = None) -> SaturationReport:
        """Run the rulesets to saturation or a limit. The built-in rules only grow the e-graph by
        the rule tables, in a few rounds; a user's ruleset may grow it without bound, so with one
        the search also stops before a round its growth says would pass a limit."""
        builtin = [rs for rs in rulesets if _is_builtin(rs)]
        user = [rs for rs in rulesets if not _is_builtin(rs)]
        if user:
            return self._saturate_predicted(builtin, user, limits, deadline, on_iteration)
        report = SaturationReport()
        start = time.perf_counter()
        combined = base_rules
        for rs in rulesets:
            combined = combined | rs
        for it in range(limits.iterations):
            run = self.egraph.run(combined * 1)
            report.iterations = it + 1
            for decl, k in run.num_matches_per_rule.items():
                name = getattr(decl, "name", None) or type(decl).__name__
                report.matches_per_rule[name] = report.matches_per_rule.get(name, 0) + k
            nodes = self.node_count()
            report.nodes_per_iteration.append(nodes)
            if on_iteration is not None:
                on_iteration(it + 1, nodes)
            if not run.updated:
                report.stop_reason = StopReason.SATURATED
                break
            if nodes >= limits.nodes:
                report.stop_reason = StopReason.NODE_LIMIT
                break
            if time.perf_counter() >= deadline:
                report.stop_reason = StopReason.TIME_LIMIT
                break
        else:
            report.stop_reason = StopReason.ITERATION_LIMIT
        report.seconds = time.perf_counter() - start
        return report

    def _saturate_predicted(self, builtin: Sequence[Ruleset], user: Sequence[Ruleset], limits: Limits,
                           deadline: float, on_iteration: Callable[[int, int], None] | None) -> SaturationReport:
        """Rounds of every rule, as without user rules, but before each round the last rounds'
        growth predicts the next (a rule that doubled the e-graph doubles it again): a round that
        would pass the node limit, or end too late to leave time to export the e-graph it makes,
        is not run. Checked only after each round, one round of a fast-growing ruleset overran
        the node limit by 39% and a 2 s time limit by 3.5x (issue 12)."""
        report = SaturationReport()
        start = time.perf_counter()
        combined = base_rules
        for rs in [*builtin, *user]:
            combined = combined | rs
        growth = _Growth()
        nodes = self.node_count()
        stop = StopReason.ITERATION_LIMIT
        for it in range(limits.iterations):
            predicted = growth.stop_before(nodes, limits, deadline)
            if predicted is not None:
                stop = predicted
                break
            t = time.perf_counter()
            run = _run_user(self.egraph, combined, user)
            report.iterations = it + 1
            for decl, m in run.num_matches_per_rule.items():
                name = getattr(decl, "name", None) or type(decl).__name__
                report.matches_per_rule[name] = report.matches_per_rule.get(name, 0) + m
            after = self.node_count()
            growth.record(nodes, after, time.perf_counter() - t)
            nodes = after
            report.nodes_per_iteration.append(nodes)
            if on_iteration is not None:
                on_iteration(it + 1, nodes)
            if not run.updated:
                stop = StopReason.SATURATED
                break
            if nodes >= limits.nodes:
                stop = StopReason.NODE_LIMIT
                break
            if time.perf_counter() >= deadline:
                stop = StopReason.TIME_LIMIT
                break
        report.stop_reason = stop
        self._check_user_terms(user)
        report.seconds = time.perf_counter() - start
        return report

    def _check_user_terms(self, user: Sequence[Ruleset]) -> None:
        """A user ruleset may union terms, add `Val.op` terms (values the program does not name)
        and `Dist` e-nodes; a `Val.ref` of an id the program does not have would be taken for a
        program value by every later stage (it failed with an IndexError far from its cause)."""
        refs = dict(self.egraph.all_function_sizes()).get(Val.ref, 0)
        if refs <= self._refs:
            return
        frozen = self.egraph._egraph.freeze()  # only now: naming the ids needs the table
        f = frozen.functions.get(self.egraph._callable_to_egg(Val.ref)[1])
        made = sorted({int(self.egraph._egraph.value_to_i64(r.inputs[0])) for r in f.rows} - self._ref_ids) if f else []
        names = ", ".join(_ruleset_name(rs) for rs in user)
        raise InvalidArgumentError(
            f"The user ruleset(s) {names} made Val.ref terms for value ids {made[:5]}"
            f"{' ...' if len(made) > 5 else ''} that the program does not have (its values are ids 0.."
            f"{len(self.program.values) - 1}). A ruleset may union existing terms, add Val.op(key, args) terms (new "
            "values) and Dist e-nodes of the built-in kinds (Dist.local, Dist.all_gather, ...) to At(value, layout) "
            "classes; Val.ref(id) names the program's own values only. Consider Val.op for a new value."
        )


EXPORT_S_PER_NODE = 2e-6  # export of a 1.1M-node e-graph a user ruleset grew took 1.65 s (2 cores)


@dataclass
class _Growth:
    """The search's growth so far: what the last two rounds added and how long they took."""

    deltas: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def record(self, before: int, after: int, seconds: float) -> None:
        self.deltas = [*self.deltas[-1:], after - before]
        self.seconds = [*self.seconds[-1:], seconds]

    def stop_before(self, nodes: int, limits: Limits, deadline: float) -> StopReason | None:
        """The limit the next round would pass, predicted from the last ones (its growth is the
        last round's times the ratio of the last two, taken between 1 and 8), or None."""
        if not self.deltas or self.deltas[-1] <= 0:
            return None
        ratio = self.deltas[-1] / self.deltas[0] if len(self.deltas) > 1 and self.deltas[0] > 0 else 1.0
        ratio = min(max(ratio, 1.0), 8.0)
        predicted = nodes + self.deltas[-1] * ratio
        if predicted >= limits.nodes:
            return StopReason.NODE_LIMIT
        if time.perf_counter() + self.seconds[-1] * ratio + EXPORT_S_PER_NODE * predicted > deadline:
            return StopReason.TIME_LIMIT
        return None


def _run_user(egraph: EGraph, combined: Any, user: Sequence[Ruleset]) -> Any:
    """One round with the user's rulesets: egglog's own error (an action's variable the query
    does not bind, a sort mismatch) surfaces when they first run, naming neither them nor the fix."""
    try:
        return egraph.run(combined * 1)
    except EggSmolError as e:
        names = ", ".join(_ruleset_name(rs) for rs in user)
        said = " ".join(str(e).split())
        raise InvalidArgumentError(
            f"egglog could not run the user ruleset(s) {names}: {said}. Consider binding every "
            "variable a rule's actions use in its query (egglog's `_x` is the rule's variable `x`), and checking "
            "the ruleset alone on a small EGraph first."
        ) from e


def _is_builtin(rs: Any) -> bool:
    ident = getattr(rs, "ident", None)
    return ident is not None and str(ident.name).startswith("shardsat_")


def _ruleset_name(rs: Any) -> str:
    ident = getattr(rs, "ident", None)
    return repr(ident.name) if ident is not None else repr(rs)


def _text(c: Any) -> str:
    """A table cell: integers (and bools) as integers, anything else as its text."""
    return str(int(c)) if isinstance(c, bool) else str(c)
