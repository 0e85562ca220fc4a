"""Content keys of equations: primitive, params, operand and result types, literal operands.

Equations with equal keys compute the same function of their operands, so they share one set of
strategy rows, hash-cons into one e-class when their operands are equal, and mark the repeats
of an unrolled loop (egraph/fold.py). Keys must be equal across processes, so nothing in them
may depend on memory addresses: functions are named by module, qualname and line (with their
closures and defaults), jaxprs by their printed text, pytree structures and Shardy rules by
their text. Params whose equality cannot be trusted make a key unique to its equation.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import re
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from .program import Equation, Literal, Program


def _canon(x: Any) -> str | None:
    """A deterministic text for simple params; None where equality cannot be trusted."""
    if x is None or isinstance(x, bool | int | float | complex | str):
        return repr(x)
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if isinstance(x, np.dtype | type) or type(x).__name__ in ("dtype", "DType"):
        return str(x)
    if isinstance(x, tuple | list):
        parts = [_canon(v) for v in x]
        return None if any(p is None for p in parts) else "(" + ",".join(parts) + ")"  # type: ignore[arg-type]
    if isinstance(x, frozenset | set):
        parts = sorted(_canon(v) or "?" for v in x)
        return "{" + ",".join(parts) + "}"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _canon(tuple((f.name, getattr(x, f.name)) for f in dataclasses.fields(x)))
    if isinstance(x, np.ndarray) and x.size <= 16:
        return repr(x.tolist()) + str(x.dtype)
    if isinstance(x, np.generic):
        return repr(x.item()) + str(x.dtype)
    if isinstance(x, types.FunctionType | types.MethodType | functools.partial):
        return _canon_callable(x)
    if hasattr(x, "operand_mappings") and hasattr(x, "result_mappings"):  # Shardy's SdyShardingRule
        return _canon((type(x).__name__, tuple(x.operand_mappings), tuple(x.result_mappings),
                       tuple(sorted(dict(x.factor_sizes).items())), tuple(x.reduction_factors),
                       tuple(x.need_replication_factors), tuple(getattr(x, "permutation_factors", ()))))
    try:
        import jax
        from jax.extend import core as jcore

        if isinstance(x, jax.sharding.PartitionSpec | jax.sharding.NamedSharding):
            return str(x)
        if isinstance(x, jcore.ClosedJaxpr):
            consts = _canon(tuple(x.consts))
            return None if consts is None else _no_address(f"{x.jaxpr}|{consts}")
        if isinstance(x, jcore.Jaxpr) or type(x).__name__ == "PyTreeDef":
            return _no_address(str(x))
        if hasattr(x, "dtype") and hasattr(x, "shape") and np.size(x) <= 16:
            return repr(np.asarray(x).tolist()) + str(x.dtype)
    except Exception:  # pragma: no cover - defensive
        return None
    return None


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_ACTIVE: set[int] = set()  # callables being canonicalised (a closure may hold its own function)


def _no_address(text: str) -> str | None:
    """The text, unless it shows a memory address (then it differs between processes)."""
    return None if _ADDRESS.search(text) else text


def _canon_callable(f: Any) -> str | None:
    """A function by module, qualname and first line, plus its defaults and closure values (two
    closures of one factory are different functions); a partial by its function and arguments."""
    if isinstance(f, functools.partial):
        return _canon(("partial", f.func, f.args, tuple(sorted(f.keywords.items()))))
    if isinstance(f, types.MethodType):
        return _canon(("method", f.__func__, f.__self__))
    code = getattr(f, "__code__", None)
    name = f"{getattr(f, '__module__', None)}.{getattr(f, '__qualname__', None)}:{getattr(code, 'co_firstlineno', 0)}"
    if id(f) in _ACTIVE:
        return name
    _ACTIVE.add(id(f))
    try:
        cells = tuple(c.cell_contents for c in f.__closure__ or ())
    except ValueError:  # an empty cell
        return None
    try:
        rest = _canon((f.__defaults__ or (), tuple(sorted((f.__kwdefaults__ or {}).items())), cells))
    finally:
        _ACTIVE.discard(id(f))
    return None if rest is None else f"fn:{name}{rest}"


_TYPE_TEXT: dict[tuple[tuple[int, ...], Any], str] = {}


def _type_text(shape: tuple[int, ...], dtype: Any) -> str:
    """`dtype[shape]`, memoised: a deep program has a few hundred distinct operand types."""
    key = (tuple(shape), dtype)
    try:
        hit = _TYPE_TEXT.get(key)
    except TypeError:  # an unhashable extended dtype
        return f"{dtype}{list(shape)}"
    if hit is None:
        hit = _TYPE_TEXT[key] = f"{dtype}{list(shape)}"
    return hit


def equation_key(eqn: Equation, in_shapes: Sequence[tuple[int, ...]], in_dtypes: Sequence[Any],
                 out_shapes: Sequence[tuple[int, ...]], out_dtypes: Sequence[Any], literal: Sequence[bool],
                 literal_values: Sequence[Any]) -> str:
    parts = [eqn.name]
    unique = False
    for k in sorted(eqn.params):
        c = _canon(eqn.params[k])
        if c is None:
            unique = True
            c = "?"
        parts.append(f"{k}={c}")
    parts.append(",".join([_type_text(s, d) for s, d in zip(in_shapes, in_dtypes, strict=True)]))
    parts.append(",".join([_type_text(s, d) for s, d in zip(out_shapes, out_dtypes, strict=True)]))
    parts.append(repr([(i, _canon(v), str(d)) for i, (lit, v, d) in enumerate(
        zip(literal, literal_values, in_dtypes, strict=True)) if lit]))
    if unique or eqn.effects:  # params we cannot compare, or side effects: never merge with another
        parts.append(f"@{eqn.index}")
    digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
    name = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in eqn.name)
    return f"{name}:{digest}"


def operand_types(prog: Program, inputs: Sequence[Any]) -> tuple[list, list, list, list]:
    """(shapes, dtypes, is-literal, literal values) of an equation's operands."""
    in_shapes, in_dtypes, lits, litv = [], [], [], []
    for a in inputs:
        if isinstance(a, Literal):
            in_shapes.append(tuple(np.shape(a.value)))
            in_dtypes.append(a.dtype)
            lits.append(True)
            litv.append(a.value)
        else:
            in_shapes.append(prog.values[a].shape)
            in_dtypes.append(prog.values[a].dtype)
            lits.append(False)
            litv.append(None)
    return in_shapes, in_dtypes, lits, litv


def program_key(prog: Program, eqn: Equation) -> str:
    """equation_key from the program's value types (cached on the equation)."""
    if eqn.key is not None:
        return eqn.key
    in_shapes, in_dtypes, lits, litv = operand_types(prog, eqn.inputs)
    outs = [prog.values[o] for o in eqn.outputs]
    eqn.key = equation_key(eqn, in_shapes, in_dtypes, [v.shape for v in outs], [v.dtype for v in outs], lits, litv)
    return eqn.key
