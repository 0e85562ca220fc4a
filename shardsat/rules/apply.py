"""The rules stage: signatures -> strategy tables -> egglog rewrites, then saturation.

Equations with the same primitive, params, operand types and literals share one *key* (and one
set of strategy rows), so repeated layers cost nothing extra to describe and identical values
hash-cons into one e-class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from egglog import Ruleset

from ..egraph.collectives import COLLECTIVES, NodeKind, row_params
from ..egraph.keys import equation_key, operand_types
from ..egraph.layout import MeshAxes, Space, SpaceTable, constrained_spec, spec_to_layout
from ..egraph.program import Equation, Literal, Program
from ..egraph.run import EGraphRun, SaturationReport
from ..errors import InvalidArgumentError, InvalidSignatureError, UnsupportedPrimitiveError
from ..limits import Limits
from . import custom, generic
from .primitives import EqnTypes, replicated
from .registry import rule_for
from .reshard import ReshardEdge, reshard_edges
from .signature import FactorSignature
from .strategies import Strategy, enumerate_strategies, structure_key


@dataclass
class KeyInfo:
    """Everything the later stages need about one equation kind."""

    key: str
    eqn: int  # a representative equation
    signature: FactorSignature
    strategies: list[Strategy]
    operand_spaces: tuple[Space | None, ...]
    result_spaces: tuple[Space, ...]
    fallback: bool = False
    why: str | None = None  # why it fell back
    # over narrowed spaces: the kind over the whole spaces, and each strategy's index there
    whole_key: str | None = None
    whole_index: tuple[int, ...] = ()


@dataclass(frozen=True)
class Fallback:
    """An equation kept replicated because no sharding rule applies to it."""

    eqn: int
    primitive: str
    source: str
    reason: str

    def __str__(self) -> str:
        return f"{self.primitive} at {self.source}"


@dataclass
class RuleTables:
    keys: dict[str, KeyInfo] = field(default_factory=dict)  # content key -> info
    output_key: dict[int, str] = field(default_factory=dict)  # value id -> "key#output"
    edges: dict[int, list[ReshardEdge]] = field(default_factory=dict)  # space id -> edges
    fallbacks: list[Fallback] = field(default_factory=list)

    def info(self, output_key: str) -> tuple[KeyInfo, int]:
        base, _, idx = output_key.rpartition("#")
        return self.keys[base], int(idx)

    def whole(self, output_key: str, strategy: int) -> tuple[str, int]:
        """The output key and strategy index a local op has in the whole spaces' tables (what a
        saved plan records: loading rebuilds those)."""
        info, k = self.info(output_key)
        if info.whole_key is None:
            return output_key, strategy
        return f"{info.whole_key}#{k}", info.whole_index[strategy]


def _eqn_types(prog: Program, eqn: Equation) -> EqnTypes:
    in_shapes, in_dtypes, lits, litv = operand_types(prog, eqn.inputs)
    outs = [prog.values[o] for o in eqn.outputs]
    return EqnTypes(
        name=eqn.name,
        params=eqn.params,
        in_shapes=tuple(in_shapes),
        in_dtypes=tuple(in_dtypes),
        out_shapes=tuple(v.shape for v in outs),
        out_dtypes=tuple(v.dtype for v in outs),
        literal=tuple(lits),
        literal_values=tuple(litv),
    )


def _content_key(eqn: Equation, t: EqnTypes) -> str:
    if eqn.key is not None:
        return eqn.key
    eqn.key = equation_key(eqn, t.in_shapes, t.in_dtypes, t.out_shapes, t.out_dtypes, t.literal, t.literal_values)
    return eqn.key


def signature_for(eqn: Equation, t: EqnTypes, fallback: str) -> tuple[FactorSignature, str | None]:
    """The equation's signature, or (with fallback "replicate") the replicated one and why."""
    if any(0 in shape for shape in (*t.in_shapes, *t.out_shapes)):
        return replicated(t), None  # an array with no elements: nothing worth sharding
    rule = rule_for(eqn.primitive)
    builder, reason = (None if rule.builder is None else rule.signature), rule.unsupported
    if eqn.name == custom.PRIMITIVE:  # rules are per function, not per primitive
        builder, reason = custom.builder_for(eqn.params, builder)
    if builder is not None:
        try:
            return builder(t), None
        except Exception as e:  # a rule that fails on these operands is a missing rule
            reason = f"its sharding rule does not apply to these operands: {type(e).__name__}: {e}"
    if fallback == "replicate":
        return replicated(t), reason or "no sharding rule"
    raise UnsupportedPrimitiveError(eqn.name, eqn.source, reason)


