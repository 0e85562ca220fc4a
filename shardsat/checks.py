"""Small checks of user-given numbers and flags, shared by Limits, DeviceProfile, register_signature
and saturate_and_extract's options. Each returns None when the value is fine, else the reason it is
not (a phrase that completes "must be ..."), so callers can collect several into one message."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np
from jax.sharding import Mesh

from .errors import InvalidMeshError, UnknownKeywordError

P = ParamSpec("P")
R = TypeVar("R")


def require_mesh(mesh: Any, what: str, consider: str = "the mesh you plan for") -> None:
    """InvalidMeshError unless `mesh` is a jax.sharding.Mesh (an AbstractMesh has no devices to run on)."""
    if not isinstance(mesh, Mesh):
        raise InvalidMeshError(f"{what} needs a jax.sharding.Mesh, got {type(mesh).__name__}. Consider "
                               f"{consider}, e.g. jax.make_mesh((2, 4), ('data', 'model')).")


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


def known_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, refusing a keyword it does not take with an UnknownKeywordError that names the
    closest it does take: Python's own TypeError names no fix, and a misspelt option
    (`state_argnum=`) is a common slip in a long call."""
    params = inspect.signature(fn).parameters.values()
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fn

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise UnknownKeywordError(_unknown_keyword(fn.__name__, unknown[0], names))
        return fn(*args, **kwargs)
    return checked


def _unknown_keyword(name: str, key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    fix = f"Did you mean {close[0]}=?" if close else f"Consider one of: {', '.join(names)}."
    return f"{name}() got an unexpected keyword argument {key!r}. {fix}"
