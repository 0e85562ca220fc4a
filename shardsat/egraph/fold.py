"""Folding unrolled loops, so deep models plan in the time of one layer.

A Python loop over layers traces to the same run of equations once per layer. `fold` finds such
tandem repeats in the equation sequence (by content key) and checks that every repeat reads its
operands the same way: from its own repeat, from the previous repeat (a carry), or from outside
(the same value for all repeats, or one value per repeat, such as each layer's weight). Each run
is then planned as a scan body: the first repeat, weighted by the repeat count, its carries tied
like loop-carried state. Every repeat's values alias their body value and each layer's inputs of
one role alias each other, so the e-graph holds one body, not L layers; the plan gives all
repeats the same layouts (the periodic optimum) and the runtime replays the original repeats
with them. A long loop's body holds two repeats, so that layouts may alternate between layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from .keys import equation_key, operand_types, program_key
from .program import (
    Atom,
    Equation,
    Literal,
    Program,
    ScanRegion,
    ValueInfo,
)
from .scopes import unfolded_scopes

MIN_REPEATS = 2
PAIR_REPEATS = 4  # loops this long are folded two repeats per body
PAIR_GROWTH = 3.0  # ... if that program has at most this many times the equations of one per body
LOOSE_TRIED = 0.25  # literal-blind keys are tried where exact ones leave more of the program than this


@dataclass(frozen=True)
class Run:
    start: int
    period: int
    repeats: int

    def index(self, j: int, t: int) -> int:
        return self.start + j * self.period + t


@dataclass
class Slot:
    kind: str  # "int", "carry", "const", "xs", "lit" (one literal), "lits" (one per repeat)
    src: tuple[int, int] | None = None  # (offset, output) for int / carry
    values: list[int] = field(default_factory=list)  # outer values (const: one; xs: one per repeat)


Slots = dict[tuple[int, int], Slot]  # (body offset, operand position) -> how every repeat reads it
Runs = list[tuple[Run, Slots]]  # the runs to fold, each with how its body reads its operands


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


def _classify(prog: Program, run: Run, literals_equal: bool = False) -> Slots | None:
    """How each operand of the body reads its value in every repeat; None if repeats differ.
    `literals_equal`: the run was found with exact keys, so its repeats' literals are equal."""
    lo, hi = run.start, run.start + run.repeats * run.period
    slots: Slots = {}
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
                # a per-layer scalar (a dropout key's fold_in index) changes no layout: the body
                # reads the first repeat's, the replay each repeat's own
                same = literals_equal or len({_literal_text(k[2]) for k in kinds}) == 1
                slots[(t, q)] = Slot("lit" if same else "lits")
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


def fold(prog: Program, pair: bool = True) -> Program:
    """The program with its unrolled loops rewritten as scans (unchanged if there are none);
    `pair`: two repeats per body where the loops are long enough (see _choose_pairs). Its notes
    say which `jax.named_scope`d layers stayed unfolded, and why."""
    if len(prog.equations) < 2 * MIN_REPEATS:
        return prog
    # layers may differ only in a scalar (a dropout key's layer index): the literal-blind keys
    # find them, but can also pair up runs that do not fold (Adam's two bias corrections, which
    # differ in beta only, read different moments) where the exact keys find smaller ones that do.
    # They are tried where the exact keys leave over a quarter of the program unfolded; of the
    # two, the smaller program
    best: Program | None = None
    for exact in (True, False):
        if not exact and best is not None and len(best.equations) <= LOOSE_TRIED * len(prog.equations):
            break
        # only top-level equations fold: a region's (a lax.scan or while body, a cond branch)
        # are barriers that no repeat spans
        keys = [(program_key if exact else fold_key)(prog, e) for e in prog.equations]
        keys = [k if e.region is None else f"@region{e.index}" for k, e in zip(keys, prog.equations, strict=True)]
        runs: Runs = []
        for run in find_runs(keys):
            slots = _classify(prog, run, literals_equal=exact)
            if slots is not None and _check_carries(slots) and run.period * run.repeats >= 8:
                runs.append((run, slots))
        if runs:
            out = _rewrite(prog, runs, literals_equal=exact)
            if pair:
                out = _choose_pairs(prog, runs, out, exact)
            if best is None or len(out.equations) < len(best.equations):
                best = out
    if best is None:
        return replace(prog, notes=unfolded_scopes(prog, prog, fold_key))
    best.notes = unfolded_scopes(prog, best, fold_key)
    return best


