"""Generic partitioning rewrites in egglog, driven by tables.

`local_rules`: for an equation `Val.op(key, args)` and each strategy row of `key`, the class
`At(value, out_layout)` gains `Dist.local(key, s, At(args, in_layouts))`. `reshard_rules`: for each
`At(v, l)` and each resharding row of v's space leaving l, `At(v, l2)` gains the collective (one
rule per kind of `COLLECTIVES`, over that kind's table). The rows come from signatures
(strategies.py) and the mesh (reshard.py); these few rules are all the partitioning logic egglog
runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from egglog import String, eq, function, i64, i64Like, relation, rule, ruleset, union

from ..egraph.collectives import COLLECTIVES
from ..egraph.schema import At, AtList, Dist, LList, SpaceOf, Val, VList

StratT = relation("StratT", String, i64, i64)  # (key, strategy, result layout)
StratInT = relation("StratInT", String, i64, i64, i64)  # (key, strategy, operand position, layout)
StratNT = relation("StratNT", String, i64)  # (key, operand count)


@function(unextractable=True)
def StratIns(key: String, strategy: i64Like, pos: i64Like) -> LList:
    """Operand layouts `pos..` of a strategy, as a list."""


local_rules = ruleset(name="shardsat_local")
reshard_rules = ruleset(name="shardsat_reshard")


@local_rules.register
def _local(key: String, s: i64, lo: i64, n: i64, pos: i64, li: i64, v: Val, args: VList) -> Iterable[Any]:
    yield rule(StratT(key, s, lo), StratNT(key, n), name="strategy-end").then(union(StratIns(key, s, n)).with_(LList.nil()))
    yield rule(StratInT(key, s, pos, li), name="strategy-operand").then(
        union(StratIns(key, s, pos)).with_(LList.cons(li, StratIns(key, s, pos + 1)))
    )
    yield rule(eq(v).to(Val.op(key, args)), StratT(key, s, lo), name="local").then(
        union(At(v, lo)).with_(Dist.local(key, s, AtList(args, StratIns(key, s, 0))))
    )


@reshard_rules.register
def _reshard(d: Dist, v: Val, lay: i64, sp: i64, ax: i64, dim: i64, dim2: i64, dst: i64) -> Iterable[Any]:
    at = eq(d).to(At(v, lay))
    space = eq(sp).to(SpaceOf(v))
    params = {"axes": ax, "dim": dim, "dim2": dim2}
    for kind in COLLECTIVES.values():
        ps = [params[p] for p in kind.params]
        yield rule(at, space, kind.table(sp, lay, *ps, dst), name=kind.name).then(
            union(At(v, dst)).with_(kind.constructor(d, *ps))
        )
