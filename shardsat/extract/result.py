"""What extraction produces: one production per used value and the resharding tree to each
layout its consumers need. A plan is exactly this DAG of local ops and collectives."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..egraph.export import NodeKind

if TYPE_CHECKING:
    from .planstate import PlanState


@dataclass(frozen=True)
class ReshardStep:
    kind: NodeKind
    src: int  # layout id
    dst: int  # layout id
    axes: tuple[int, ...]
    dim: int
    dim2: int
    seconds: float
    moved_bytes: float
    buffer_bytes: int


@dataclass
class GroupChoice:
    group: int
    node: int  # production e-node
    layout: int  # layout the production yields
    demanded: tuple[int, ...]  # layout ids needed by consumers and outputs
    steps: list[ReshardStep] = field(default_factory=list)
    node_seconds: float = 0.0  # the production's seconds per step (weighted)
    weight: float = 1.0  # executions per step: a scan body's values run once per iteration


@dataclass
class Bound:
    """A plan's lower bound and gap, or what computes them on first read (`pending`: the lower
    bound): nothing in planning reads them, and on a training step the bound's agreement rounds
    took a quarter of planning (issue 17), for a number only the report shows. The plan, its
    report and a plan fitted under a memory limit share one."""

    gap: float | None = None  # relative optimality gap: the exact solver's, else against lower_bound_s
    lower_bound_s: float | None = None  # no plan of the e-graph costs less (extract/bound.py, extract/splitbound.py)
    pending: Callable[[], float | None] | None = field(default=None, repr=False)
    total_s: float = 0.0  # the plan's cost the pending bound's gap is of
    seconds: float = 0.0  # how long computing it took

    def defer(self, lower: Callable[[], float | None], total_s: float) -> None:
        self.pending, self.total_s = lower, total_s

    def settle(self) -> Bound:
        """Compute the pending bound, once."""
        if self.pending is not None:
            lower, self.pending = self.pending, None
            t = time.perf_counter()
            self.set_lower(lower(), self.total_s)
            self.seconds = time.perf_counter() - t
        return self

    def set_lower(self, lower: float | None, total_s: float) -> None:
        """The lower bound, and a plan of cost `total_s`'s gap against it."""
        self.pending = None
        self.lower_bound_s = lower
        self.gap = None if lower is None else max(0.0, (total_s - lower) / total_s) if total_s > 0 else 0.0


class HasBound:
    """`gap` and `lower_bound_s` read through a Bound (computed on first read); setting either
    drops a pending bound."""

    bound: Bound

    @property
    def gap(self) -> float | None:
        return self.bound.settle().gap

    @gap.setter
    def gap(self, value: float | None) -> None:
        self.bound.pending = None
        self.bound.gap = value

    @property
    def lower_bound_s(self) -> float | None:
        return self.bound.settle().lower_bound_s

    @lower_bound_s.setter
    def lower_bound_s(self, value: float | None) -> None:
        self.bound.pending = None
        self.bound.lower_bound_s = value


@dataclass
class Extraction(HasBound):
    choices: dict[int, GroupChoice]  # group -> choice, for used groups
    root_layouts: list[int | None]  # per flat output: layout (None for literal outputs)
    total_s: float
    method: str
    seconds: float
    sweeps: int = 0
    notes: list[str] = field(default_factory=list)
    bound: Bound = field(default_factory=Bound, repr=False)  # gap and lower_bound_s (HasBound)
    alternatives: dict[int, tuple[int, float]] = field(default_factory=dict)  # group -> (layout, extra s)
    carry_layouts: dict[int, int] = field(default_factory=dict)  # scan carry-input value -> tied layout
    state: PlanState | None = field(default=None, repr=False)  # the greedy search's final plan, for explain()
    exact_status: str | None = None
    # computes `alternatives` on first use: they cost a pass over the plan that only
    # plan.explain() reads
    explainer: Callable[[Extraction], None] | None = field(default=None, repr=False)

    def why_not(self) -> dict[int, tuple[int, float]]:
        """The "next best" alternatives per value group, computed on first use."""
        if self.explainer is not None:
            explainer, self.explainer = self.explainer, None
            explainer(self)
        return self.alternatives
