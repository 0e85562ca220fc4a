"""The program a plan is made for: traced, fingerprinted, rewritten and folded.

Planning and loading a saved plan start the same way, and must end with the same program: a saved
plan names values by their ids in it. The fingerprint is taken of the traced program (what the
user's function is), before rewrites and folding (what shardsat does to it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from egglog import Ruleset
from jax.sharding import Mesh

from .egraph.constraints import adopt_constraints
from .egraph.fingerprint import Fingerprint, fingerprint
from .egraph.fold import fold
from .egraph.layout import auto_mesh
from .egraph.program import Program, trace
from .egraph.rewrite import Rewrite, apply_rewrites

# Folding trades a little plan freedom (every repeat takes the same layouts, the loop's edges
# take the body's) for planning time independent of depth: worth it for deep programs only. The
# threshold is for a mesh of two axes (more than one device on each); each further axis about
# quadruples the layouts a value may take and doubles the e-graph per equation, so it halves per
# axis. (A 12-layer GPT step on 8 devices in a row: 1585 us planned unfolded in ~9 s, 1673 us
# folded in ~4 s; on 2x4, 4 layers unfolded take ~8 s.)
FOLD_AUTO_EQUATIONS = 3000


def fold_threshold(mesh: Mesh) -> int:
    """Equations from which a program's loops are folded by default, for this mesh."""
    active = sum(1 for n in mesh.devices.shape if n > 1)
    return int(FOLD_AUTO_EQUATIONS * 2.0 ** (2 - active))


@dataclass
class Prepared:
    program: Program  # what is planned: rewritten, and folded where `folded`
    traced: Program  # as traced (a saved plan's mismatch names its equations)
    fingerprint: Fingerprint  # of the traced program
    folded: bool
    rewrites: tuple[str, ...]  # names of the shardsat.Rewrite rules applied
    trace_s: float
    unkept: tuple[str, ...] = ()  # the sharding constraints no plan can keep (egraph/constraints.py), then pins (api.py)


def prepare(fn: Callable[..., Any], mesh: Mesh, example_args: tuple[Any, ...], rules: Sequence[Ruleset | Rewrite],
            fold_loops: bool | None, on_traced: Callable[[int], None] | None = None) -> Prepared:
    """Trace, fingerprint, rewrite and (fold_loops True, or None and a deep program) fold."""
    start = time.perf_counter()
    traced = trace(fn, example_args, auto_mesh(mesh))
    unkept = adopt_constraints(traced, auto_mesh(mesh))
    fp = fingerprint(traced)
    rewrites = [r for r in rules if isinstance(r, Rewrite)]
    program = apply_rewrites(traced, rewrites)
    folded = bool(fold_loops or (fold_loops is None and len(program.equations) >= fold_threshold(mesh)))
    if folded:
        program = fold(program)
    if on_traced is not None:
        on_traced(len(program.equations))
    return Prepared(program, traced, fp, folded, tuple(r.name for r in rewrites), time.perf_counter() - start,
                    tuple(unkept))
