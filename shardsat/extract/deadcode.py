"""Equations whose results nothing reads: XLA's dead-code elimination (HloDCE) removes them
before it schedules and assigns buffers, so they hold no memory.

`jax.grad` traces the primal computation up to the loss, and a training step that returns only
the new parameters never reads that loss: its reduction, and any chain of ops only it reads,
are dead in the traced program but absent from the compiled one. Counting them kept, for
instance, a layer's pre-activation alive past its last real reader.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from ..egraph.program import Program

# equations that stand for control flow (a loop's or a branch's results): kept with their regions
CONTROL = frozenset({"scan_final", "scan_stack", "scan_slice", "cond_merge"})


def dead_equations(program: Program, key: Callable[[int], Hashable | None]) -> set[int]:
    """The ids of the program's equations XLA removes: outside any loop or branch, with no
    effect, every result unread by a live equation and not an output. Results compare by `key`
    (a value group), so an equation the e-graph merged with a live one is live too. A result
    with no key is kept (read by nothing the plan prices, but not known dead)."""
    needed: set[Hashable] = set()
    for o in program.outputs:
        if isinstance(o, int) and (k := key(o)) is not None:
            needed.add(k)
    for reg in program.scans:  # what a loop or a branch reads or makes, a folded loop's replays too
        atoms = [*reg.init, *reg.xs, *reg.final, *reg.stacked, *reg.outs, *reg.extra_reads, reg.pred]
        atoms += [a for eqs in reg.replay.values() for e in eqs for a in (*e.inputs, *e.outputs)]
        for a in atoms:
            if isinstance(a, int) and (k := key(a)) is not None:
                needed.add(k)
    dead: set[int] = set()
    for e in reversed(program.equations):
        keys = [key(o) for o in e.outputs]
        live = (e.effects or e.region is not None or e.name in CONTROL or not e.outputs
                or any(k is None or k in needed for k in keys))
        if not live:
            dead.add(id(e))
            continue
        for a in e.inputs:
            if isinstance(a, int) and (k := key(a)) is not None:
                needed.add(k)
    return dead
