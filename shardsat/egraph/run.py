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

# Single-threaded egglog: faster on small graphs and deterministic tie-breaking (egglog-notes.md).
os.environ.setdefault("RAYON_NUM_THREADS", "1")

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
            spaces.space(v.shape, v.dtype).id for v in program.values
        ]
        self.keys: dict[int, str] = {}  # value id -> key of its defining equation output

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
                f.write("\t".join(_cell(c) for c in row))
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


def _cell(c: Any) -> str:
    s = str(int(c)) if isinstance(c, bool | int) else str(c)
    if "\t" in s or "\n" in s or '"' in s:
        raise InvalidArgumentError(f"Table cell {s!r} holds a tab, newline or quote.")
    return s
