"""Shared test helpers."""

from __future__ import annotations

from typing import Any

import shardsat
from shardsat.testing import check_collectives, check_plan


def assert_equivalent(plan: shardsat.Plan, fn: Any, *args: Any, rtol: float = 1e-5) -> None:
    """The plan's sharded run equals the unsharded program on every output leaf."""
    check_plan(plan, *args, rtol=rtol, reference=fn)


def assert_hlo_matches(plan: shardsat.Plan, *args: Any) -> None:
    """The compiled HLO holds the collectives the plan predicts (count by kind; all-reduce and
    reduce-scatter counted together, see shardsat.testing.normalize_collectives)."""
    check_collectives(plan, *args)
