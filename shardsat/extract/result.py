"""What extraction produces: one production per used value and the resharding tree to each
layout its consumers need. A plan is exactly this DAG of local ops and collectives."""

from __future__ import annotations

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
class Extraction:
    choices: dict[int, GroupChoice]  # group -> choice, for used groups
    root_layouts: list[int | None]  # per flat output: layout (None for literal outputs)
    total_s: float
    method: str
    seconds: float
    sweeps: int = 0
    notes: list[str] = field(default_factory=list)
    gap: float | None = None  # relative optimality gap: the exact solver's, else against lower_bound_s
    lower_bound_s: float | None = None  # no plan of the e-graph costs less (extract/bound.py, extract/splitbound.py)
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
