"""Reductions of pending sums for the optimizer, lowered so that XLA's combiner cannot chain them.

XLA's AllReduceCombiner merges independent all-reduces greedily, in post order, and closes a
group at the first all-reduce that depends on one in it. A plan that reduces every gradient and
then a partial scalar of each (clip_by_global_norm's sum of squares taken on a shard) had each
scalar merged with the *next* gradient's all-reduce, which then waited for the previous one: a
chain of 11 all-reduces where two would do (the Llama step of benchmarks/realistic.py on 1x8,
compiled step estimate 244 us against jax.jit data parallelism's 217, whose gradients share
one all-reduce). The cost model prices such reductions as combined (extract/cost.py: values
not between two contractions), so the lowering makes them so:
- a scope's equations run by waves (`wave_order`), so the pending sums of one wave all exist
  before the first reduction of the next is asked for;
- then every pending sum of the scope that the plan reduces over the same axes, in the same
  dtype, and that exists already, is reduced at once (up to the profile's combining threshold):
  those of the group's first wave by one psum each, which XLA combines as it would (no copy);
  those of later waves, which depend on the first wave's, in one flat buffer (a concatenation,
  one all-reduce): a single instruction that needs them all, so in XLA's post order every
  first-wave all-reduce comes before it and nothing chains. Later waves are the small ones
  (norms' scalars); the first wave's gradients are not copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from ..egraph.collectives import COLLECTIVES, NodeKind
from ..egraph.layout import Layout, MeshAxes
from ..egraph.program import SCAN_PSEUDO, Literal

if TYPE_CHECKING:
    from ..egraph.program import Program
    from ..extract.result import ReshardStep

Key = tuple[int, int]  # (value id, layout id)
# the name scope of a flat reduction of n pending sums, `shardsat_combined_<n>` in its HLO metadata
COMBINED_TAG = "shardsat_combined_"
# a later wave's pending sum is copied into the flat buffer only up to this size (a norm's
# scalar, a row of statistics): a larger one is reduced by itself (a Soft-MoE step's 1.9 MiB
# gradient of a later wave copied cost 8 MB of memory traffic for no fewer collectives)
FLAT_BYTES = 64 * 2**10
GroupKey = tuple[int | None, tuple[int, ...], str]  # (region, mesh axes, dtype)


@dataclass
class Reductions:
    """The plan's all-reduces of optimizer-side pending sums, straight from their producer."""

    group_of: dict[Key, GroupKey] = field(default_factory=dict)
    members: dict[GroupKey, list[Key]] = field(default_factory=dict)
    late: set[Key] = field(default_factory=set)  # beyond their group's first wave (set by wave_order)


def reductions(program: Program, produced: dict[int, int], parent: dict[Key, ReshardStep],
               layouts: list[Layout], cpu: bool, chained: frozenset[int]) -> Reductions:
    """All-reduces of pending sums that sit on no chain between two contractions (the cost
    model's combinable ones; `chained`: extract/structure.py), by (region, axes, dtype): the ones
    that can be made together. On XLA:CPU a reduce-scatter is an all-reduce and a slice
    (egraph/collectives.py), so it joins them."""
    kinds = (NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER) if cpu else (NodeKind.ALL_REDUCE,)
    red = Reductions()
    for k, step in parent.items():
        vid, _ = k
        if (step.kind not in kinds or produced.get(vid) != step.src or not layouts[step.src].partial
                or vid in chained):
            continue
        info = program.values[vid]
        g = (info.region, tuple(step.axes), str(info.dtype))
        red.group_of[k] = g
        red.members.setdefault(g, []).append(k)
    return red


def ready_with(k: Key, members: list[Key], env: dict[int, Any], done: dict[Key, Any],
               nbytes: Callable[[Key], int], limit: float) -> list[Key]:
    """`k` and the members made already (their pending sum is in `env`) and not yet reduced,
    in plan order, while their bytes stay within `limit`."""
    out, total = [k], nbytes(k)
    for m in members:
        if m == k or m[0] not in env or m in done:
            continue
        b = nbytes(m)
        if total + b > limit:
            continue
        out.append(m)
        total += b
    return out


