"""What one fuzz case came to. jax-free: the campaign's parent process reads these without
importing jax."""

from __future__ import annotations

from dataclasses import dataclass, field

# In order of severity: a case's outcome is the worst thing that happened to it.
OUTCOMES = ("ok", "fallback", "remat", "error", "crash", "mismatch", "timeout", "invalid")
PASSING = ("ok", "fallback")


@dataclass
class Outcome:
    """One case's result. `reason` is one line (exception type and message's first line, or what
    differed); `location` the innermost shardsat frame (file:function) of a crash or error."""

    seed: int
    outcome: str
    mesh: str = ""
    options: str = ""
    family: str = ""
    reason: str = ""
    location: str = ""
    detail: str = ""  # the traceback, or every differing output
    phase: str = ""  # where it happened: generate, reference, plan, run, compare
    plan_s: float | None = None
    total_s: float = 0.0
    fallbacks: list[str] = field(default_factory=list)
    remat: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def reproducer(self) -> str:
        return f".venv/bin/python -m fuzz --only {self.seed}"
