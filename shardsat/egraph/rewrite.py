"""Algebraic rewrites of the program: a user's `lhs == rhs` identity, written as two JAX functions.

    reassociate = shardsat.Rewrite("matmul-reassociate",
                                   lambda a, b, c: (a @ b) @ c,
                                   lambda a, b, c: a @ (b @ c),
                                   example_args=(f32[2, 3], f32[3, 4], f32[4, 5]))

`example_args` fix the operands' ranks and dtypes. The lhs is traced once into a pattern; every
place the program computes the same primitives with the same dataflow is a candidate, confirmed
by tracing lhs again on the candidate's operands and comparing content keys (so shape-dependent
parameters match exactly). For each match the rhs is traced on those operands, its equations are
inserted after the matched result, and the two results are recorded as equal: the e-graph holds
both computations in one value class, extraction picks the cheaper one with its layouts, and the
runtime runs only the chosen equations. Matching is syntactic on the traced program (a few
rounds, so a rewrite can apply to equations an earlier match introduced), not modulo equality.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from ..errors import InvalidArgumentError
from .keys import program_key
from .program import Atom, Equation, Literal, Program, _Builder, trace


@dataclass(frozen=True)
class Rewrite:
    """`lhs(*xs) == rhs(*xs)` for operands like `example_args` (ShapeDtypeStructs or arrays).
    `check_rewrite` (shardsat.testing) tests the identity numerically."""

    name: str
    lhs: Callable[..., Any]
    rhs: Callable[..., Any]
    example_args: tuple[Any, ...]

    def __post_init__(self) -> None:
        # checked here, where the mistake is made: a wrong arity surfaced as a TypeError from
        # tracing inside saturate_and_extract, or as hypothesis finding no valid example
        where = f"Rewrite `{self.name}`"
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(f"Rewrite name must be a non-empty string, got {self.name!r}.")
        if isinstance(self.example_args, list):
            object.__setattr__(self, "example_args", tuple(self.example_args))
        if not isinstance(self.example_args, tuple):
            raise InvalidArgumentError(
                f"{where}: example_args must be a tuple with one array or jax.ShapeDtypeStruct per operand, got "
                f"{type(self.example_args).__name__}. Consider example_args=(jax.ShapeDtypeStruct((2, 3), jnp.float32),).")
        for side in ("lhs", "rhs"):
            fn = getattr(self, side)
            if not callable(fn):
                raise InvalidArgumentError(f"{where}: {side} must be a function of the operands, got "
                                           f"{type(fn).__name__} {fn!r}.")
            why = _arity_mismatch(fn, len(self.example_args))
            if why:
                raise InvalidArgumentError(
                    f"{where}: {side} {why}, but example_args has {len(self.example_args)} operand(s). Consider "
                    "one example (array or jax.ShapeDtypeStruct) per operand, the same operands for lhs and rhs.")


def _arity_mismatch(fn: Callable[..., Any], n: int) -> str | None:
    """Why `fn` cannot take n positional operands, or None (also when its signature is unknown)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*range(n))
    except TypeError:
        params = [p.name for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        return f"takes operands ({', '.join(params)})"
    return None


@dataclass
class _Pattern:
    program: Program  # lhs traced on example_args
    root: int  # index of the equation defining the lhs result


def _pattern(rw: Rewrite) -> _Pattern:
    where = f"Rewrite `{rw.name}`"
    try:
        p = trace(rw.lhs, rw.example_args)
        rhs = jax.eval_shape(rw.rhs, *rw.example_args)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"{where} does not trace on its example_args {_types(rw.example_args)}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''} Consider example_args whose shapes lhs and rhs accept."
        ) from e
    if len(p.outputs) != 1 or isinstance(p.outputs[0], Literal) or p.values[p.outputs[0]].producer is None:
        raise InvalidArgumentError(f"{where}: lhs must compute one array from its operands.")
    if p.consts or p.scans:
        raise InvalidArgumentError(f"{where}: lhs may not close over arrays or contain loops.")
    if not hasattr(rhs, "shape"):
        raise InvalidArgumentError(f"{where}: rhs must compute one array, like lhs; it returns {rhs!r}.")
    lhs = p.values[p.outputs[0]]
    if (rhs.shape, rhs.dtype) != (lhs.shape, lhs.dtype):
        raise InvalidArgumentError(f"{where}: lhs gives {lhs.dtype}{list(lhs.shape)} but rhs gives "
                                   f"{rhs.dtype}{list(rhs.shape)}.")
    return _Pattern(p, p.values[p.outputs[0]].producer)  # type: ignore[arg-type]


def _types(args: Sequence[Any]) -> str:
    return "(" + ", ".join(f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}" for a in args) + ")"


