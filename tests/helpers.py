"""Shared test helpers."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import shardsat
from shardsat.testing import check_collectives


def assert_equivalent(plan: shardsat.Plan, fn: Any, *args: Any, rtol: float = 1e-5) -> None:
    """The plan's sharded run equals the unsharded program on every output leaf."""
    got = plan.jit(donate_argnums=())(*args)
    want = jax.jit(fn)(*args)
    gl, gt = jax.tree_util.tree_flatten(got)
    wl, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt
    for path, g, w in zip(plan.program.out_paths, gl, wl, strict=True):
        g = np.asarray(g, dtype=np.float64) if np.asarray(g).dtype != bool else np.asarray(g)
        w = np.asarray(w, dtype=np.float64) if np.asarray(w).dtype != bool else np.asarray(w)
        assert g.shape == w.shape, path
        if g.dtype == bool:
            assert (g == w).all(), path
            continue
        scale = float(np.max(np.abs(w))) if w.size else 1.0
        scale = scale if scale > 0 else 1.0
        err = float(np.max(np.abs(g - w))) / scale if w.size else 0.0
        assert err <= rtol, f"{path}: relative error {err:.3g} > {rtol}"


def assert_hlo_matches(plan: shardsat.Plan, *args: Any) -> None:
    """The compiled HLO holds the collectives the plan predicts (count by kind; all-reduce and
    reduce-scatter counted together, see shardsat.testing.normalize_collectives)."""
    check_collectives(plan, *args)