def reduce_together(smap: Callable[..., Any], unstack: Callable[[Any, int], Any], restack: Callable[[Any, int], Any],
                    keys: list[Key], steps: list[ReshardStep], arrays: list[Any], late: list[bool],
                    names: tuple[str, ...], axes: MeshAxes) -> list[Any]:
    """Every pending sum in `arrays` (each in its step's source layout) reduced in one
    shard_map: the first wave's one psum each, the later waves' small ones in one flat buffer;
    a reduce-scatter's shard sliced from its sum."""

    def body(*local: Any) -> Any:
        parts = [unstack(v, s.src) for v, s in zip(local, steps, strict=True)]
        later = [i for i, lt in enumerate(late) if lt and parts[i].nbytes <= FLAT_BYTES]
        summed = [None if i in later else jax.lax.psum(p, names) for i, p in enumerate(parts)]
        flat = _flat_psum([parts[i] for i in later], names) if len(later) > 1 else [
            jax.lax.psum(parts[i], names) for i in later]
        for i, x in zip(later, flat, strict=True):
            summed[i] = x
        return tuple(restack(_scattered(v, s, axes), s.dst) for v, s in zip(summed, steps, strict=True))

    return list(smap(body, [s.src for s in steps], [k[1] for k in keys])(*arrays))


def _scattered(v: Any, step: ReshardStep, axes: MeshAxes) -> Any:
    """A reduce-scatter's block of its whole sum (this device's, along the step's dimension)."""
    if step.kind != NodeKind.REDUCE_SCATTER:
        return v
    return COLLECTIVES[NodeKind.DYN_SLICE].lower(v, step, axes, True)


def _flat_psum(parts: list[Any], names: tuple[str, ...]) -> list[Any]:
    """One all-reduce of every part (jax lowers a psum of a tuple to one all-reduce per part,
    which XLA's combiner would group again as it likes)."""
    with jax.named_scope(f"{COMBINED_TAG}{len(parts)}"):  # counted as len(parts) by runtime/hlo.py
        flat = jax.lax.psum(jnp.concatenate([p.reshape(-1) for p in parts]), names)
    out, at = [], 0
    for p in parts:
        out.append(flat[at:at + p.size].reshape(p.shape))
        at += p.size
    return out


def wave_order(program: Program, entries: list[Any], red: Reductions, parent: dict[Key, ReshardStep],
               produced: dict[int, int], canon: dict[int, int]) -> list[Any]:
    """`entries` (a scope's equation runs, in program order) reordered by wave: how many of
    `red`'s all-reduces lie on the longest path to each, ties in program order; marks the
    reductions beyond their group's first wave (`red.late`). jax's backward pass reads each
    gradient right after making it (a transpose), so in program order the first reduction is
    asked for before the other gradients exist; by waves, every pending sum of a wave exists
    before any reduction of the next is asked for. A topological order still: an equation's
    wave is at least its operands'. Region runs and equations with effects keep their place
    among everything (each is a barrier: nothing before it moves after it, nor the reverse)."""
    wave_of: dict[int, int] = {}
    waves: list[int] = []
    floor = 0
    for e in entries:
        eqn = None if isinstance(e, tuple) else program.equations[e.eqn]
        if eqn is None or eqn.effects or eqn.name in SCAN_PSEUDO:
            w = floor = max(waves, default=floor)
        else:
            w = floor
            lids = iter(e.operand_layouts)
            for a in eqn.inputs:
                if isinstance(a, Literal):
                    continue
                c = canon.get(a, a)
                w = max(w, wave_of.get(c, 0) + _through(c, next(lids), red, parent, produced))
            for o in eqn.outputs:
                wave_of[canon.get(o, o)] = w
        waves.append(w)
    _mark_late(red, wave_of)
    return [entries[i] for i in sorted(range(len(entries)), key=lambda i: (waves[i], i))]


def _mark_late(red: Reductions, wave_of: dict[int, int]) -> None:
    for keys in red.members.values():
        known = [k for k in keys if k[0] in wave_of]
        if known:
            first = min(wave_of[k[0]] for k in known)
            red.late.update(k for k in known if wave_of[k[0]] > first)


def _through(vid: int, lid: int | None, red: Reductions, parent: dict[Key, ReshardStep],
             produced: dict[int, int]) -> int:
    """1 where reading `vid` in layout `lid` takes one of `red`'s all-reduces, else 0."""
    for _ in range(64):  # a resharding tree's depth is a few steps
        if lid is None or lid == produced.get(vid):
            return 0
        if (vid, lid) in red.group_of:
            return 1
        step = parent.get((vid, lid))
        lid = None if step is None else step.src
    return 0
