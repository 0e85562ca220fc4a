"""Shared test helpers."""

from __future__ import annotations

import dataclasses
from typing import Any

import shardsat
from shardsat.testing import check_collectives, check_plan

# the H100 preset priced as XLA:GPU compiles (its all-gather and reduce-scatter combiners) on the
# simulated CPU mesh, whose own XLA combines all-reduces only: for tests of GPU-side choices
H100_GPU = dataclasses.replace(shardsat.PRESETS["h100"], combining="gpu")


def assert_equivalent(plan: shardsat.Plan, fn: Any, *args: Any, rtol: float = 1e-5) -> None:
    """The plan's sharded run equals the unsharded program on every output leaf."""
    check_plan(plan, *args, rtol=rtol, reference=fn)


def assert_hlo_matches(plan: shardsat.Plan, *args: Any) -> None:
    """The compiled HLO holds the collectives the plan predicts (count by kind; all-reduce and
    reduce-scatter counted together, see shardsat.testing.normalize_collectives)."""
    check_collectives(plan, *args)
