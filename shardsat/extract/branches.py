"""What XLA writes straight into a conditional's result buffer.

A branch's root is the conditional's output buffer (one HloBuffer), which the timeline holds
from the conditional's start (Timeline.birth_time). An elementwise root also takes over an
operand that dies where the root is made (`CanShareOperandBufferWithUser`), so that operand lives
in the conditional's buffer too, not beside it: a branch `(x @ w.T) * 2` writes the product into
the conditional's result and scales it there (XLA:CPU dump: `ynn_fusion` and
`broadcast_multiply_fusion` share the output allocation). A branch that returns its operand
in another layout reads it resharded where the conditional ends (passed_resharded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import fusion

if TYPE_CHECKING:
    from .liveness import Buf, Key, PlanLiveness, Timeline

BranchRoots = dict[int, tuple["Key", "Key", int, bool]]


def branch_roots(tl: Timeline) -> BranchRoots:
    """Per position making a branch's result in that branch: (the result's key, the
    conditional's result key, the branch's region, can the op write into a dying operand).
    Once per program."""
    out: BranchRoots = {}
    for e in tl.seq:
        mk = tl.key(e.outputs[0]) if e.name == "cond_merge" else None
        if mk is None:
            continue
        for r, a in zip(e.params["cond"], e.inputs[1:], strict=True):
            rk = tl.key(a) if isinstance(a, int) else None
            t = tl.made_at.get(rk) if rk is not None else None
            if t is not None and tl.seq[t].region == r:
                out[t] = (rk, mk, r, fusion.in_place(tl.seq[t]))
    return out


def taken_by_branch_results(live: PlanLiveness, roots: BranchRoots) -> set[Buf]:
    """The buffers that live in a conditional's result buffer: each branch's root, where it is
    made in the conditional's layout, and what an elementwise root takes over: an operand made
    in the branch, read by nothing after the root, in its layout and of its size. A root whose
    key is also read outside the branch (the e-graph merged it with an equal value computed
    there) stays a buffer of its own."""
    tl, out = live.tl, set()
    for t, (rk, mk, r, inplace) in roots.items():
        lid = live.produced.get(rk)
        if (lid is None or live.produced.get(mk) != lid or (rk, lid) not in live.born
                or not tl.in_region(live.last.get((rk, lid), t), r)):
            continue  # another layout, or the same value read outside (merged with an equal one)
        out.add((rk, lid))
        for a in tl.seq[t].inputs if inplace else ():
            b = (tl.key(a), lid) if isinstance(a, int) else None
            born = live.born.get(b) if b is not None else None  # type: ignore[arg-type]
            if (born is not None and tl.start.get(r, t) <= born < t and live.last.get(b, born) <= t
                    and b[0] not in live.held and b[0] not in tl.flattened and tl.size(*b) == tl.size(mk, lid)):
                out.add(b)
                break
    return out


def passed_resharded(tl: Timeline, t: int, pos: int, lid: int | None, produced: dict[Key, int]) -> bool:
    """Is operand `pos` of the conditional's merge at `t` one its branch returns as it came in
    (made before the branch) in another layout? XLA reshards it before the conditional and
    holds the copy until the conditional ends, with the other operands it passes in (a switch
    returning `x` sliced on 1x8: 2 MiB). An operand every branch returns is no result of the
    conditional (XLA's simplifier forwards it): where it is read, it is read."""
    e = tl.seq[t]
    a = e.inputs[pos]
    k = tl.key(a) if isinstance(a, int) and len(set(e.inputs[1:])) > 1 else None
    made = tl.made_at.get(k) if k is not None else None
    return (k is not None and lid is not None and lid != produced.get(k)
            and not (made is not None and tl.in_region(made, e.params["cond"][pos - 1])))


__all__ = ["BranchRoots", "branch_roots", "passed_resharded", "taken_by_branch_results"]
