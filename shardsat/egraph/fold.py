"""Folding unrolled loops into scans, so deep models plan in the time of one layer.

A Python loop over layers traces to the same run of equations once per layer. `fold` finds such
tandem repeats in the equation sequence (by content key), checks that every repeat reads its
operands the same way (from its own repeat, from the previous repeat = a carry, or from outside:
the same value for all repeats = a constant, or one value per repeat = a scanned input), and
rewrites each run as a scan: per-repeat inputs are stacked (`fold_stack`), the first repeat
becomes the body, per-repeat outputs are unstacked (`fold_unstack`). The rewritten program
computes the same function; the runtime executes it with `lax.scan`.

Members of a stacked input (layer 0..L-1's weight) and of an unstacked output are aliases of
their first member: they take its layout, so the e-graph holds one of them, not L.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from jax.extend import core as jcore

from .keys import program_key
from .program import (
    SCAN_FINAL,
    SCAN_SLICE,
    SCAN_STACK,
    Atom,
    Equation,
    Literal,
    Program,
    ScanRegion,
    ValueInfo,
)

FOLD_STACK = jcore.Primitive("fold_stack")  # r values of one role -> [r, ...]
FOLD_UNSTACK = jcore.Primitive("fold_unstack")  # [r, ...] -> r values
FOLD_UNSTACK.multiple_results = True
FOLD_PSEUDO = frozenset({"fold_stack", "fold_unstack"})

MIN_REPEATS = 2


@dataclass(frozen=True)
class Run:
    start: int
    period: int
    repeats: int

    def index(self, j: int, t: int) -> int:
        return self.start + j * self.period + t


@dataclass
class Slot:
    kind: str  # "int", "carry", "const", "xs", "lit"
    src: tuple[int, int] | None = None  # (offset, output) for int / carry
    values: list[int] = field(default_factory=list)  # outer values (const: one; xs: one per repeat)


def find_runs(keys: list[str], max_candidates: int = 64) -> list[Run]:
    """Greedy tandem repeats of the key sequence, longest coverage first at each position."""
    ids: dict[str, int] = {}
    seq = [ids.setdefault(k, len(ids)) for k in keys]
    n = len(seq)
    base, mod = 1_000_003, (1 << 61) - 1
    pre = [0] * (n + 1)
    pw = [1] * (n + 1)
    for i, x in enumerate(seq):
        pre[i + 1] = (pre[i] * base + x + 1) % mod
        pw[i + 1] = pw[i] * base % mod

    def h(a: int, length: int) -> int:
        return (pre[a + length] - pre[a] * pw[length]) % mod

    where: dict[int, list[int]] = {}
    for i, x in enumerate(seq):
        where.setdefault(x, []).append(i)
    nxt_pos: dict[int, int] = {}
    runs: list[Run] = []
    i = 0
    while i < n:
        occ = where[seq[i]]
        k = nxt_pos.get(seq[i], 0)
        while k < len(occ) and occ[k] <= i:
            k += 1
        nxt_pos[seq[i]] = k
        best: tuple[int, int] | None = None
        for j in occ[k:k + max_candidates]:
            period = j - i
            if i + 2 * period > n:
                break
            r = 1
            while i + (r + 1) * period <= n and h(i, period) == h(i + r * period, period):
                r += 1
            if r >= MIN_REPEATS and (best is None or period * r > best[0] * best[1]):
                best = (period, r)
        if best is not None:
            runs.append(Run(i, best[0], best[1]))
            i += best[0] * best[1]
        else:
            i += 1
    return runs


def _classify(prog: Program, run: Run) -> dict[tuple[int, int], Slot] | None:
    """How each operand of the body reads its value in every repeat; None if repeats differ."""
    lo, hi = run.start, run.start + run.repeats * run.period
    slots: dict[tuple[int, int], Slot] = {}
    for t in range(run.period):
        n_in = len(prog.equations[run.index(0, t)].inputs)
        for q in range(n_in):
            kinds = []
            for j in range(run.repeats):
                a = prog.equations[run.index(j, t)].inputs[q]
                if isinstance(a, Literal):
                    kinds.append(("lit", None, a))
                    continue
                p = prog.values[a].producer
                if p is not None and lo <= p < hi:
                    jj, tt = divmod(p - lo, run.period)
                    src = (tt, prog.values[a].output_index)
                    if jj == j:
                        kinds.append(("int", src, a))
                    elif jj == j - 1:
                        kinds.append(("carry", src, a))
                    else:
                        return None
                else:
                    kinds.append(("out", None, a))
            first = kinds[0]
            if all(k[0] == "lit" for k in kinds):
                slots[(t, q)] = Slot("lit")
            elif all(k[0] == "int" and k[1] == first[1] for k in kinds):
                slots[(t, q)] = Slot("int", first[1])
            elif first[0] == "out" and all(k[0] == "carry" and k[1] == kinds[1][1] for k in kinds[1:]):
                slots[(t, q)] = Slot("carry", kinds[1][1], [first[2]])
            elif all(k[0] == "out" for k in kinds):
                vals = [k[2] for k in kinds]
                slots[(t, q)] = Slot("const", None, [vals[0]]) if len(set(vals)) == 1 else Slot("xs", None, vals)
            else:
                return None
    return slots


def fold(prog: Program) -> Program:
    """The program with its unrolled loops rewritten as scans (unchanged if there are none)."""
    if prog.scans or len(prog.equations) < 2 * MIN_REPEATS:
        return prog
    keys = [program_key(prog, e) for e in prog.equations]
    runs = []
    for run in find_runs(keys):
        slots = _classify(prog, run)
        if slots is not None and _check_carries(slots) and run.period * run.repeats >= 8:
            runs.append((run, slots))
    if not runs:
        return prog
    return _rewrite(prog, runs)


def _check_carries(slots: dict[tuple[int, int], Slot]) -> bool:
    """Every slot that carries one value must start from the same outside value."""
    init: dict[tuple[int, int], int] = {}
    for slot in slots.values():
        if slot.kind == "carry" and init.setdefault(slot.src, slot.values[0]) != slot.values[0]:  # type: ignore[arg-type]
            return False
    return True


def _rewrite(prog: Program, runs: list[tuple[Run, dict[tuple[int, int], Slot]]]) -> Program:
    values = list(prog.values)
    equations: list[Equation] = []
    scans: list[ScanRegion] = []
    carries: list[int] = []
    aliases: dict[int, int] = dict(prog.aliases)

    def root(v: int) -> int:
        while v in aliases:
            v = aliases[v]
        return v

    def new_value(like: int, shape: tuple[int, ...] | None = None, region: int | None = None,
                  carry: tuple[int, int] | None = None) -> int:
        v = values[like]
        vid = len(values)
        values.append(ValueInfo(vid, shape if shape is not None else v.shape, v.dtype, region=region, carry=carry))
        return vid

    def emit(prim: Any, params: dict[str, Any], ins: list[Atom], outs: list[int], source: str, scope: str,
             region: int | None) -> None:
        idx = len(equations)
        for k, o in enumerate(outs):
            values[o] = replace(values[o], producer=idx, output_index=k, region=region)
        equations.append(Equation(idx, prim, params, tuple(ins), tuple(outs), source, scope, region))

    consumers: dict[int, set[int]] = {}
    for e in prog.equations:
        for a in e.inputs:
            if isinstance(a, int):
                consumers.setdefault(a, set()).add(e.index)
    outputs = {o for o in prog.outputs if isinstance(o, int)}

    run_at = {run.start: (run, slots) for run, slots in runs}
    i = 0
    while i < len(prog.equations):
        if i not in run_at:
            e = prog.equations[i]
            emit(e.primitive, e.params, list(e.inputs), list(e.outputs), e.source, e.scope, None)
            equations[-1].key = e.key
            i += 1
            continue
        run, slots = run_at[i]
        lo, hi = run.start, run.start + run.period * run.repeats
        s = len(scans)
        first = prog.equations[lo]
        src, scope = first.source, first.scope
        reg = ScanRegion(index=s, length=run.repeats, reverse=False, parent=None, multiplicity=run.repeats,
                         init=[], carry_in=[], carry_out=[], final=[], xs=[], slices=[], ys=[], stacked=[],
                         params={"length": run.repeats, "reverse": False, "unroll": 1})
        scans.append(reg)
        body_of: dict[tuple[int, int], int] = {}
        carry_of: dict[tuple[int, int], int] = {}
        slice_of: dict[tuple[int, ...], int] = {}
        for (_, _), slot in sorted(slots.items()):
            if slot.kind != "xs" or tuple(slot.values) in slice_of:
                continue
            members = slot.values
            stacked = new_value(members[0], shape=(run.repeats, *values[members[0]].shape))
            # layer weights (arguments) of one role share a layout: the e-graph sees the first;
            # members produced by different equations each keep their own production
            same = all(values[m].arg is not None for m in members) or len({root(m) for m in members}) == 1
            emit(FOLD_STACK, {"fold": s, "aliased": same}, list(members), [stacked], src, scope, None)
            if same:
                for m in members[1:]:
                    if root(m) != root(members[0]):
                        aliases[root(m)] = root(members[0])
            sl = new_value(members[0], region=s)
            emit(SCAN_SLICE, {"scan": s}, [stacked], [sl], src, scope, s)
            reg.xs.append(stacked)
            reg.slices.append(sl)
            slice_of[tuple(members)] = sl
        for (_, _), slot in sorted(slots.items()):
            if slot.kind != "carry" or slot.src in carry_of:
                continue
            tt, k = slot.src  # type: ignore[misc]
            like = prog.equations[run.index(0, tt)].outputs[k]
            cin = new_value(like, region=s, carry=(s, len(reg.carry_in)))
            carry_of[slot.src] = cin  # type: ignore[index]
            reg.carry_in.append(cin)
            reg.init.append(slot.values[0])
            carries.append(cin)
        for t in range(run.period):
            e = prog.equations[run.index(0, t)]
            ins: list[Atom] = []
            for q, a in enumerate(e.inputs):
                slot = slots[(t, q)]
                if slot.kind == "int":
                    ins.append(body_of[slot.src])  # type: ignore[index]
                elif slot.kind == "carry":
                    ins.append(carry_of[slot.src])  # type: ignore[index]
                elif slot.kind == "xs":
                    ins.append(slice_of[tuple(slot.values)])
                else:
                    ins.append(a)
            outs = []
            for k, o in enumerate(e.outputs):
                body_of[(t, k)] = new_value(o, region=s)
                outs.append(body_of[(t, k)])
            emit(e.primitive, e.params, ins, outs, e.source, e.scope, s)
            equations[-1].key = e.key  # same function of same-typed operands
        reg.carry_out = [body_of[key] for key in carry_of]
        finals: dict[int, int] = {}
        for t in range(run.period):
            for k in range(len(prog.equations[run.index(0, t)].outputs)):
                members = [prog.equations[run.index(j, t)].outputs[k] for j in range(run.repeats)]
                outside = [m for m in members
                           if m in outputs or any(c < lo or c >= hi for c in consumers.get(m, ()))]
                if not outside:
                    continue
                if (t, k) in carry_of and outside == [members[-1]]:
                    ci = list(carry_of).index((t, k))
                    emit(SCAN_FINAL, {"scan": s}, [reg.carry_out[ci]], [members[-1]], src, scope, None)
                    finals[ci] = members[-1]
                    continue
                stacked = new_value(members[0], shape=(run.repeats, *values[members[0]].shape))
                reg.ys.append(body_of[(t, k)])
                emit(SCAN_STACK, {"scan": s}, [body_of[(t, k)]], [stacked], src, scope, None)
                reg.stacked.append(stacked)
                emit(FOLD_UNSTACK, {"fold": s}, [stacked], list(members), src, scope, None)
                for m in members[1:]:
                    aliases[m] = members[0]
        for ci in range(len(reg.carry_in)):  # the scan returns every carry
            if ci not in finals:
                fin = new_value(reg.carry_out[ci])
                emit(SCAN_FINAL, {"scan": s}, [reg.carry_out[ci]], [fin], src, scope, None)
                finals[ci] = fin
        reg.final = [finals[ci] for ci in range(len(reg.carry_in))]
        i = hi
    return Program(
        values=values, equations=equations, args=prog.args, consts=prog.consts, const_values=prog.const_values,
        outputs=prog.outputs, in_tree=prog.in_tree, out_tree=prog.out_tree, arg_paths=prog.arg_paths,
        out_paths=prog.out_paths, arg_counts=prog.arg_counts, name=prog.name, scans=scans, carries=carries,
        aliases=aliases,
    )


def planned_inputs(eqn: Equation) -> tuple[Atom, ...]:
    """The operands the e-graph sees: a stack of aliased members is planned through its first."""
    if eqn.name == "fold_stack" and eqn.params.get("aliased"):
        return eqn.inputs[:1]
    return eqn.inputs
