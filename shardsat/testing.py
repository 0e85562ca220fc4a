"""Helpers for users' own test suites: a plan computes what the unsharded program does, and XLA
emits the collectives the plan predicts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import numpy as np

from .errors import ShardsatError
from .runtime.plan import Plan


class PlanMismatchError(ShardsatError, AssertionError):
    """A plan's sharded run differs from the unsharded program, or its HLO from its prediction."""


def check_plan(plan: Plan, *args: Any, rtol: float = 1e-5, reference: Any = None) -> None:
    """Run the plan and the unsharded function on `args`; compare every output leaf.

    The error of a leaf is max|sharded - unsharded| / max|unsharded|. Raises PlanMismatchError
    naming the output's pytree path and its error.
    """
    fn = reference if reference is not None else plan.fn
    got = plan.jit(donate_argnums=())(*args)
    want = jax.jit(fn)(*args)
    gl, gt = jax.tree_util.tree_flatten(got)
    wl, wt = jax.tree_util.tree_flatten(want)
    if gt != wt:
        raise PlanMismatchError(f"The plan returns structure {gt}, the function {wt}.")
    bad = []
    for path, g, w in zip(plan.program.out_paths, gl, wl, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            bad.append(f"  * {path}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}")
            continue
        if w.size == 0:
            continue
        if w.dtype == bool or np.issubdtype(w.dtype, np.integer):
            n = int(np.sum(g != w))
            if n:
                bad.append(f"  * {path}: {n} of {w.size} elements differ")
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        scale = float(np.max(np.abs(w64))) or 1.0
        err = float(np.max(np.abs(g64 - w64))) / scale
        if not err <= rtol:
            bad.append(f"  * {path}: relative error {err:.3g} > {rtol:g}")
    if bad:
        raise PlanMismatchError(f"Plan for `{plan.program.name}` differs from the unsharded function:\n" + "\n".join(bad))


def normalize_collectives(counts: Counter[str]) -> Counter[str]:
    """Merge all-reduce and reduce-scatter into one "reduction" count: on CPU a reduce-scatter is
    an all-reduce whose result is sliced, and XLA fuses a plan's all-reduce with a later slice of
    the same value into exactly that form, so the two kinds cannot be told apart in HLO."""
    out = Counter({k: v for k, v in counts.items() if k not in ("all-reduce", "reduce-scatter") and v})
    red = counts.get("all-reduce", 0) + counts.get("reduce-scatter", 0)
    if red:
        out["reduction"] = red
    return out


def check_collectives(plan: Plan, *args: Any) -> None:
    """The compiled HLO holds the collectives `plan.cost` lists (count by kind)."""
    want = normalize_collectives(plan.predicted_collectives())
    got = normalize_collectives(plan.hlo_collectives(*args))
    if dict(got) != dict(want):
        raise PlanMismatchError(
            f"Compiled HLO has collectives {dict(plan.hlo_collectives(*args))}, the plan predicts "
            f"{dict(plan.predicted_collectives())}.\n{plan.explain()}"
        )
