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
from ..egraph.program import SCAN_PSEUDO, Literal, Program
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
    carry_layouts: dict[int, int] | None = None,  # scan carry-input value -> its tied layout
) -> Callable[..., list[Any]]:
    carry_layouts = carry_layouts or {}
    names = axes.names
    # a folded loop's loop-invariant equations run in its first repeat only: the other repeats
    # read that repeat's values (the plan prices them once, collectives included)
    canon = dict(canon)
    once: set[int] = set()  # body equations run in the first repeat only
    for scan in program.scans:
        for b, reps in scan.replay.items():
            outs = program.equations[b].outputs
            if outs and all(o in scan.invariant for o in outs):
                once.add(b)
                for rep in reps[1:]:
                    for o, o0 in zip(rep.outputs, reps[0].outputs, strict=True):
                        canon[o] = canon.get(o0, o0)
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

    by_region: dict[int | None, list[Any]] = {}
    replays: set[int] = set()
    for run in runs:
        region = program.equations[run.eqn].region
        if region is not None and program.scans[region].folded and region not in replays:
            # a folded loop: its repeats are replayed where its first repeat stood
            replays.add(region)
            by_region.setdefault(program.scans[region].parent, []).append(("replay", region))
        by_region.setdefault(region, []).append(run)
    run_of_output = {program.equations[r.eqn].outputs[k]: r for r in runs for k, _ in r.outputs}

    class Scope:
        """Values of one region (the top level, or one iteration of a scan body) and their
        resharded views; lookups of values from enclosing regions go to the parent scope."""

        def __init__(self, region: int | None, parent_scope: Scope | None) -> None:
            self.region = region
            self.parent = parent_scope
            self.env: dict[int, Any] = {}
            self.views: dict[tuple[int, int], Any] = {}
            self.hoisted: dict[tuple[int, int], Any] = {}

        def owns(self, vid: int) -> bool:
            return vid in self.env or self.parent is None

        def view(self, vid: int, lid: int) -> Any:
            # Walk the plan's resharding tree one collective at a time, constraining every
            # intermediate layout, so XLA emits the plan's collectives and not its own guess.
            vid = canon.get(vid, vid)
            if not self.owns(vid):
                k = (vid, lid)
                if k in self.hoisted:
                    return self.hoisted[k]
                return self.parent.view(vid, lid)  # type: ignore[union-attr]
            if produced.get(vid) == lid:
                return self.env[vid]
            k = (vid, lid)
            if k not in self.views:
                step = parent.get(k)
                if step is None:
                    self.views[k] = constrain(self.env[vid], lid)
                else:
                    base = self.view(vid, step.src)
                    if layouts[step.src].partial or layouts[lid].partial:
                        self.views[k] = collective(base, step, step.src, lid)
                    else:
                        self.views[k] = constrain(base, lid)
            return self.views[k]

        def set(self, vid: int, x: Any) -> None:
            self.env[canon.get(vid, vid)] = x

        def execute(self) -> None:
            started: set[int] = set()
            for run in by_region.get(self.region, []):
                if isinstance(run, tuple):
                    self.replay(run[1])
                    continue
                self.run_eqn(program.equations[run.eqn], run, started)

        def replay(self, s: int) -> None:
            """The original repeats of a folded loop, each with the body's layouts."""
            scan = program.scans[s]
            body = by_region.get(s, [])
            for j in range(scan.length):
                for run in body:
                    if j == 0 or run.eqn not in once:
                        self.run_eqn(scan.replay[run.eqn][j], run, set())

        def run_eqn(self, eqn: Any, run: EqnRun, started: set[int]) -> None:
            if eqn.name in SCAN_PSEUDO:
                scan = eqn.params["scan"]
                if eqn.name != "scan_slice" and scan not in started:  # slices: fed by lax.scan
                    started.add(scan)
                    self.run_scan(scan)
                return
            lids = iter(run.operand_layouts)
            operand_lids = [None if isinstance(a, Literal) else next(lids) for a in eqn.inputs]
            pending = any(layouts[lid].partial for lid in operand_lids if lid is not None) or any(
                layouts[lid].partial for _, lid in run.outputs)
            if not pending:
                operands = [a.value if isinstance(a, Literal) else self.view(a, lid)
                            for a, lid in zip(eqn.inputs, operand_lids, strict=True)]
                # a user's own pin is replaced by the plan's constraint on the result
                outs = operands[0] if eqn.name in PINS else eqn.primitive.bind(*operands, **eqn.params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
                for k, lid in run.outputs:
                    self.set(eqn.outputs[k], constrain(outs[k], lid))
                return
            for vid, x in _run_on_shards(program, eqn, run, operand_lids, self.view, smap, unstack, restack,
                                         local_shape).items():
                self.set(vid, x)

        def run_scan(self, s: int) -> None:
            """lax.scan with the body run under the plan: carries in their tied layout."""
            scan = program.scans[s]
            carry_lids = [carry_layouts[c] for c in scan.carry_in]
            init = [a.value if isinstance(a, Literal) else self.view(a, lid)
                    for a, lid in zip(scan.init, carry_lids, strict=True)]
            xs = []
            for x, sl in zip(scan.xs, scan.slices, strict=True):
                run = run_of_output.get(sl)
                lid = run.operand_layouts[0] if run is not None else produced.get(x)
                xs.append(self.view(x, lid) if lid is not None else self.view(x, produced[canon.get(x, x)]))
            body_runs = by_region.get(s, [])
            outer = self

            # views of enclosing values the body reads are taken once, outside the loop
            hoisted: dict[tuple[int, int], Any] = {}
            body_values = {v.id for v in program.values if _inside(program, v.region, s)}
            for run in body_runs:
                eqn = program.equations[run.eqn]
                if eqn.name == "scan_slice":
                    continue
                lids = iter(run.operand_layouts)
                for a in eqn.inputs:
                    if isinstance(a, Literal):
                        continue
                    lid = next(lids)
                    if a not in body_values:
                        hoisted[(canon.get(a, a), lid)] = outer.view(a, lid)

            stack_lids = []
            for st in scan.stacked:
                run = run_of_output.get(st)
                stack_lids.append(run.operand_layouts[0] if run is not None else None)

            def body(carry: Any, xslices: Any) -> Any:
                scope = Scope(s, outer)
                scope.hoisted = hoisted
                for vid, x, lid in zip(scan.carry_in, carry, carry_lids, strict=True):
                    # pinned even where it is the carry's own layout: XLA otherwise propagates a
                    # layout into the while loop's state from the body's consumers
                    scope.env[canon.get(vid, vid)] = constrain(x, produced.get(vid, lid))
                for vid, x in zip(scan.slices, xslices, strict=True):
                    scope.env[canon.get(vid, vid)] = constrain(x, produced[vid]) if vid in produced else x
                scope.execute()
                new_carry = [a.value if isinstance(a, Literal) else scope.view(a, lid)
                             for a, lid in zip(scan.carry_out, carry_lids, strict=True)]
                ys = [a.value if isinstance(a, Literal) else (scope.view(a, lid) if lid is not None else
                                                              scope.view(a, produced[canon.get(a, a)]))
                      for a, lid in zip(scan.ys, stack_lids, strict=True)]
                return new_carry, ys

            final, stacked = jax.lax.scan(body, init, xs, length=scan.length, reverse=scan.reverse)
            for vid, x in zip(scan.final, final, strict=True):
                self.set(vid, constrain(x, produced[vid]) if vid in produced else x)
            for vid, x in zip(scan.stacked, stacked, strict=True):
                self.set(vid, constrain(x, produced[vid]) if vid in produced else x)

    def interpret(*flat_args: Any) -> list[Any]:
        top = Scope(None, None)
        for vid, x in zip(program.args, flat_args, strict=True):
            top.env[vid] = x
        for vid in program.const_values:
            info = program.values[vid]
            x = program.consts[info.const]  # type: ignore[index]
            top.env[vid] = constrain(x, produced[vid]) if vid in produced else x
        top.execute()
        return [o.value if isinstance(o, Literal) else top.view(o, lid)  # type: ignore[arg-type]
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


def _inside(program: Program, region: int | None, s: int) -> bool:
    """Is `region` the scan `s` or nested in it?"""
    while region is not None:
        if region == s:
            return True
        region = program.scans[region].parent
    return False
