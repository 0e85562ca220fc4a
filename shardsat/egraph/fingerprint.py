"""A program's fingerprint: one digest of what a plan depends on, equal across processes.

A saved plan names values by their ids in the traced program and equations by their content keys;
it applies to another trace only if that trace is the same program: the same argument and output
structure, shapes and dtypes, and the same equations (content keys, egraph/keys.py, which hold
no memory addresses) wired the same way, in the same regions. Constant values are left out on
purpose (a plan holds for any values of the same types; hashing a closed-over weight would cost
more than tracing). Per-equation digests let a mismatch name the first equation that differs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from .keys import program_key
from .program import Atom, Literal, Program

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
EQN_DIGEST_CHARS = 8


@dataclass(frozen=True)
class Fingerprint:
    """digest: of the whole program; equations: a short digest per equation, in order."""

    digest: str
    equations: tuple[str, ...]
    arguments: tuple[str, ...]  # "path dtype[shape]" per flat argument leaf

    def first_difference(self, saved: list[str]) -> int | None:
        """Index of the first equation whose digest differs from `saved` (or that one lacks)."""
        for i, (a, b) in enumerate(zip(self.equations, saved, strict=False)):
            if a != b:
                return i
        if len(self.equations) != len(saved):
            return min(len(self.equations), len(saved))
        return None


def _atom(a: Atom) -> str:
    if not isinstance(a, Literal):
        return str(a)
    try:  # the value's bytes: repr() of a jax literal goes through numpy's array printer (slow)
        return f"lit:{np.asarray(a.value).tobytes().hex()}:{a.dtype}"
    except Exception:  # pragma: no cover - an extended dtype's literal
        return f"lit:{a.value!r}:{a.dtype}"


def _tree_text(tree: object) -> str:
    """A treedef as text, with any memory address in a custom node's data blanked."""
    return _ADDRESS.sub("0x?", str(tree))


def _value_type(prog: Program, vid: int) -> str:
    v = prog.values[vid]
    return f"{v.dtype}[{','.join(map(str, v.shape))}]{'w' if v.weak_type else ''}"


def fingerprint(prog: Program) -> Fingerprint:
    """The program's digest, per-equation digests and argument types (see the module doc)."""
    h = hashlib.sha256()

    def feed(text: str) -> None:
        h.update(text.encode())
        h.update(b"\n")

    args = tuple(f"{p} {_value_type(prog, v)}" for p, v in zip(prog.arg_paths, prog.args, strict=True))
    feed(f"in {_tree_text(prog.in_tree)}")
    feed(f"out {_tree_text(prog.out_tree)}")
    for a in args:
        feed(a)
    feed("consts " + ";".join(_value_type(prog, v) for v in prog.const_values))
    eqns = []
    for e in prog.equations:
        text = (f"{program_key(prog, e)}|{','.join(map(_atom, e.inputs))}|{','.join(map(str, e.outputs))}"
                f"|{e.region}|{int(e.effects)}")
        eqns.append(hashlib.sha1(text.encode()).hexdigest()[:EQN_DIGEST_CHARS])
        feed(text)
    for r in prog.scans:
        feed("|".join(str(x) for x in (
            r.kind, r.length, r.reverse, r.parent, r.multiplicity, [_atom(a) for a in r.init], r.carry_in,
            [_atom(a) for a in r.carry_out], r.final, [_atom(a) for a in r.xs], r.slices,
            [_atom(a) for a in r.ys], r.stacked, None if r.pred is None else _atom(r.pred), r.cond_region,
            [_atom(a) for a in r.outs])))
    feed("outputs " + ",".join(map(_atom, prog.outputs)))
    return Fingerprint(h.hexdigest(), tuple(eqns), args)
