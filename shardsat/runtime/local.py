"""Running one equation on shards (inside shard_map): the params that name global sizes are
rewritten to the local sizes the plan's layouts give, and the result's shape is checked.

Only params that state sizes change; a dimension the signature lets the plan split is one the
primitive does not slice, pad or index into, so its local size is all that differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ShardsatError

Shape = tuple[int, ...]


def _replace_full(sizes: Sequence[int], global_shape: Shape, local_shape: Shape) -> tuple[int, ...]:
    """Entries equal to a split dimension's global size become its local size."""
    out = []
    for s, g, loc in zip(sizes, global_shape, local_shape, strict=True):
        out.append(loc if (g != loc and s == g) else s)
    return tuple(out)


def _shape_param(name: str) -> Callable[..., dict[str, Any]]:
    def fn(params: dict[str, Any], ins: list[tuple[Shape, Shape]], outs: list[tuple[Shape, Shape]]) -> dict[str, Any]:
        return {**params, name: tuple(outs[0][1])}

    return fn


def _operand_sizes(name: str) -> Callable[..., dict[str, Any]]:
    def fn(params: dict[str, Any], ins: list[tuple[Shape, Shape]], outs: list[tuple[Shape, Shape]]) -> dict[str, Any]:
        g, loc = ins[0]
        return {**params, name: _replace_full(params[name], g, loc)}

    return fn


LOCALIZE: dict[str, Callable[..., dict[str, Any]]] = {
    "broadcast_in_dim": _shape_param("shape"),
    "reshape": _shape_param("new_sizes"),
    "iota": _shape_param("shape"),
    "slice": _operand_sizes("limit_indices"),
    "dynamic_slice": _operand_sizes("slice_sizes"),
    "gather": _operand_sizes("slice_sizes"),
}


GLOBAL_SHARDING = ("sharding", "out_sharding")


def local_params(
    name: str,
    params: dict[str, Any],
    ins: list[tuple[Shape, Shape]],  # (global, local) shape of each operand
    outs: list[tuple[Shape, Shape]],  # (global, local) shape of each result
) -> dict[str, Any]:
    # a result sharding traced under the plan's mesh names its global (Auto) axes; inside
    # shard_map the axes are Manual and the result is a local block: no sharding to give
    params = {k: None if k in GLOBAL_SHARDING and v is not None else v for k, v in params.items()}
    fn = LOCALIZE.get(name)
    if fn is None:
        return params
    return fn(params, ins, outs)


def check_local(name: str, source: str, got: Sequence[Any], outs: list[tuple[Shape, Shape]]) -> None:
    for k, (x, (_, want)) in enumerate(zip(got, outs, strict=True)):
        if tuple(x.shape) != tuple(want):
            raise ShardsatError(
                f"Internal error: `{name}` at {source} run on shards gave result {k} of shape "
                f"{tuple(x.shape)}, but the plan's layout needs {tuple(want)}. Consider "
                "fallback='replicate' for this primitive and report the program."
            )