def _key_info(key: str, eqn: Equation, t: EqnTypes, op_spaces: tuple[Space | None, ...],
              res_spaces: tuple[Space, ...], spaces: SpaceTable, fallback: str,
              seen: dict[tuple[object, ...], list[Strategy]]) -> KeyInfo:
    """Signature and strategies of one equation kind; a rule that fails while its strategies are
    enumerated falls back like one that fails to build. `seen`: strategies by signature structure
    and spaces (an add and a mul of the same shapes have the same ones)."""
    sig, why = signature_for(eqn, t, fallback)

    def strategies_of(sig: FactorSignature) -> list[Strategy]:
        skey = structure_key(sig, op_spaces, res_spaces)
        hit = seen.get(skey)
        if hit is None:
            hit = seen[skey] = enumerate_strategies(sig, spaces.mesh, spaces, op_spaces, res_spaces)
        return hit

    try:
        strategies = strategies_of(sig)
    except Exception as e:
        if fallback != "replicate" or why is not None:
            raise
        sig, why = replicated(t), f"its sharding rule does not apply to these operands: {type(e).__name__}: {e}"
        strategies = strategies_of(sig)
    return KeyInfo(key, eqn.index, sig, strategies, op_spaces, res_spaces, why is not None, why)


def _constraint_filter(eqn: Equation, pin: str, info: KeyInfo, spaces: SpaceTable, problems: list[str]) -> None:
    """A with_sharding_constraint / reshard inside the user's function (its param `pin` holds the
    sharding) is a hard pin: keep only the strategies that give its result the constrained
    layout (unconstrained dims stay free)."""
    sharding = eqn.params.get(pin)
    spec = getattr(sharding, "spec", sharding)
    if spec is None:
        return
    shape = info.result_spaces[0].shape
    free = set(eqn.params.get("unconstrained_dims") or ())
    spec = constrained_spec(spec, len(shape), free)
    want, why = spec_to_layout(spec, shape, spaces.mesh)
    if want is None:
        problems.append(f"  * with_sharding_constraint at {eqn.source}: shape {shape}, spec {spec}: {why}")
        info.strategies = []
        return

    def ok(lid: int) -> bool:
        lay = spaces.layouts[lid]
        return not lay.partial and all(
            d in free or lay.dims[d] == want.dims[d] for d in range(len(shape)))

    info.strategies = [st for st in info.strategies if ok(st.outs[0])]


def build_tables(prog: Program, spaces: SpaceTable, fallback: str, base: dict[str, KeyInfo] | None = None,
                 edges: bool = True) -> RuleTables:
    """The strategy rows of every equation kind and the resharding rows of every space in use.
    Where a prior narrowed values' spaces, an equation kind is also keyed by its spaces, and its
    strategies are those of the whole spaces' kind (from `base`, if given) whose layouts remain."""
    mesh: MeshAxes = spaces.mesh
    tables = RuleTables()
    problems: list[str] = []
    whole: dict[str, KeyInfo] = dict(base or {})
    seen: dict[tuple[object, ...], list[Strategy]] = {}
    value_space = [spaces.of_value(vid, v.shape, v.dtype) for vid, v in enumerate(prog.values)]
    for eqn in prog.equations:
        t = _eqn_types(prog, eqn)
        content = _content_key(eqn, t)
        op_spaces = tuple(None if isinstance(a, Literal) else value_space[a] for a in eqn.inputs)
        res_spaces = tuple(value_space[o] for o in eqn.outputs)
        narrowed = bool(spaces.value_spaces) and any(sp is not None and sp.id != spaces.space(sp.shape, sp.dtype).id
                                                     for sp in op_spaces + res_spaces)
        key = content + "@" + ",".join("-" if sp is None else str(sp.id) for sp in op_spaces + res_spaces) \
            if narrowed else content
        info = tables.keys.get(key)
        if info is None:
            info = whole.get(content)
            if info is None:
                info = _whole_info(content, eqn, t, prog, spaces, fallback, problems, seen)
                whole[content] = info
            if narrowed:
                info = _narrowed_info(key, info, op_spaces, res_spaces)
            tables.keys[key] = info
        if info.fallback:
            tables.fallbacks.append(Fallback(eqn.index, eqn.name, eqn.source, info.why or ""))
        for k, out in enumerate(eqn.outputs):
            tables.output_key[out] = f"{key}#{k}"
    if problems:
        names = ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes, strict=True))
        raise InvalidArgumentError(
            f"Sharding constraints inside `{prog.name}` cannot hold on mesh ({names}):\n" + "\n".join(problems)
            + "\nConsider specs whose axes divide the constrained dimensions, in mesh order."
        )
    if edges:
        used = {sp.id for sp in value_space} if spaces.value_spaces else None
        for sp in list(spaces.spaces):
            if used is None or sp.id in used:
                tables.edges[sp.id] = reshard_edges(sp, spaces)
    return tables


