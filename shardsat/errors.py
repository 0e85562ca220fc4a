"""One exception family for everything a user can get wrong or hit.

Messages follow shard_map's style: say what was wrong, where (primitive, source line, pytree path,
shape, mesh axis), and end with a "Consider ..." fix.
"""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning]) -> None:
    """Warn at the user's line: the first frame outside shardsat, however deep in it the warning
    is raised (a fixed stacklevel breaks whenever a call path gains or loses a frame)."""
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class ShardsatError(Exception):
    """Base class of every error shardsat raises on purpose."""


class UnsupportedPrimitiveError(ShardsatError):
    """A primitive has no sharding rule (unknown, or listed as unsupported)."""

    def __init__(self, primitive: str, source: str, reason: str | None = None) -> None:
        self.primitive = primitive
        self.source = source
        self.reason = reason
        why = f" ({reason})" if reason else ""
        super().__init__(
            f"shardsat has no sharding rule for primitive `{primitive}`{why}, used at {source}.\n"
            "Consider shardsat.register_signature() to teach shardsat how it shards, or leave out "
            "strict=True / fallback='error' to keep this equation replicated (reported in the plan)."
        )


class InvalidSignatureError(ShardsatError):
    """A factor signature is malformed (unknown factor, arity or rank mismatch, bad size)."""


class InvalidMeshError(ShardsatError):
    """The mesh cannot be planned for (no axes, duplicate names, ...)."""


class InvalidArgumentError(ShardsatError):
    """An argument to the public API is malformed."""


class UnknownKeywordError(InvalidArgumentError, TypeError):
    """A keyword argument the function does not take (a TypeError too, as Python's own is)."""


class NoPlanError(ShardsatError):
    """Extraction found no plan (e.g. every plan breaks a constraint)."""


class StoppedEarlyError(NoPlanError):
    """No plan, and saturation stopped at a limit (nodes, time, iterations) before it was done:
    a bigger budget, or fewer layouts per value (priors=), may find one."""


class SavedPlanMismatch(ShardsatError):
    """A saved plan is for another program, mesh or argument types than the ones given, or was
    written by a shardsat that saves plans differently."""


class ShardsatWarning(UserWarning):
    """Base class of every warning shardsat gives (filter them all with this); also used alone
    for what fits no narrower class: a cached plan that does not load, a profile naming axes the
    mesh lacks."""


class MemoryLimitWarning(ShardsatWarning):
    """No plan found fits the device's memory (the default memory_limit); the smallest is returned."""


class ConstraintWarning(ShardsatWarning):
    """A with_sharding_constraint in the function places a value as no layout of the plan's mesh
    does (a mesh over other devices, or the same devices in an order no layout matches): no plan
    can keep it, so it is dropped and the value placed freely (the plan lists it)."""


class FallbackWarning(ShardsatWarning):
    """Equations no sharding rule applies to were kept replicated (the plan lists them)."""
