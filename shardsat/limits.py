"""Search limits and the typed reason a search stopped (as in egg's run.rs)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import InvalidArgumentError


class StopReason(enum.Enum):
    """Why equality saturation stopped. Never silent: it is in every plan's report."""

    SATURATED = "saturated"
    ITERATION_LIMIT = "iteration limit"
    NODE_LIMIT = "node limit"
    TIME_LIMIT = "time limit"


@dataclass(frozen=True)
class Limits:
    """Bounds on the search.

    iterations: rule-application rounds of the saturation loop.
    nodes: e-nodes in the e-graph; the loop stops once this many exist.
    seconds: wall time of saturation plus extraction.
    exact_seconds: wall time the exact integer program may take (extraction="exact"; "auto" gives
      it at most 2 s), within `seconds`. Its relaxation is weak on big e-graphs: where it has not
      proven a plan optimal by then, it rarely does within minutes.
    """

    iterations: int = 1000
    nodes: int = 5_000_000
    seconds: float = 120.0
    exact_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.nodes < 1 or self.seconds <= 0 or not self.exact_seconds > 0:
            raise InvalidArgumentError(
                f"Limits must be positive, got {self}. Consider the defaults: shardsat.Limits()."
            )