def _choose_pairs(prog: Program, runs: Runs, single: Program, literals_equal: bool) -> Program:
    """The program folded two repeats per body where that still folds most of it, else `single`.

    Every loop is paired alike: a loop reading another's values per layer (the backward pass the
    forward's activations, the optimizer the gradients) then finds each half's members under one
    representative. An odd repeat runs unfolded; which end of each loop it is left at decides
    whether the next loop's pairs line up with this one's: of leaving it first or last, the
    smaller program. A few layers' loop that pairing leaves mostly unfolded plans faster folded
    singly."""
    paired = min((_rewrite(prog, runs, lead, literals_equal) for lead in (True, False)), key=lambda p: len(p.equations))
    n = len(paired.equations)
    return paired if n <= len(prog.equations) / 2 and n <= PAIR_GROWTH * len(single.equations) else single


def _paired(prog: Program, run: Run, root: Callable[[int], int], values: list[ValueInfo],
            lead_first: bool, literals_equal: bool) -> tuple[Run, Slots] | None:
    """The run folded two repeats per body, or None.

    A one-repeat body gives every layer the same layouts. The unrolled optimum of a transformer
    step alternates instead: its residual stream's layer-norm reductions cost less when the
    layout switches every other layer than when it comes back each layer (GPT d1024 on 2x4, per
    layer: 1.0% above the unrolled plan folded singly, 0.4% folded in pairs). A pair body admits
    every period-2 plan, at twice the body's e-graph.

    An odd repeat runs unfolded, first or last: whichever leaves more pairs whose per-layer
    inputs share the body's layouts; on a tie, first if `lead_first`."""
    best: tuple[int, Run, Slots] | None = None
    for lead in (((1, 0) if lead_first else (0, 1)) if run.repeats % 2 else (0,)):
        twice = Run(run.index(lead, 0), 2 * run.period, (run.repeats - lead) // 2)
        slots = _classify(prog, twice, literals_equal)
        if slots is None or not _check_carries(slots):
            continue
        kept = _trim(prog, twice, slots, root, values)
        if kept is not None and (best is None or kept.repeats > best[0]):
            best = (kept.repeats, twice, slots)
    return None if best is None else (best[1], best[2])


def fold_key(prog: Program, e: Equation) -> str:
    """The equation's content key without the values of its literal operands: layers that differ
    only in a scalar (the layer index a dropout key is folded with) are repeats."""
    key = program_key(prog, e)  # cached on the equation: its e-graph key, which _unique_key extends
    if not any(isinstance(a, Literal) for a in e.inputs):
        return key
    in_shapes, in_dtypes, lits, _ = operand_types(prog, e.inputs)
    outs = [prog.values[o] for o in e.outputs]
    return equation_key(e, in_shapes, in_dtypes, [v.shape for v in outs], [v.dtype for v in outs], lits,
                        [None] * len(lits))


def _literal_text(a: Literal) -> str:
    return f"{np.asarray(a.value).tolist()!r}:{a.dtype}"


def _check_carries(slots: Slots) -> bool:
    """Every slot that carries one value must start from the same outside value."""
    init: dict[tuple[int, int], int] = {}
    for slot in slots.values():
        if slot.kind == "carry" and init.setdefault(slot.src, slot.values[0]) != slot.values[0]:  # type: ignore[arg-type]
            return False
    return True


@dataclass
class _Rewriter:
    """The folded program as it is built: `_rewrite`'s steps append equations, values, regions
    and carries to it and alias values in it."""

    prog: Program
    values: list[ValueInfo]
    equations: list[Equation]
    scans: list[ScanRegion]
    carries: list[int]
    aliases: dict[int, int]

    @classmethod
    def of(cls, prog: Program) -> _Rewriter:
        # the program's own regions keep their indices
        return cls(prog, list(prog.values), [], list(prog.scans), list(prog.carries), dict(prog.aliases))

    def root(self, v: int) -> int:
        """The value `v` is laid out as, through any chain of aliases."""
        while v in self.aliases:
            v = self.aliases[v]
        return v

    def new_value(self, like: int, region: int | None = None, carry: tuple[int, int] | None = None) -> int:
        v = self.values[like]
        vid = len(self.values)
        self.values.append(ValueInfo(vid, v.shape, v.dtype, region=region, carry=carry))
        return vid

    def emit(self, e: Equation, ins: list[Atom], outs: list[int], region: int | None) -> None:
        idx = len(self.equations)
        for k, o in enumerate(outs):
            self.values[o] = replace(self.values[o], producer=idx, output_index=k, region=region)
        self.equations.append(Equation(idx, e.primitive, e.params, tuple(ins), tuple(outs), e.origin,
                                       region, e.key, e.effects))

    def copy(self, lo: int, hi: int) -> None:
        """The program's equations lo..hi-1, unfolded at top level: repeats a run leaves out."""
        for k in range(lo, hi):
            e = self.prog.equations[k]
            self.emit(e, list(e.inputs), list(e.outputs), None)

    def _rehome_producers(self) -> None:
        """A repeat's value that no emitted equation makes (it aliases its body value) kept its
        producer index in the original program, which names another equation of the folded one
        or none (the memory model read it and crashed, fuzz seed 269): it takes its
        representative's producer, or none."""
        made = {o: (e.index, k) for e in self.equations for k, o in enumerate(e.outputs)}
        for vid, v in enumerate(self.values):
            if v.producer is None or made.get(vid, (None,))[0] == v.producer:
                continue
            idx, k = made.get(self.root(vid), (None, 0))
            self.values[vid] = replace(v, producer=idx, output_index=k)

    def program(self) -> Program:
        """The folded program, once every equation has been emitted."""
        prog, aliases = self.prog, self.aliases
        # An alias shares its representative's layout, not its value: an equation reading a member
        # must never be merged with one reading another member, so its key is made its own.
        for e in self.equations:
            folded = e.region is not None and self.scans[e.region].folded
            if not folded and any(isinstance(a, int) and a in aliases for a in e.inputs):
                _unique_key(e)
        self._rehome_producers()
        return Program(
            values=self.values, equations=self.equations, args=prog.args, consts=prog.consts,
            const_values=prog.const_values, outputs=prog.outputs, in_tree=prog.in_tree, out_tree=prog.out_tree,
            arg_paths=prog.arg_paths, out_paths=prog.out_paths, arg_counts=prog.arg_counts, name=prog.name,
            scans=self.scans, carries=self.carries, aliases=aliases, equivalences=prog.equivalences,
        )


def _rewrite(prog: Program, runs: Runs, pair: bool | None = None, literals_equal: bool = False) -> Program:
    """Each run becomes a body (its first repeat, reading carries through tied carry inputs) in a
    region weighted by the repeat count. Every repeat's values alias their body value, and the
    per-repeat inputs of a slot alias each other: the e-graph sees one of each, the runtime
    replays the original repeats with the body's layouts."""
    rw = _Rewriter.of(prog)
    run_at = {run.start: (run, slots) for run, slots in runs}
    i = 0
    while i < len(prog.equations):
        if i in run_at:
            run, slots = run_at[i]
            i = _rewrite_run(rw, run, slots, pair, literals_equal)
        else:
            e = prog.equations[i]
            rw.emit(e, list(e.inputs), list(e.outputs), e.region)
            i += 1
    return rw.program()


def _rewrite_run(rw: _Rewriter, run: Run, slots: Slots, pair: bool | None,
                 literals_equal: bool) -> int:
    """Emits the run, folded in pairs, singly or (where its repeats cannot share layouts) partly
    or wholly unfolded; returns the index of the first equation it did not emit."""
    prog = rw.prog
    paired = (None if pair is None or run.repeats < PAIR_REPEATS
              else _paired(prog, run, rw.root, rw.values, pair, literals_equal))
    if paired is not None:
        start = run.start
        run, slots = paired
        rw.copy(start, run.start)  # an odd first repeat runs unfolded (and an odd last)
    trimmed = _trim(prog, run, slots, rw.root, rw.values)
    if trimmed is None:  # its repeats read per-layer inputs they cannot share: run unfolded
        rw.copy(run.start, run.start + run.period * run.repeats)
        return run.start + run.period * run.repeats
    if trimmed != run:
        # repeats reading a per-layer input the others do not share run unfolded (on the model)
        rw.copy(run.start, trimmed.start)
        new_slots = _classify(prog, trimmed, literals_equal)
        if new_slots is None or not _check_carries(new_slots):
            return trimmed.start  # the rest runs unfolded too
        run, slots = trimmed, new_slots
    _fold_body(rw, run, slots, per_body=1 if paired is None else 2)
    return run.start + run.period * run.repeats


def _fold_body(rw: _Rewriter, run: Run, slots: Slots, per_body: int) -> None:
    """Emits the run as one scan region: its body, the carries tied around it and the aliases
    that give every repeat the body's layouts."""
    s = len(rw.scans)
    reg = ScanRegion(index=s, length=run.repeats, reverse=False, parent=None, multiplicity=run.repeats,
                     init=[], carry_in=[], carry_out=[], final=[], xs=[], slices=[], ys=[], stacked=[],
                     params={"length": run.repeats, "reverse": False, "unroll": 1, "folded": True,
                             "per_body": per_body})
    rw.scans.append(reg)
    rep_of = _share_per_layer_inputs(rw, reg, slots)
    carry_of = _carry_inputs(rw, reg, run, slots)
    body_of = _emit_body(rw, reg, run, slots, rep_of, carry_of)
    reg.carry_out = [body_of[key] for key in carry_of]
    for key, cin in carry_of.items():  # each repeat reads as its carry: the init, then the previous output
        tt, k = key
        ci = reg.carry_in.index(cin)
        reg.members[cin] = [reg.init[ci]] + [
            rw.prog.equations[run.index(j, tt)].outputs[k] for j in range(run.repeats - 1)]


def _representative(roots: list[int]) -> int:
    """The member a per-layer role is read as: the most common root (the first on a tie)."""
    return max(dict.fromkeys(roots), key=roots.count)


def _share_per_layer_inputs(rw: _Rewriter, reg: ScanRegion,
                            slots: Slots) -> dict[tuple[int, int], int]:
    """The value each per-layer ("xs") slot reads in the body, by slot.

    One role, one layout: the e-graph sees the most common member (a body value of an earlier
    folded loop, or the first layer's weight); arguments of the role alias it. A member produced
    elsewhere keeps its own production and is resharded to the body's layout where it is read."""
    rep_of: dict[tuple[int, int], int] = {}
    for key, slot in sorted(slots.items()):
        if slot.kind != "xs":
            continue
        roots = [rw.root(m) for m in slot.values]
        rep = _representative(roots)
        for r_ in roots:
            if r_ != rep and rw.values[r_].arg is not None:
                rw.aliases[r_] = rep
            elif r_ != rep and r_ not in reg.extra_reads:
                reg.extra_reads.append(r_)  # must still be computed: a root of the plan
        rep_of[key] = rep
    return rep_of


def _carry_inputs(rw: _Rewriter, reg: ScanRegion, run: Run,
                  slots: Slots) -> dict[tuple[int, int], int]:
    """One loop-carried input value per carried body output (offset, output), in slot order."""
    carry_of: dict[tuple[int, int], int] = {}
    for _, slot in sorted(slots.items()):
        if slot.kind != "carry" or slot.src in carry_of:
            continue
        tt, k = slot.src  # type: ignore[misc]
        like = rw.prog.equations[run.index(0, tt)].outputs[k]
        cin = rw.new_value(like, region=reg.index, carry=(reg.index, len(reg.carry_in)))
        carry_of[slot.src] = cin  # type: ignore[index]
        reg.carry_in.append(cin)
        reg.init.append(slot.values[0])
        rw.carries.append(cin)
    return carry_of


def _invariant_offsets(prog: Program, run: Run, slots: Slots) -> set[int]:
    """Body offsets whose equation reads only values shared by all repeats (and literals), directly
    or through other such equations: loop-invariant."""
    invariant: set[int] = set()
    for t in range(run.period):
        n_in = len(prog.equations[run.index(0, t)].inputs)
        if all(slots[(t, q)].kind in ("const", "lit")
               or (slots[(t, q)].kind == "int" and slots[(t, q)].src[0] in invariant)  # type: ignore[index]
               for q in range(n_in)):
            invariant.add(t)
    return invariant


def _emit_body(rw: _Rewriter, reg: ScanRegion, run: Run, slots: Slots,
               rep_of: dict[tuple[int, int], int], carry_of: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """Emits the first repeat as the body, reading its inputs through `slots`; returns the body
    value of each (offset, output). Every repeat's values alias the body's."""
    prog, s = rw.prog, reg.index
    roles: dict[int, set[tuple[int, ...]]] = {}  # representative -> the member lists it stands for
    for key, rep in rep_of.items():
        roles.setdefault(rep, set()).add(tuple(slots[key].values))
    rep_count = {rep: len(lists) for rep, lists in roles.items()}
    invariant = _invariant_offsets(prog, run, slots)
    body_of: dict[tuple[int, int], int] = {}
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
                ins.append(rep_of[(t, q)])
            else:
                ins.append(a)
        outs = []
        for k, _ in enumerate(e.outputs):
            body_of[(t, k)] = rw.new_value(e.outputs[k], region=s)
            outs.append(body_of[(t, k)])
        rw.emit(e, ins, outs, s)
        if t in invariant:
            reg.invariant.update(outs)
        shared_rep = [rep_of[(t, q)] for q in range(len(e.inputs)) if slots[(t, q)].kind == "xs"]
        if any(rep_count[r_] > 1 for r_ in shared_rep):
            _unique_key(rw.equations[-1])  # slots read different arrays through one representative
        reg.replay[len(rw.equations) - 1] = [prog.equations[run.index(j, t)] for j in range(run.repeats)]
        for k, b in enumerate(outs):
            members = [prog.equations[run.index(j, t)].outputs[k] for j in range(run.repeats)]
            reg.members[b] = members
            for m in members:
                rw.aliases[m] = b  # every repeat's value is laid out like the body's
    return body_of


def _trim(prog: Program, run: Run, slots: Slots, root: Callable[[int], int],
          values: list[ValueInfo]) -> Run | None:
    """The run without its first or last repeats where they read a per-layer input that is
    produced elsewhere (layer 0's weight gradient, when layer 0's backward differs): such a
    repeat cannot share the body's layouts on the model. None if such repeats sit in the middle,
    or too few repeats would be left: the run is then not folded."""
    bad: set[int] = set()
    for slot in slots.values():
        if slot.kind != "xs":
            continue
        roots = [root(m) for m in slot.values]
        rep = _representative(roots)
        bad.update(j for j, r in enumerate(roots) if r != rep and values[r].producer is not None)
    if not bad:
        return run
    lo, hi = 0, run.repeats
    while lo in bad:
        lo += 1
    while hi - 1 in bad:
        hi -= 1
    if any(lo <= j < hi for j in bad) or hi - lo < MIN_REPEATS or run.period * (hi - lo) < 8:
        return None
    return Run(run.index(lo, 0), run.period, hi - lo)


def _unique_key(e: Equation) -> None:
    assert e.key is not None, "fold computes every equation's key first"
    if "@" not in e.key:
        e.key = f"{e.key}@{e.index}"

