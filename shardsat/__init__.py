"""shardsat: automatic sharding of JAX programs by equality saturation.

    plan = shardsat.saturate_and_extract(fn, mesh, *example_args)
    out = plan.jit()(*args)
    print(plan.explain())
    plan.save("plan.json"); plan = shardsat.load_plan("plan.json", fn, mesh, *example_args)
"""

# First: egglog's thread pool is sized when egglog is imported (see threads.py).
from . import threads as _threads  # noqa: F401
from .api import saturate_and_extract
from .egraph.rewrite import Rewrite
from .errors import (
    ConstraintWarning,
    FallbackWarning,
    InvalidArgumentError,
    InvalidMeshError,
    InvalidSignatureError,
    MemoryLimitWarning,
    NoPlanError,
    SavedPlanMismatch,
    ShardsatError,
    ShardsatWarning,
    StoppedEarlyError,
    UnknownKeywordError,
    UnsupportedPrimitiveError,
)
from .extract.profile import PRESETS, DeviceProfile
from .limits import Limits, StopReason
from .rules.user import SignatureRule, register_signature
from .runtime.plan import Collective, Plan, PlanCost, Report
from .saved import load_plan

__all__ = [
    "PRESETS",
    "Collective",
    "ConstraintWarning",
    "DeviceProfile",
    "FallbackWarning",
    "InvalidArgumentError",
    "InvalidMeshError",
    "InvalidSignatureError",
    "Limits",
    "MemoryLimitWarning",
    "NoPlanError",
    "Plan",
    "PlanCost",
    "Report",
    "Rewrite",
    "SavedPlanMismatch",
    "ShardsatError",
    "ShardsatWarning",
    "SignatureRule",
    "StopReason",
    "StoppedEarlyError",
    "UnknownKeywordError",
    "UnsupportedPrimitiveError",
    "load_plan",
    "register_signature",
    "saturate_and_extract",
]

__version__ = "0.1.0"
