"""Stage 4: a Plan and its lowering to sharded XLA."""

from .hlo import count_collectives
from .plan import Collective, Plan, PlanCost, Report

__all__ = ["Collective", "Plan", "PlanCost", "Report", "count_collectives"]
