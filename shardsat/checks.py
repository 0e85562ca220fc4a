"""Small checks of user-given numbers and flags, shared by Limits, DeviceProfile, register_signature
and saturate_and_extract's options. Each returns None when the value is fine, else the reason it is
not (a phrase that completes "must be ..."), so callers can collect several into one message."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def is_bool(x: Any) -> bool:
    """Python and numpy booleans (bool is an int subclass: most checks must rule it out first)."""
    return isinstance(x, bool | np.bool_)


def integer(x: Any, minimum: int = 1) -> int | None:
    """x as an int if it is an integer (or an integral finite float such as 1e6) >= minimum."""
    if is_bool(x) or not isinstance(x, numbers.Real):
        return None
    if isinstance(x, numbers.Integral):
        n = int(x)
    else:
        f = float(x)
        if not math.isfinite(f) or f != int(f):
            return None
        n = int(f)
    return n if n >= minimum else None


def real(x: Any, *, positive: bool = True) -> float | None:
    """x as a float if it is a finite real number, > 0 (positive) or >= 0."""
    if is_bool(x) or not isinstance(x, numbers.Real):
        return None
    f = float(x)
    if not math.isfinite(f) or f < 0 or (positive and f == 0):
        return None
    return f


def integer_problem(label: str, x: Any, minimum: int = 1) -> str | None:
    """Why `x` is not an integer >= minimum, or None."""
    if integer(x, minimum) is not None:
        return None
    return f"{label} must be an integer >= {minimum}, got {x!r}"


def real_problem(label: str, x: Any, *, positive: bool = True) -> str | None:
    """Why `x` is not a finite positive (or non-negative) number, or None."""
    if real(x, positive=positive) is not None:
        return None
    return f"{label} must be a finite {'positive' if positive else 'non-negative'} number, got {x!r}"


def optional_bool_problem(label: str, x: Any) -> str | None:
    """Why `x` is not True, False or None, or None."""
    if x is None or is_bool(x):
        return None
    return f"{label} must be True, False or None, got {type(x).__name__} {x!r}. Consider {label}=True"
