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
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..egraph.collectives import COLLECTIVES, StepLike
from ..egraph.layout import Layout, MeshAxes
from ..egraph.program import SCAN_PSEUDO, Literal, Program, bind
from ..extract.assignment import EqnRun
from ..extract.result import ReshardStep
from ..rules.registry import rule_for
from .combine import ready_with, reduce_together, reductions, wave_order
from .guards import guarded
from .local import check_local, local_params


def apply_collective(v: Any, step: StepLike, axes: MeshAxes, cpu: bool = False) -> Any:
    """One resharding step on a local shard, inside shard_map: the plan's collective written out
    (each kind's `lower` in `shardsat/egraph/collectives.py`)."""
    return COLLECTIVES[step.kind].lower(v, step, axes, cpu)


class Interpreter:
    """The program re-run under a plan, as a function of its flat arguments (for jax.jit).

    Values live in Scopes: the top level, and one per run of a region's body (a scan or while
    iteration, a cond branch). A region's reads of enclosing values are resharded once outside
    it (hoisted) and closed over, so no view is traced inside a loop or branch and leaks out."""

    def __init__(self, program: Program, runs: list[EqnRun], produced: dict[int, int],
                 parent: dict[tuple[int, int], ReshardStep], layouts: list[Layout], axes: MeshAxes, mesh: Mesh,
                 root_layouts: list[int | None], canon: dict[int, int],
                 carry_layouts: dict[int, int] | None = None, combine_bytes: float = 0.0,
                 chained: frozenset[int] = frozenset()) -> None:
        self.program = program
        self.produced = produced  # value id -> produced layout
        self.parent = parent  # (value id, layout) -> the step that makes it
        self.layouts = layouts
        self.axes = axes
        self.mesh = mesh
        self.root_layouts = root_layouts
        self.carry_layouts = carry_layouts or {}  # region carry-input value -> its tied layout
        self.cpu = mesh.devices.flat[0].platform == "cpu"
        self.canon, self.once = _replay_canon(program, canon)
        # all-reduces of pending sums made together (runtime/combine.py), up to `combine_bytes`;
        # `chained`: values between two contractions, whose reductions are left alone
        self.combine_bytes = combine_bytes
        self.reductions = reductions(program, produced, parent, layouts, self.cpu, chained)
        self.by_region: dict[int | None, list[Any]] = {}
        replays: set[int] = set()
        for run in runs:
            region = program.equations[run.eqn].region
            if region is not None and program.scans[region].folded and region not in replays:
                # a folded loop: its repeats are replayed where its first repeat stood
                replays.add(region)
                self.by_region.setdefault(program.scans[region].parent, []).append(("replay", region))
            self.by_region.setdefault(region, []).append(run)
        if self.reductions.group_of and combine_bytes > 0:
            self.by_region = {r: wave_order(program, entries, self.reductions, parent, produced, self.canon)
                              for r, entries in self.by_region.items()}
        self.run_of_output = {program.equations[r.eqn].outputs[k]: r for r in runs for k, _ in r.outputs}
        self.merges: dict[tuple[int, ...], list[EqnRun]] = {}
        for r in runs:
            e = program.equations[r.eqn]
            if e.name == "cond_merge":
                self.merges.setdefault(e.params["cond"], []).append(r)

    def __call__(self, *flat_args: Any) -> list[Any]:
        top = Scope(self, None, None)
        for vid, x in zip(self.program.args, flat_args, strict=True):
            top.env[vid] = x
        for vid in self.program.const_values:
            info = self.program.values[vid]
            x = self.program.consts[info.const]  # type: ignore[index]
            top.env[vid] = self.constrain(x, self.produced[vid]) if vid in self.produced else x
        top.execute()
        outs = [o.value if isinstance(o, Literal) else top.view(o, lid)  # type: ignore[arg-type]
                for o, lid in zip(self.program.outputs, self.root_layouts, strict=True)]
        weak = self.program.out_weak or [False] * len(outs)
        return [_weakly_typed(x) if w else x for x, w in zip(outs, weak, strict=True)]

    # -- layouts ---------------------------------------------------------------------------------
    def spec(self, lid: int) -> PartitionSpec:
        """The physical spec: pending sums are stacked on a leading dimension."""
        return self.layouts[lid].physical_spec(self.axes)

    def local_shape(self, shape: tuple[int, ...], lid: int) -> tuple[int, ...]:
        return self.layouts[lid].shard_shape(shape, self.axes)

    def constrain(self, x: Any, lid: int) -> Any:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(lid)))

    def smap(self, body: Callable[..., Any], in_lids: list[int], out_lids: list[int]) -> Callable[..., Any]:
        return jax.shard_map(body, mesh=self.mesh, in_specs=tuple(self.spec(lid) for lid in in_lids),
                             out_specs=tuple(self.spec(lid) for lid in out_lids), check_vma=False)

    def unstack(self, x: Any, lid: int) -> Any:
        return x[0] if self.layouts[lid].partial else x

    def restack(self, x: Any, lid: int) -> Any:
        return x[None] if self.layouts[lid].partial else x

    def collective(self, x: Any, step: ReshardStep, src: int, dst: int) -> Any:
        """A collective on a pending sum (or between stacked layouts), inside shard_map."""

        def body(v: Any) -> Any:
            return (self.restack(apply_collective(self.unstack(v, src), step, self.axes, self.cpu), dst),)

        return self.smap(body, [src], [dst])(x)[0]

    def reduce_ready(self, scope: Scope, k: tuple[int, int]) -> dict[tuple[int, int], Any]:
        """The all-reduce of pending sum `k` with every other of its group already made in
        `scope` (runtime/combine.py); {} where `k` is no such all-reduce."""
        red = self.reductions
        g = red.group_of.get(k)
        if g is None or self.combine_bytes <= 0:
            return {}
        keys = ready_with(k, red.members[g], scope.env, scope.views, self._pending_bytes, self.combine_bytes)
        steps = [self.parent[m] for m in keys]
        arrays = [scope.env[m[0]] for m in keys]
        names = tuple(self.axes.names[a] for a in steps[0].axes)
        summed = reduce_together(self.smap, self.unstack, self.restack, keys, steps, arrays,
                                 [m in red.late for m in keys], names, self.axes)
        return dict(zip(keys, summed, strict=True))

    def _pending_bytes(self, k: tuple[int, int]) -> int:
        info = self.program.values[k[0]]
        return math.prod(self.local_shape(info.shape, self.parent[k].src)) * jnp.dtype(info.dtype).itemsize

    # -- equations -------------------------------------------------------------------------------
    def run_eqn(self, scope: Scope, eqn: Any, run: EqnRun, started: set[Any]) -> None:
        if eqn.name in SCAN_PSEUDO:
            self.run_region(scope, eqn, started)
            return
        lids = iter(run.operand_layouts)
        operand_lids = [None if isinstance(a, Literal) else next(lids) for a in eqn.inputs]
        layouts = self.layouts
        pending = any(layouts[lid].partial for lid in operand_lids if lid is not None) or any(
            layouts[lid].partial for _, lid in run.outputs)
        if pending:
            for vid, x in _run_on_shards(self, eqn, run, operand_lids, scope.view).items():
                scope.set(vid, x)
            return
        operands = [a.value if isinstance(a, Literal) else scope.view(a, lid)
                    for a, lid in zip(eqn.inputs, operand_lids, strict=True)]
        shapes = [jnp.shape(a.value) if isinstance(a, Literal) else self.program.values[a].shape for a in eqn.inputs]
        operands = guarded(eqn, operands, shapes, next(iter(operand_lids), None), layouts, self.axes)
        # a user's own pin is replaced by the plan's constraint on the result
        outs = operands[0] if rule_for(eqn.primitive).pin is not None else bind(eqn.primitive, operands, eqn.params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for k, lid in run.outputs:
            scope.set(eqn.outputs[k], self.constrain(outs[k], lid))

    # -- regions ---------------------------------------------------------------------------------
    def run_region(self, scope: Scope, eqn: Any, started: set[Any]) -> None:
        """The first pseudo-equation of a region in its parent runs the whole region; the slices
        of a scan are fed by lax.scan itself."""
        if eqn.name == "scan_slice":
            return
        key = eqn.params["cond"] if eqn.name == "cond_merge" else eqn.params["scan"]
        if key in started:
            return
        started.add(key)
        if eqn.name == "cond_merge":
            self.run_cond(scope, key)
        elif self.program.scans[key].kind == "while":
            self.run_while(scope, key)
        else:
            self.run_scan(scope, key)

    def replay(self, scope: Scope, s: int) -> None:
        """The original repeats of a folded loop, each with the body's layouts."""
        scan = self.program.scans[s]
        body = self.by_region.get(s, [])
        for j in range(scan.length):
            for run in body:
                if j == 0 or run.eqn not in self.once:
                    self.run_eqn(scope, scan.replay[run.eqn][j], run, set())

    def hoist(self, scope: Scope, regions: list[int], exits: list[tuple[Any, int | None]]) -> dict[tuple[int, int], Any]:
        """Views of enclosing values that `regions` (and regions nested in them) read, and that
        their results (`exits`: atom, layout) return unchanged, taken once in `scope`."""
        prog = self.program
        inner = [r for r in range(len(prog.scans)) if any(_inside(prog, r, s) for s in regions)]

        def local(a: int) -> bool:
            return any(_inside(prog, prog.values[a].region, s) for s in regions)

        reads = list(exits)
        for r in inner:
            for run in self.by_region.get(r, []):
                eqn = prog.equations[run.eqn]
                if eqn.name == "scan_slice":
                    continue
                lids = iter(run.operand_layouts)
                reads += [(a, next(lids)) for a in eqn.inputs if not isinstance(a, Literal)]
        hoisted: dict[tuple[int, int], Any] = {}
        for a, lid in reads:
            if isinstance(a, int) and not local(a):
                lid = self.produced[self.canon.get(a, a)] if lid is None else lid
                hoisted[(self.canon.get(a, a), lid)] = scope.view(a, lid)
        return hoisted

    def enter(self, scope: Scope, region: int, hoisted: dict[tuple[int, int], Any],
              carries: list[tuple[int, Any, int]]) -> Scope:
        """A scope for one run of a region's body, its carries (value, array, layout) in place."""
        inner = Scope(self, region, scope)
        inner.hoisted = hoisted
        for vid, x, lid in carries:
            # pinned even where it is the carry's own layout: XLA otherwise propagates a layout
            # into the loop's state from the body's consumers
            inner.env[self.canon.get(vid, vid)] = self.constrain(x, self.produced.get(vid, lid))
        return inner

    def exit_view(self, scope: Scope, a: Any, lid: int | None) -> Any:
        if isinstance(a, Literal):
            return a.value
        return scope.view(a, lid if lid is not None else self.produced[self.canon.get(a, a)])

    def run_scan(self, scope: Scope, s: int) -> None:
        """lax.scan with the body run under the plan: carries in their tied layout. Per-step
        outputs nothing reads are not stacked."""
        scan = self.program.scans[s]
        carry_lids = [self.carry_layouts[c] for c in scan.carry_in]
        init = [self.exit_view(scope, a, lid) for a, lid in zip(scan.init, carry_lids, strict=True)]
        # a scanned input whose slice nothing in the body reads is not passed (lax.scan takes the
        # length as given; the input may not even be computed)
        sliced = [(k, run.operand_layouts[0]) for k, sl in enumerate(scan.slices)
                  if (run := self.run_of_output.get(sl)) is not None]
        xs = [self.exit_view(scope, scan.xs[k], lid) for k, lid in sliced]
        used = [(k, run.operand_layouts[0]) for k, st in enumerate(scan.stacked)
                if (run := self.run_of_output.get(st)) is not None]
        exits = [*zip(scan.carry_out, carry_lids, strict=True), *((scan.ys[k], lid) for k, lid in used)]
        hoisted = self.hoist(scope, [s], exits)

        def body(carry: Any, xslices: Any) -> Any:
            inner = self.enter(scope, s, hoisted, list(zip(scan.carry_in, carry, carry_lids, strict=True)))
            for (k, _), x in zip(sliced, xslices, strict=True):
                vid = scan.slices[k]
                inner.env[self.canon.get(vid, vid)] = self.constrain(x, self.produced[vid]) if vid in self.produced else x
            inner.execute()
            new_carry = [self.exit_view(inner, a, lid) for a, lid in zip(scan.carry_out, carry_lids, strict=True)]
            return new_carry, [self.exit_view(inner, scan.ys[k], lid) for k, lid in used]

        final, stacked = jax.lax.scan(body, init, xs, length=scan.length, reverse=scan.reverse)
        self.set_results(scope, scan.final, final)
        self.set_results(scope, [scan.stacked[k] for k, _ in used], stacked)

    def set_results(self, scope: Scope, vids: list[int], arrays: list[Any]) -> None:
        for vid, x in zip(vids, arrays, strict=True):
            scope.set(vid, self.constrain(x, self.produced[vid]) if vid in self.produced else x)

    def run_while(self, scope: Scope, s: int) -> None:
        """lax.while_loop: the predicate's region and the body's, over carries in their tied
        layout."""
        loop = self.program.scans[s]
        c = loop.cond_region
        assert c is not None
        carry_lids = [self.carry_layouts[v] for v in loop.carry_in]
        init = [self.exit_view(scope, a, lid) for a, lid in zip(loop.init, carry_lids, strict=True)]
        hoisted = self.hoist(scope, [s, c], [*zip(loop.carry_out, carry_lids, strict=True), (loop.pred, None)])

        def pred_of(carry: Any) -> Any:
            inner = self.enter(scope, c, hoisted, list(zip(loop.carry_in, carry, carry_lids, strict=True)))
            inner.execute()
            return self.exit_view(inner, loop.pred, None)

        def body_fun(carry: Any) -> Any:
            inner = self.enter(scope, s, hoisted, list(zip(loop.carry_in, carry, carry_lids, strict=True)))
            inner.execute()
            new = [self.exit_view(inner, a, lid) for a, lid in zip(loop.carry_out, carry_lids, strict=True)]
            return _batched_step(pred_of(carry), new, carry) if batched else new

        # a while under vmap has a predicate per element (the primitive allows it, lax.while_loop
        # does not): it runs while any element's holds, and an element whose predicate fails
        # keeps its carry, as jax lowers it
        batched = bool(self.program.values[loop.pred].shape) if isinstance(loop.pred, int) else False
        final = jax.lax.while_loop(lambda carry: jnp.any(pred_of(carry)) if batched else pred_of(carry),
                                   body_fun, init)
        self.set_results(scope, loop.final, list(final))

    def run_cond(self, scope: Scope, regions: tuple[int, ...]) -> None:
        """lax.switch over the branches, each run under the plan and returning the results the
        plan reads in their merged layout; the index is replicated."""
        merges = self.merges[regions]
        first = self.program.equations[merges[0].eqn]
        index = first.inputs[0]
        idx = index.value if isinstance(index, Literal) else scope.view(index, merges[0].operand_layouts[0])
        skip = 0 if isinstance(index, Literal) else 1  # operand layouts after the index's
        outs = [(self.program.equations[m.eqn], m.operand_layouts[skip:]) for m in merges]
        exits = [(e.inputs[1 + b], lids[b]) for e, lids in outs for b in range(len(regions))]
        hoisted = self.hoist(scope, list(regions), exits)

        def branch(b: int, region: int) -> Callable[[], list[Any]]:
            def run() -> list[Any]:
                inner = self.enter(scope, region, hoisted, [])
                inner.execute()
                return [self.exit_view(inner, e.inputs[1 + b], lids[b]) for e, lids in outs]
            return run

        results = jax.lax.switch(idx, [branch(b, r) for b, r in enumerate(regions)])
        self.set_results(scope, [e.outputs[0] for e, _ in outs], list(results))


def _batched_step(pred: Any, new: list[Any], old: list[Any]) -> list[Any]:
    """Each carry's new value where its element's predicate holds, else its old one (the
    predicate's dimensions lead every carry's, as the while primitive's batching makes them)."""
    def pick(a: Any, b: Any) -> Any:
        which = jax.lax.broadcast_in_dim(pred, a.shape, tuple(range(pred.ndim)))
        return jax.lax.select(which, a, b)
    return [pick(a, b) for a, b in zip(new, old, strict=True)]


class Scope:
    """Values of one region run (the top level, one iteration of a loop body, one branch) and
    their resharded views; lookups of values from enclosing regions go to the hoisted views or
    the parent scope."""

    def __init__(self, interp: Interpreter, region: int | None, parent: Scope | None) -> None:
        self.interp = interp
        self.region = region
        self.parent = parent
        self.env: dict[int, Any] = {}
        self.views: dict[tuple[int, int], Any] = {}
        self.hoisted: dict[tuple[int, int], Any] = {}

    def owns(self, vid: int) -> bool:
        return vid in self.env or self.parent is None

    def view(self, vid: int, lid: int) -> Any:
        """The value in layout `lid`: the plan's resharding tree is walked one collective at a
        time, constraining every intermediate layout, so XLA emits the plan's collectives and not
        its own guess."""
        it = self.interp
        vid = it.canon.get(vid, vid)
        if not self.owns(vid):
            k = (vid, lid)
            if k in self.hoisted:
                return self.hoisted[k]
            return self.parent.view(vid, lid)  # type: ignore[union-attr]
        if it.produced.get(vid) == lid:
            return self.env[vid]
        k = (vid, lid)
        if k not in self.views:
            step = it.parent.get(k)
            if step is None:
                self.views[k] = it.constrain(self.env[vid], lid)
            else:
                base = self.view(vid, step.src)
                together = it.reduce_ready(self, k)
                if together:
                    self.views.update(together)
                elif it.layouts[step.src].partial or it.layouts[lid].partial:
                    self.views[k] = it.collective(base, step, step.src, lid)
                else:
                    self.views[k] = it.constrain(base, lid)
        return self.views[k]

    def set(self, vid: int, x: Any) -> None:
        self.env[self.interp.canon.get(vid, vid)] = x

    def execute(self) -> None:
        it = self.interp
        started: set[Any] = set()
        for run in it.by_region.get(self.region, []):
            if isinstance(run, tuple):
                it.replay(self, run[1])
            else:
                it.run_eqn(self, it.program.equations[run.eqn], run, started)


def _replay_canon(program: Program, canon: dict[int, int]) -> tuple[dict[int, int], set[int]]:
    """A folded loop's loop-invariant equations run in its first repeat only: the other repeats
    read that repeat's values (the plan prices them once, collectives included). Returns the
    value canon extended with those reads, and the body equations run once."""
    canon = dict(canon)
    once: set[int] = set()
    for scan in program.scans:
        for b, reps in scan.replay.items():
            outs = program.equations[b].outputs
            if outs and all(o in scan.invariant for o in outs):
                once.add(b)
                for rep in reps[1:]:
                    for o, o0 in zip(rep.outputs, reps[0].outputs, strict=True):
                        canon[o] = canon.get(o0, o0)
    return canon, once


def _run_on_shards(it: Interpreter, eqn: Any, run: EqnRun, operand_lids: list[int | None],
                   view: Callable[[int, int], Any]) -> dict[int, Any]:
    """One equation inside shard_map (it produces or consumes a pending sum)."""
    program = it.program
    arrays = []
    in_lids: list[int] = []
    shapes = []
    for a, lid in zip(eqn.inputs, operand_lids, strict=True):
        if isinstance(a, Literal):
            shapes.append(None)
            continue
        arrays.append(view(a, lid))  # type: ignore[arg-type]
        in_lids.append(lid)  # type: ignore[arg-type]
        g = program.values[a].shape
        shapes.append((g, it.local_shape(g, lid)))  # type: ignore[arg-type]
    out_idx = [k for k, _ in run.outputs]
    out_lids = [lid for _, lid in run.outputs]
    all_outs = [(program.values[o].shape, None) for o in eqn.outputs]
    for k, lid in run.outputs:
        g = program.values[eqn.outputs[k]].shape
        all_outs[k] = (g, it.local_shape(g, lid))

    def body(*local: Any) -> Any:
        rest = iter(local)
        operands = []
        for a, lid in zip(eqn.inputs, operand_lids, strict=True):
            operands.append(a.value if isinstance(a, Literal) else it.unstack(next(rest), lid))
        params = local_params(eqn.primitive, eqn.params, [s for s in shapes if s is not None],
                              [(g, loc if loc is not None else g) for g, loc in all_outs])
        outs = bind(eqn.primitive, operands, params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        picked = [outs[k] for k in out_idx]
        check_local(eqn.name, eqn.source, picked, [all_outs[k] for k in out_idx])  # type: ignore[misc]
        return tuple(it.restack(x, lid) for x, lid in zip(picked, out_lids, strict=True))

    results = it.smap(body, in_lids, out_lids)(*arrays)
    return {eqn.outputs[k]: r for k, r in zip(out_idx, results, strict=True)}


def _inside(program: Program, region: int | None, s: int) -> bool:
    """Is `region` the scan `s` or nested in it?"""
    while region is not None:
        if region == s:
            return True
        region = program.scans[region].parent
    return False


def _weakly_typed(x: Any) -> Any:
    """x, weakly typed as jax.jit's output is where the program made it from Python scalars
    (values rebuilt from a loop or branch lose the weak type: a while counter started from 0)."""
    if getattr(x, "weak_type", False):
        return x
    from jax._src.lax import lax as lax_internal  # no public spelling of a weak-type conversion

    convert = getattr(lax_internal, "_convert_element_type", None)
    x = jnp.asarray(x)
    return x if convert is None else convert(x, x.dtype, weak_type=True)