def _whole_info(key: str, eqn: Equation, t: EqnTypes, prog: Program, spaces: SpaceTable, fallback: str,
                problems: list[str], seen: dict[tuple[object, ...], list[Strategy]]) -> KeyInfo:
    """An equation kind over the whole spaces of its operand and result types."""
    op_spaces = tuple(None if isinstance(a, Literal) else spaces.space(prog.values[a].shape, prog.values[a].dtype)
                      for a in eqn.inputs)
    res_spaces = tuple(spaces.space(prog.values[o].shape, prog.values[o].dtype) for o in eqn.outputs)
    info = _key_info(key, eqn, t, op_spaces, res_spaces, spaces, fallback, seen)
    pin = rule_for(eqn.primitive).pin
    if pin is not None:
        if pin not in eqn.params:  # the runtime would return the operand for an op that computes
            raise InvalidSignatureError(
                f"`{eqn.primitive}` at {eqn.source} is registered with pin={pin!r}, but it has no param {pin!r} (its "
                f"params: {sorted(eqn.params)}). A pin is an op that returns its operand as it is, placed by that "
                "param's sharding; the plan would skip it. Consider register_signature(...) without pin=.")
        _constraint_filter(eqn, pin, info, spaces, problems)
    return info


def _narrowed_info(key: str, info: KeyInfo, op_spaces: tuple[Space | None, ...],
                   res_spaces: tuple[Space, ...]) -> KeyInfo:
    """The strategies of `info` whose operand and result layouts the narrowed spaces hold."""
    ins = [frozenset(sp.layouts) for sp in op_spaces if sp is not None]
    outs = [frozenset(sp.layouts) for sp in res_spaces]
    kept = [i for i, st in enumerate(info.strategies)
            if all(lid in m for lid, m in zip(st.ins, ins, strict=True))
            and all(lid in m for lid, m in zip(st.outs, outs, strict=True))]
    return replace(info, key=key, strategies=[info.strategies[i] for i in kept], operand_spaces=op_spaces,
                   result_spaces=res_spaces, whole_key=info.key, whole_index=tuple(kept))


def load_tables(run: EGraphRun, tables: RuleTables) -> None:
    mesh = run.spaces.mesh
    strat, strat_in, strat_n = [], [], []
    for key, info in tables.keys.items():
        n_out = len(info.result_spaces)
        n_in = sum(sp is not None for sp in info.operand_spaces)
        for k in range(n_out):
            okey = f"{key}#{k}"
            strat_n.append((okey, n_in))
            for s, st in enumerate(info.strategies):
                strat.append((okey, s, st.outs[k]))
                strat_in.extend((okey, s, pos, lid) for pos, lid in enumerate(st.ins))
    run.load(generic.StratT, strat)
    run.load(generic.StratInT, strat_in)
    run.load(generic.StratNT, strat_n)
    rows: dict[NodeKind, list[tuple[int, ...]]] = {k: [] for k in COLLECTIVES}
    for sp, edges in tables.edges.items():
        for e in edges:
            kind = COLLECTIVES[e.kind]
            rows[e.kind].append((sp, e.src, *row_params(kind, mesh.mask(e.axes), e.dim, e.dim2), e.dst))
    for k, kind in COLLECTIVES.items():
        run.load(kind.table, rows[k])


def grow(
    run: EGraphRun,
    *,
    fallback: str,
    limits: Limits,
    deadline: float,
    extra: Sequence[Ruleset] = (),
    on_iteration: Any = None,
    base: dict[str, KeyInfo] | None = None,
) -> tuple[RuleTables, SaturationReport]:
    """Compute the rule tables of the program (from `base`'s, the whole spaces' equation kinds,
    where given), load them, and saturate."""
    import time

    t0 = time.perf_counter()
    tables = build_tables(run.program, run.spaces, fallback, base)
    run.load_program(lambda vid: tables.output_key[vid])
    load_tables(run, tables)
    load_s = time.perf_counter() - t0
    report = run.saturate([generic.local_rules, generic.reshard_rules, *extra], limits, deadline, on_iteration)
    report.load_seconds = load_s
    return tables, report
