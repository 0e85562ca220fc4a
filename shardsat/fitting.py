"""A memory limit as XLA allocates it. The estimate is close to XLA's figure but not exact, in
either direction: a plan estimated near the limit is compiled and checked. One that compiles
over it is planned again under a bound scaled by how far its estimate was off; where the
estimate was high, a plan estimated just over the limit may compile under it, so the smallest
plan is compiled before the limit is refused, and a faster plan is tried under the limit scaled
the other way."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import MemoryLimitWarning, NoPlanError, warn_user
from .extract.memory import MemoryEstimate
from .extract.result import Extraction
from .extract.search import MemoryNotMetError
from .runtime.plan import Plan

# A plan is compiled and its memory_analysis() checked unless its estimate is under
# COMPILE_CHECK_SHARE of the limit *and* COMPILE_CHECK_BYTES below it. The first covers the
# estimate's relative error on large programs (within 15% where measured), the second its
# absolute error on small ones (XLA's small buffers and scratch, which the model does not have:
# a 4 KB limit met by a 2 KB estimate can compile to 5 KB), where the compile is cheap. A plan
# over the limit is planned again, a few times at most.
COMPILE_CHECK_SHARE = 0.5
COMPILE_CHECK_BYTES = 16 << 20
COMPILE_CHECKS = 3
# Before a limit is refused, the smallest plan found is compiled if its estimate is at most this
# many times the limit: estimates measured up to 30% high (a scan's stacked residuals) would
# refuse plans that fit.
OVER_ESTIMATE = 1.5
# A plan that compiles this far under its estimate had a high estimate: a faster plan estimated
# over the limit is tried (one more extraction and compile).
HIGH_ESTIMATE = 0.98


@dataclass
class Fitting:
    """What fitting a limit needs from the planner: plans under a bound, a plan of a given
    extraction, and the estimate of the plan with no limit (computed once, on first use)."""

    limit: int
    args: tuple[Any, ...]
    device: bool  # the limit is the device's own memory: no fitting plan warns, never raises
    device_name: str
    plan_within: Callable[[int], Plan]
    plan_of: Callable[[Extraction, MemoryEstimate], Plan]
    free_total: Callable[[], int]


def checks_compiled(predicted: int | None, limit: int) -> bool:
    """Whether a plan estimated at `predicted` bytes under `limit` is compiled to confirm it fits."""
    if predicted is None or predicted > limit:  # over already: the device default's smallest plan, warned
        return False
    return predicted >= COMPILE_CHECK_SHARE * limit or limit - predicted < COMPILE_CHECK_BYTES


def fit(f: Fitting) -> Plan:
    """A plan whose compiled memory (what XLA allocates on the mesh's devices) fits the limit,
    the fastest of those tried: `memory_limit` means what it says in both directions."""
    try:
        plan = f.plan_within(f.limit)
    except MemoryNotMetError as e:
        plan, compiled = _smallest_fits(f, e)
    else:
        plan, compiled = _tightened(f, plan)
    plan = _loosened(f, plan, compiled)
    return plan


def _smallest_fits(f: Fitting, e: MemoryNotMetError) -> tuple[Plan, int]:
    """Of the smallest plans found, all estimated over the limit, the fastest that compiles
    under it; else `e` (with the smallest compiled figure where one was compiled)."""
    fits: list[tuple[Plan, int]] = []
    least: int | None = None
    for ex, mem in [(e.smallest, e.memory), *e.others]:
        if mem.total > OVER_ESTIMATE * f.limit:
            break  # smallest first: the rest are further over
        plan = f.plan_of(ex, mem)
        compiled = plan.compiled_memory(*f.args)
        if compiled is None:
            raise e
        least = compiled if least is None else min(least, compiled)
        if compiled <= f.limit:
            fits.append((plan, compiled))
    if not fits:
        if least is None:
            raise e
        raise MemoryNotMetError(e.smallest, e.memory,
            f"No plan fits memory_limit={f.limit:,} bytes per device. The smallest plan found needs "
            f"{e.memory.total:,} bytes ({e.memory.parts()}); compiled, the smallest plans need {least:,}. "
            f"Consider a larger mesh, a smaller batch, or memory_limit >= {least:,}.", e.others) from e
    plan, compiled = min(fits, key=lambda pc: pc[0].extraction.total_s)
    plan.report.memory_compiled = compiled
    return plan, compiled


def _tightened(f: Fitting, plan: Plan) -> tuple[Plan, int | None]:
    """A plan under the limit as compiled (and its compiled bytes, None where not compiled),
    planned again under tighter bounds while the one found compiles over it."""
    limit, bound = f.limit, f.limit
    for attempt in range(COMPILE_CHECKS + 1):
        assert plan.cost.memory is not None
        est = plan.cost.memory.total
        if not checks_compiled(est, limit):
            return plan, None
        compiled = plan.compiled_memory(*f.args)
        if compiled is None or compiled <= limit:
            plan.report.memory_compiled = compiled
            return plan, compiled
        if attempt == COMPILE_CHECKS:  # the last plan is checked too: none is returned over the limit
            return _none_fits(f, plan, compiled), compiled
        # the bound the plan's estimate would have needed had it been off by as much as it was
        bound = min(int(bound * 0.99), int(est * limit / compiled))
        try:
            plan = f.plan_within(bound)
        except MemoryNotMetError as e:
            if e.memory.total < est:  # not the plan just compiled: the smallest may still fit as compiled
                with contextlib.suppress(MemoryNotMetError):
                    return _smallest_fits(f, e)
            raise MemoryNotMetError(
                e.smallest, e.memory,
                f"No plan fits memory_limit={limit:,} bytes per device as compiled: the plan estimated to fit "
                f"compiles to {compiled:,} bytes, and none estimated under {bound:,} bytes was found. {e}") from e
    raise AssertionError("unreachable")


def _none_fits(f: Fitting, plan: Plan, compiled: int) -> Plan:
    """The device's own memory: the last plan, with a warning. Else MemoryNotMetError."""
    assert plan.cost.memory is not None
    why = (f"No plan fits memory_limit={f.limit:,} bytes per device as compiled: {COMPILE_CHECKS} plans "
           f"estimated to fit compile to more, the last to {compiled:,} bytes.")
    if f.device:
        warn_user(f"{why} Returning that plan: it may not fit on {f.device_name} devices.", MemoryLimitWarning)
        plan.report.memory_compiled = compiled
        return plan
    raise MemoryNotMetError(plan.extraction, plan.cost.memory,
                            f"{why} Consider a larger mesh, a smaller batch, or memory_limit >= {compiled:,}.")


def _loosened(f: Fitting, plan: Plan, compiled: int | None) -> Plan:
    """Where `plan` compiled well under its estimate and the limit bound the search (the plan
    with no limit is estimated over it), a plan under the limit scaled by how far the estimate
    was off: kept if it is faster and compiles under the limit."""
    assert plan.cost.memory is not None
    est = plan.cost.memory.total
    if (compiled is None or compiled <= 0 or compiled > f.limit or compiled >= HIGH_ESTIMATE * est
            or f.free_total() <= f.limit):  # 0 bytes compiled (all aliased): no error to scale by
        return plan
    try:
        other = f.plan_within(int(est * f.limit / compiled))
    except NoPlanError:  # out of time, say: the plan in hand fits
        return plan
    if other.extraction.total_s >= plan.extraction.total_s:
        return plan
    wider = other.compiled_memory(*f.args)
    if wider is None or wider > f.limit:
        return plan
    other.report.memory_compiled = wider
    return other


__all__ = ["COMPILE_CHECKS", "COMPILE_CHECK_BYTES", "COMPILE_CHECK_SHARE", "Fitting", "checks_compiled", "fit"]
