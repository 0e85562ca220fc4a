"""Running one equation on shards (inside shard_map): the params that name global sizes are
rewritten to the local sizes the plan's layouts give, and the result's shape is checked.

Only params that state sizes change (each primitive's PrimitiveRule.localize says how); a
dimension the signature lets the plan split is one the primitive does not slice, pad or index
into, so its local size is all that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ShardsatError
from ..rules.registry import rule_for

Shape = tuple[int, ...]


GLOBAL_SHARDING = ("sharding", "out_sharding")


def local_params(
    primitive: Any,  # the Primitive, or its name
    params: dict[str, Any],
    ins: list[tuple[Shape, Shape]],  # (global, local) shape of each operand
    outs: list[tuple[Shape, Shape]],  # (global, local) shape of each result
) -> dict[str, Any]:
    # a result sharding traced under the plan's mesh names its global (Auto) axes; inside
    # shard_map the axes are Manual and the result is a local block: no sharding to give
    params = {k: None if k in GLOBAL_SHARDING and v is not None else v for k, v in params.items()}
    fn = rule_for(primitive).localize
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
