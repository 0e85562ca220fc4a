"""Lowering a plan to `jax.jit`: the program is re-run equation by equation with a sharding
constraint wherever the plan fixes a layout (each produced value, and each operand a consumer
needs in another layout), so XLA's SPMD partitioner inserts the plan's collectives there.
Pending partial sums have no NamedSharding; they are left unconstrained and summed where the
next constrained layout needs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from ..egraph.layout import Layout, MeshAxes
from ..egraph.program import Literal, Program


@dataclass(frozen=True)
class EqnRun:
    """One bind of an equation with one strategy: operand layouts and the outputs it yields."""

    eqn: int
    operand_layouts: tuple[int, ...]  # per non-literal operand
    outputs: tuple[tuple[int, int], ...]  # (output index, produced layout)


def make_interpreter(
    program: Program,
    runs: list[EqnRun],
    produced: dict[int, int],  # value id -> produced layout
    parent: dict[tuple[int, int], int],  # (value id, layout) -> the layout it is resharded from
    layouts: list[Layout],
    axes: MeshAxes,
    mesh: Mesh,
) -> Callable[..., list[Any]]:
    shardings: dict[int, NamedSharding] = {}

    def sharding(lid: int) -> NamedSharding | None:
        lay = layouts[lid]
        if lay.partial:
            return None
        s = shardings.get(lid)
        if s is None:
            s = shardings[lid] = NamedSharding(mesh, lay.spec(axes))
        return s

    def constrain(x: Any, lid: int) -> Any:
        s = sharding(lid)
        return x if s is None else jax.lax.with_sharding_constraint(x, s)

    def interpret(*flat_args: Any) -> list[Any]:
        env: dict[int, Any] = {}
        for vid, x in zip(program.args, flat_args, strict=True):
            env[vid] = x
        for vid in program.const_values:
            info = program.values[vid]
            x = program.consts[info.const]  # type: ignore[index]
            env[vid] = constrain(x, produced[vid]) if vid in produced else x
        views: dict[tuple[int, int], Any] = {}

        def view(vid: int, lid: int) -> Any:
            # Walk the plan's resharding tree one collective at a time, constraining every
            # intermediate layout, so XLA emits the plan's collectives and not its own guess.
            if produced.get(vid) == lid:
                return env[vid]
            k = (vid, lid)
            if k not in views:
                src = parent.get(k)
                base = env[vid] if src is None else view(vid, src)
                views[k] = constrain(base, lid)
            return views[k]

        for run in runs:
            eqn = program.equations[run.eqn]
            operands = []
            it = iter(run.operand_layouts)
            for a in eqn.inputs:
                operands.append(a.value if isinstance(a, Literal) else view(a, next(it)))
            outs = eqn.primitive.bind(*operands, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for k, lid in run.outputs:
                env[eqn.outputs[k]] = constrain(outs[k], lid)
        return [o.value if isinstance(o, Literal) else env[o] for o in program.outputs]

    return interpret