def _match(pat: _Pattern, prog: Program, root: Equation) -> tuple[list[Atom], dict[int, int]] | None:
    """Operands bound to the pattern's arguments, and pattern equation -> program equation."""
    pp = pat.program
    binding: dict[int, Atom] = {}  # pattern arg value -> program atom
    eqns: dict[int, int] = {}

    def value(pv: Atom, a: Atom) -> bool:
        if isinstance(pv, Literal):
            return isinstance(a, Literal) and a.value == pv.value
        info = pp.values[pv]
        if info.producer is None:  # a pattern operand: bind consistently
            if pv in binding:
                return binding[pv] == a
            binding[pv] = a
            return True
        if isinstance(a, Literal):
            return False
        ainfo = prog.values[a]
        if ainfo.producer is None or ainfo.output_index != info.output_index:
            return False
        return eqn(info.producer, prog.equations[ainfo.producer])

    def eqn(pi: int, e: Equation) -> bool:
        pe = pp.equations[pi]
        if pi in eqns:
            return eqns[pi] == e.index
        if pe.name != e.name or len(pe.inputs) != len(e.inputs) or e.region is not None:
            return False
        eqns[pi] = e.index
        return all(value(pv, a) for pv, a in zip(pe.inputs, e.inputs, strict=True))

    if not eqn(pat.root, root) or len(eqns) != len(pp.equations):
        return None
    operands = []
    for a in pp.args:
        if a not in binding:
            return None  # an operand the lhs does not use
        operands.append(binding[a])
    return operands, eqns


def _aval(prog: Program, a: Atom) -> Any:
    if isinstance(a, Literal):
        return jax.ShapeDtypeStruct((), a.dtype)
    v = prog.values[a]
    return jax.ShapeDtypeStruct(v.shape, v.dtype)


def _confirmed(rw: Rewrite, prog: Program, operands: list[Atom], eqns: dict[int, int]) -> bool:
    """The lhs traced on these operands computes exactly the matched equations."""
    if any(isinstance(a, Literal) for a in operands):
        return False
    try:
        again = trace(rw.lhs, [_aval(prog, a) for a in operands])
    except Exception:
        return False
    if len(again.equations) != len(eqns):
        return False
    return all(program_key(again, again.equations[pi]) == program_key(prog, prog.equations[ei])
               for pi, ei in eqns.items())


def apply_rewrites(prog: Program, rewrites: Sequence[Rewrite], rounds: int = 3) -> Program:
    """The program with each match's rhs inserted after the matched result, recorded as equal."""
    if not rewrites:
        return prog
    patterns = [(rw, _pattern(rw)) for rw in rewrites]
    done: set[tuple[str, int]] = set()
    for _ in range(rounds):
        inserts: dict[int, list[tuple[Rewrite, list[Atom], int]]] = {}
        for rw, pat in patterns:
            root_name = pat.program.equations[pat.root].name
            for e in prog.equations:
                if e.name != root_name or (rw.name, e.outputs[0]) in done:
                    continue
                m = _match(pat, prog, e)
                if m is None or not _confirmed(rw, prog, *m):
                    continue
                done.add((rw.name, e.outputs[0]))
                inserts.setdefault(e.index, []).append((rw, m[0], e.outputs[0]))
        if not inserts:
            break
        prog = _insert(prog, inserts)
    return prog


def _rhs_jaxpr(rw: Rewrite, prog: Program, operands: list[Atom], out: int) -> Any:
    """The rhs traced on one match's operands; a clear error naming the rewrite where it fails
    there or gives another type than the lhs it replaces (example_args of other shapes can hide
    both: a transpose of a square example; the e-graph panicked on the merge)."""
    avals = [_aval(prog, a) for a in operands]
    where = f"Rewrite `{rw.name}` matched at operand shapes {[tuple(getattr(a, 'shape', ())) for a in avals]}"
    try:
        closed = jax.make_jaxpr(rw.rhs)(*avals)
    except Exception as e:
        raise InvalidArgumentError(f"{where}, but its rhs fails on them: {type(e).__name__}: {str(e).strip().rstrip('.')}. Consider an rhs "
                                   "valid for every shape the lhs matches, and example_args of other shapes.") from e
    want = prog.values[out]
    got = closed.out_avals
    if len(got) != 1 or tuple(got[0].shape) != tuple(want.shape) or got[0].dtype != want.dtype:
        shown = ", ".join(f"{a.dtype}{list(a.shape)}" for a in got)
        raise InvalidArgumentError(f"{where}: its lhs gives {want.dtype}{list(want.shape)} there, its rhs {shown}. "
                                   "Consider an rhs equal to the lhs for every shape, and example_args that are not "
                                   "square where a transpose could hide it.")
    return closed


def _insert(prog: Program, inserts: dict[int, list[tuple[Rewrite, list[Atom], int]]]) -> Program:
    b = _Builder()
    b.values = list(prog.values)
    order: list[Equation] = []
    equal = list(prog.equivalences)
    for e in prog.equations:
        order.append(e)
        for rw, operands, out in inserts.get(e.index, ()):
            b.equations = []
            closed = _rhs_jaxpr(rw, prog, operands, out)
            if closed.consts:
                raise InvalidArgumentError(f"Rewrite `{rw.name}`: rhs may not close over arrays.")
            env = dict(zip(closed.jaxpr.invars, operands, strict=True))
            outs = b.inline(closed.jaxpr, env)
            if b.consts or b.scans:
                raise InvalidArgumentError(f"Rewrite `{rw.name}`: rhs may not close over arrays or contain loops.")
            new = outs[0] if len(outs) == 1 else None
            if not isinstance(new, int) or new < len(prog.values):
                continue  # rhs returns an operand or a literal: nothing to add
            order.extend(b.equations)
            equal.append((out, new))
    values = b.values
    equations = []
    for i, e in enumerate(order):
        for o in e.outputs:
            values[o] = replace(values[o], producer=i)
        equations.append(Equation(i, e.primitive, e.params, e.inputs, e.outputs, e.origin, e.region, e.key,
                                   e.effects))
    return replace(prog, values=values, equations=equations, equivalences=equal)
