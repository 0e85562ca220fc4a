"""Lowering a plan to `jax.jit`.

The program is re-run equation by equation. Where every layout involved is an ordinary sharding,
the equation runs on global arrays with a sharding constraint on its result and on each operand
the plan reshards (one constraint per collective of the plan's resharding tree), so XLA's SPMD
partitioner emits the plan's collectives. A pending partial sum has no NamedSharding, so
equations that produce or consume one, and the collectives that sum it, run inside `shard_map`
on shards, with the pending sum carried between them as a stacked array (a leading dimension
split over the partial axes, one slot per device): XLA then has no choice to make there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..egraph.export import NodeKind
from ..egraph.layout import Layout, MeshAxes
from ..egraph.program import Literal, Program
from .local import check_local, local_params

PINS = frozenset({"sharding_constraint", "reshard"})


@dataclass(frozen=True)
class EqnRun:
    """One bind of an equation with one strategy: operand layouts and the outputs it yields."""

    eqn: int
    operand_layouts: tuple[int, ...]  # per non-literal operand
    outputs: tuple[tuple[int, int], ...]  # (output index, produced layout)


@dataclass(frozen=True)
class Step:
    """One collective of a resharding tree: (kind, axes, dim, dim2) from layout src."""

    src: int
    kind: NodeKind
    axes: tuple[int, ...]
    dim: int
    dim2: int


def _axis_index(ax: tuple[int, ...], axes: MeshAxes) -> Any:
    """Linear index of this device over `ax` (major first), inside shard_map."""
    idx = 0
    for a in ax:
        idx = idx * axes.sizes[a] + jax.lax.axis_index(axes.names[a])
    return idx


def apply_collective(v: Any, step: Step, axes: MeshAxes, cpu: bool = False) -> Any:
    """One resharding step on a local shard, inside shard_map: the plan's collective written out."""
    ax = tuple(axes.names[a] for a in step.axes)
    n = math.prod(axes.sizes[a] for a in step.axes)
    if step.kind == NodeKind.ALL_REDUCE:
        return jax.lax.psum(v, ax)
    if step.kind == NodeKind.REDUCE_SCATTER and cpu:
        # XLA:CPU has no native reduce-scatter on minor dimensions (it becomes an all-to-all
        # and a local sum); the all-reduce + slice form is what it emits under jit too.
        v = jax.lax.psum(v, ax)
        size = v.shape[step.dim] // n
        return jax.lax.dynamic_slice_in_dim(v, _axis_index(step.axes, axes) * size, size, step.dim)
    if step.kind == NodeKind.REDUCE_SCATTER:
        return jax.lax.psum_scatter(v, ax, scatter_dimension=step.dim, tiled=True)
    if step.kind == NodeKind.ALL_GATHER:
        return jax.lax.all_gather(v, ax, axis=step.dim, tiled=True)
    if step.kind == NodeKind.ALL_TO_ALL:
        return jax.lax.all_to_all(v, ax, split_axis=step.dim2, concat_axis=step.dim, tiled=True)
    if step.kind == NodeKind.DYN_SLICE:
        size = v.shape[step.dim] // n
        return jax.lax.dynamic_slice_in_dim(v, _axis_index(step.axes, axes) * size, size, step.dim)
    raise ValueError(step.kind)


