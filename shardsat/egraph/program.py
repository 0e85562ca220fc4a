"""The program IR: a flat, inlined list of jaxpr equations over numbered values.

Tracing goes through `jax.make_jaxpr`; nested call primitives (`jit`/`pjit`, `closed_call`,
`custom_jvp_call`, `custom_vjp_call`, `checkpoint`) are inlined so that sharding decisions can cross
function boundaries. Everything later in the pipeline refers to values by their integer id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from ..errors import InvalidArgumentError

# Primitives whose body is inlined. Their outputs are exactly their body's outputs.
CALL_PRIMITIVES = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "checkpoint",
        "remat",
        "remat2",
        "name",
    }
)
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclass(frozen=True)
class Literal:
    """A scalar literal operand of an equation (jaxpr Literal)."""

    value: Any
    dtype: np.dtype

    def __repr__(self) -> str:
        return f"{self.value!r}:{self.dtype}"


Atom = int | Literal


@dataclass(frozen=True)
class ValueInfo:
    """A logical (global) tensor. `producer` is the equation index, or None for inputs/consts."""

    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    producer: int | None = None
    output_index: int = 0
    arg: int | None = None  # flat argument position, for inputs
    const: int | None = None  # index into Program.consts, for closed-over constants

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize(self.dtype)


@dataclass
class Equation:
    index: int
    primitive: jcore.Primitive
    params: dict[str, Any]
    inputs: tuple[Atom, ...]
    outputs: tuple[int, ...]
    source: str
    scope: str = ""

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass
class Program:
    """A traced function: flat inputs, equations in topological order, flat outputs."""

    values: list[ValueInfo]
    equations: list[Equation]
    args: list[int]  # value id of each flat argument leaf
    consts: list[Any]  # closed-over constant arrays (value ids via ValueInfo.const)
    const_values: list[int]
    outputs: list[Atom]
    in_tree: Any  # treedef of the positional-args tuple
    out_tree: Any
    arg_paths: list[str]
    out_paths: list[str]
    arg_counts: list[int] = field(default_factory=list)  # flat leaves per positional arg
    name: str = "fn"

    def consumers(self) -> list[list[tuple[int, int]]]:
        """For each value: the (equation index, operand position) pairs that read it."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.values]
        for eqn in self.equations:
            for pos, a in enumerate(eqn.inputs):
                if isinstance(a, int):
                    out[a].append((eqn.index, pos))
        return out

    def shape(self, atom: Atom) -> tuple[int, ...]:
        return () if isinstance(atom, Literal) else self.values[atom].shape


def itemsize(dtype: Any) -> int:
    """Bytes per element; extended dtypes (PRNG keys) count their underlying words."""
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 8) or 8)


def is_extended(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    try:
        arr = jax.numpy.asarray(x)
    except TypeError as e:
        raise InvalidArgumentError(
            f"Example argument {x!r} of type {type(x).__name__} is not an array. "
            "Consider passing arrays or jax.ShapeDtypeStruct leaves, and binding static "
            "arguments with functools.partial."
        ) from e
    return jax.ShapeDtypeStruct(arr.shape, arr.dtype)


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path)


def trace(fn: Callable[..., Any], args: Sequence[Any]) -> Program:
    """Trace `fn(*args)` into a Program (args may hold arrays or ShapeDtypeStructs)."""
    args = tuple(args)
    abstract = jax.tree_util.tree_map(_abstract, args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract)
    leaves_with_path, in_tree = jax.tree_util.tree_flatten_with_path(abstract)
    arg_paths = [f"args{_path_str(p)}" for p, _ in leaves_with_path]
    arg_counts = [len(jax.tree_util.tree_leaves(a)) for a in abstract]
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    out_paths = [f"out{_path_str(p)}" for p, _ in out_leaves]
    builder = _Builder()
    jaxpr = closed.jaxpr
    arg_ids = [builder.new_value(v.aval, arg=i) for i, v in enumerate(jaxpr.invars)]
    const_ids = [builder.new_const(v.aval, c) for v, c in zip(jaxpr.constvars, closed.consts, strict=True)]
    env = dict(zip(jaxpr.invars, arg_ids, strict=True)) | dict(zip(jaxpr.constvars, const_ids, strict=True))
    outs = builder.inline(jaxpr, env)
    return Program(
        values=builder.values,
        equations=builder.equations,
        args=arg_ids,
        consts=builder.consts,
        const_values=builder.const_ids,
        outputs=outs,
        in_tree=in_tree,
        out_tree=out_tree,
        arg_paths=arg_paths,
        out_paths=out_paths,
        arg_counts=arg_counts,
        name=getattr(fn, "__name__", "fn"),
    )


class _Builder:
    def __init__(self) -> None:
        self.values: list[ValueInfo] = []
        self.equations: list[Equation] = []
        self.consts: list[Any] = []
        self.const_ids: list[int] = []

    def new_value(self, aval: Any, **kw: Any) -> int:
        vid = len(self.values)
        self.values.append(ValueInfo(vid, tuple(int(d) for d in aval.shape), aval.dtype, **kw))
        return vid

    def new_const(self, aval: Any, value: Any) -> int:
        vid = self.new_value(aval, const=len(self.consts))
        self.consts.append(value)
        self.const_ids.append(vid)
        return vid

    def atom(self, v: Any, env: dict[Any, int]) -> Atom:
        if isinstance(v, jcore.Literal):
            return Literal(v.val, v.aval.dtype)
        return env[v]

    def inline(self, jaxpr: jcore.Jaxpr, env: dict[Any, int]) -> list[Atom]:
        for eqn in jaxpr.eqns:
            ins = [self.atom(v, env) for v in eqn.invars]
            body = _call_body(eqn)
            if body is not None:
                inner, consts = body
                inner_env: dict[Any, int] = {}
                for v, c in zip(inner.constvars, consts, strict=True):
                    inner_env[v] = self.new_const(v.aval, c)
                n_in = len(inner.invars)
                for v, a in zip(inner.invars, ins[len(ins) - n_in :], strict=True):
                    if isinstance(a, Literal):
                        a = self._materialize_literal(a, v.aval)
                    inner_env[v] = a
                outs = self.inline(inner, inner_env)
                for v, o in zip(eqn.outvars, outs, strict=True):
                    if isinstance(o, Literal):
                        o = self._materialize_literal(o, v.aval)
                    env[v] = o
                continue
            idx = len(self.equations)
            out_ids = [self.new_value(v.aval, producer=idx, output_index=k) for k, v in enumerate(eqn.outvars)]
            self.equations.append(
                Equation(
                    index=idx,
                    primitive=eqn.primitive,
                    params=dict(eqn.params),
                    inputs=tuple(ins),
                    outputs=tuple(out_ids),
                    source=source_info_util.summarize(eqn.source_info),
                    scope=str(eqn.source_info.name_stack),
                )
            )
            for v, o in zip(eqn.outvars, out_ids, strict=True):
                env[v] = o
        return [self.atom(v, env) for v in jaxpr.outvars]

    def _materialize_literal(self, lit: Literal, aval: Any) -> int:
        """A literal that crosses a call boundary becomes a constant value."""
        return self.new_const(aval, np.asarray(lit.value, dtype=lit.dtype))


def _call_body(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, list[Any]] | None:
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    for name in _BODY_PARAMS:
        body = eqn.params.get(name)
        if isinstance(body, jcore.ClosedJaxpr):
            return body.jaxpr, list(body.consts)
        if isinstance(body, jcore.Jaxpr):
            return body, []
    return None
