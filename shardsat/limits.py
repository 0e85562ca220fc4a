"""Search limits and the typed reason a search stopped (as in egg's run.rs)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .checks import integer, integer_problem, real, real_problem
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
    nodes: e-nodes in the e-graph; saturation stops once this many exist (with user rulesets,
      also before a round its growth predicts would pass this many).
    seconds: wall time of saturation plus extraction (with user rulesets, saturation also stops
      before a round predicted to leave no time to export the e-graph).
    exact_seconds: wall time the exact integer program may take (extraction="exact"; "auto" gives
      it at most 2 s), within `seconds`. Its relaxation is weak on big e-graphs: where it has not
      proven a plan optimal by then, it rarely does within minutes.
    """

    iterations: int = 1000
    nodes: int = 5_000_000
    seconds: float = 120.0
    exact_seconds: float = 10.0

    def __post_init__(self) -> None:
        # checked one by one and reported together: NaN and inf compare False with everything,
        # so `x < 1` style checks let them through, and a float round count never ends a loop
        problems = [p for p in (integer_problem("iterations", self.iterations),
                                integer_problem("nodes", self.nodes),
                                real_problem("seconds", self.seconds),
                                real_problem("exact_seconds", self.exact_seconds)) if p]
        if problems:
            raise InvalidArgumentError(
                f"shardsat.Limits: {'; '.join(problems)}. Consider the defaults, shardsat.Limits() "
                "(iterations=1000, nodes=5_000_000, seconds=120.0, exact_seconds=10.0), or whole numbers such as "
                "Limits(iterations=50, nodes=1_000_000, seconds=30)."
            )
        # integral floats (nodes=1e6) are kept as ints: the search compares and counts with them
        object.__setattr__(self, "iterations", integer(self.iterations))
        object.__setattr__(self, "nodes", integer(self.nodes))
        object.__setattr__(self, "seconds", real(self.seconds))
        object.__setattr__(self, "exact_seconds", real(self.exact_seconds))