def make_interpreter(
    program: Program,
    runs: list[EqnRun],
    produced: dict[int, int],  # value id -> produced layout
    parent: dict[tuple[int, int], Step],  # (value id, layout) -> the step that makes it
    layouts: list[Layout],
    axes: MeshAxes,
    mesh: Mesh,
    root_layouts: list[int | None],
    canon: dict[int, int],  # value id -> the representative of its e-class (computed once)
) -> Callable[..., list[Any]]:
    names = axes.names
    cpu = mesh.devices.flat[0].platform == "cpu"

    def spec(lid: int) -> PartitionSpec:
        """The physical spec: pending sums are stacked on a leading dimension."""
        lay = layouts[lid]
        base = lay.spec(axes)
        if not lay.partial:
            return base
        entries = list(base) + [None] * (lay.rank - len(base))
        return PartitionSpec(tuple(names[a] for a in lay.partial), *entries)

    def local_shape(shape: tuple[int, ...], lid: int) -> tuple[int, ...]:
        return layouts[lid].shard_shape(shape, axes)

    def constrain(x: Any, lid: int) -> Any:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(lid)))

    def smap(body: Callable[..., Any], in_lids: list[int], out_lids: list[int]) -> Callable[..., Any]:
        return jax.shard_map(
            body, mesh=mesh, in_specs=tuple(spec(lid) for lid in in_lids),
            out_specs=tuple(spec(lid) for lid in out_lids), check_vma=False,
        )

    def unstack(x: Any, lid: int) -> Any:
        return x[0] if layouts[lid].partial else x

    def restack(x: Any, lid: int) -> Any:
        return x[None] if layouts[lid].partial else x

    def collective(x: Any, step: Step, src: int, dst: int) -> Any:
        """A collective on a pending sum (or between stacked layouts), inside shard_map."""

        def body(v: Any) -> Any:
            return (restack(apply_collective(unstack(v, src), step, axes, cpu), dst),)

        return smap(body, [src], [dst])(x)[0]

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
            vid = canon.get(vid, vid)
            if produced.get(vid) == lid:
                return env[vid]
            k = (vid, lid)
            if k not in views:
                step = parent.get(k)
                if step is None:
                    views[k] = constrain(env[vid], lid)
                else:
                    base = view(vid, step.src)
                    if layouts[step.src].partial or layouts[lid].partial:
                        views[k] = collective(base, step, step.src, lid)
                    else:
                        views[k] = constrain(base, lid)
            return views[k]

        for run in runs:
            eqn = program.equations[run.eqn]
            lids = iter(run.operand_layouts)
            operand_lids = [None if isinstance(a, Literal) else next(lids) for a in eqn.inputs]
            pending = any(layouts[lid].partial for lid in operand_lids if lid is not None) or any(
                layouts[lid].partial for _, lid in run.outputs)
            if not pending:
                operands = [a.value if isinstance(a, Literal) else view(a, lid)
                            for a, lid in zip(eqn.inputs, operand_lids, strict=True)]
                # a user's own pin is replaced by the plan's constraint on the result
                outs = operands[0] if eqn.name in PINS else eqn.primitive.bind(*operands, **eqn.params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
                for k, lid in run.outputs:
                    env[canon.get(eqn.outputs[k], eqn.outputs[k])] = constrain(outs[k], lid)
                continue
            for vid, x in _run_on_shards(program, eqn, run, operand_lids, view, smap, unstack, restack,
                                         local_shape).items():
                env[canon.get(vid, vid)] = x
        return [o.value if isinstance(o, Literal) else view(o, lid)  # type: ignore[arg-type]
                for o, lid in zip(program.outputs, root_layouts, strict=True)]

    return interpret


def _run_on_shards(program: Program, eqn: Any, run: EqnRun, operand_lids: list[int | None], view: Any,
                   smap: Any, unstack: Any, restack: Any, local_shape: Any) -> dict[int, Any]:
    """One equation inside shard_map (it produces or consumes a pending sum)."""
    arrays = []
    in_lids: list[int] = []
    shapes = []
    for a, lid in zip(eqn.inputs, operand_lids, strict=True):
        if isinstance(a, Literal):
            shapes.append(None)
            continue
        arrays.append(view(a, lid))
        in_lids.append(lid)  # type: ignore[arg-type]
        g = program.values[a].shape
        shapes.append((g, local_shape(g, lid)))
    out_idx = [k for k, _ in run.outputs]
    out_lids = [lid for _, lid in run.outputs]
    all_outs = [(program.values[o].shape, None) for o in eqn.outputs]
    for k, lid in run.outputs:
        g = program.values[eqn.outputs[k]].shape
        all_outs[k] = (g, local_shape(g, lid))

    def body(*local: Any) -> Any:
        it = iter(local)
        operands = []
        for a, lid in zip(eqn.inputs, operand_lids, strict=True):
            operands.append(a.value if isinstance(a, Literal) else unstack(next(it), lid))
        params = local_params(eqn.name, eqn.params, [s for s in shapes if s is not None],
                              [(g, loc if loc is not None else g) for g, loc in all_outs])
        outs = eqn.primitive.bind(*operands, **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        picked = [outs[k] for k in out_idx]
        check_local(eqn.name, eqn.source, picked, [all_outs[k] for k in out_idx])  # type: ignore[misc]
        return tuple(restack(x, lid) for x, lid in zip(picked, out_lids, strict=True))

    results = smap(body, in_lids, out_lids)(*arrays)
    return {eqn.outputs[k]: r for k, r in zip(out_idx, results, strict=True)}
