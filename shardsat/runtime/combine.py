"""Reductions of pending sums for the optimizer, lowered so that XLA's combiner cannot chain them.

XLA's AllReduceCombiner merges independent all-reduces greedily, in post order, and closes a
group at the first all-reduce that depends on one in it. A plan that reduces every gradient and
then a partial scalar of each (clip_by_global_norm's sum of squares taken on a shard) had each
scalar merged with the *next* gradient's all-reduce, which then waited for the previous one: a
chain of 11 all-reduces where two would do (the Llama step of benchmarks/realistic.py on 1x8,
compiled step estimate 244 us against jax.jit data parallelism's 217, whose gradients share
one all-reduce). The cost model prices such reductions as combined (extract/cost.py: values
not between two contractions), so the lowering makes them so:
- every pending sum of the scope that the plan reduces over the same axes, in the same dtype,
  and that exists already, is reduced at the first request of one (up to the profile's
  combining threshold): those of the group's first wave by one psum each, which XLA combines as
  it would (no copy); those of later waves, which depend on the first wave's, in one flat
  buffer (a concatenation, one all-reduce) up to FLAT_BYTES each: a single instruction that
  needs them all, so in XLA's post order the first wave's all-reduces come before it and
  nothing chains. Later waves are the small ones (norms' scalars); gradients are not copied;
- an equation two reductions deep waits until the pending sums of the waves before it exist
  (`wave_order`), so those are made together.
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
    """`entries` (a scope's equation runs) in program order, but an equation two or more of
    `red`'s reductions deep (a wave: how many lie on the longest path to it) held back until
    every pending sum of the waves before it is made; marks the reductions beyond their group's
    first wave (`red.late`). Norms' scalars, each reduced where the next sum reads it, would each
    be the only one made at its first request and go one by one. The first wave's readers keep
    their place (XLA combines those reductions itself): XLA:CPU schedules by the instruction
    order, and holding them back too (jax transposes each gradient right after making it) moved a
    tied-embedding step's peak by 32 MiB. Region runs and equations with effects are barriers:
    what is held back runs before them."""
    wave_of: dict[int, int] = {}
    waves: list[int] = []
    members = {k[0] for k in red.group_of}
    producers: set[int] = set()
    for i, e in enumerate(entries):
        eqn = None if isinstance(e, tuple) else program.equations[e.eqn]
        w = 0
        if eqn is not None and not eqn.effects and eqn.name not in SCAN_PSEUDO:
            lids = iter(e.operand_layouts)
            for a in eqn.inputs:
                if not isinstance(a, Literal):
                    c = canon.get(a, a)
                    w = max(w, wave_of.get(c, 0) + _through(c, next(lids), red, parent, produced))
            for o in eqn.outputs:
                c = canon.get(o, o)
                wave_of[c] = w
                if c in members:
                    producers.add(i)
        waves.append(w)
    _mark_late(red, wave_of)
    barriers = [isinstance(e, tuple) or program.equations[e.eqn].effects
                or program.equations[e.eqn].name in SCAN_PSEUDO for e in entries]
    return [entries[i] for i in _held_back(waves, producers, barriers)]


def _held_back(waves: list[int], producers: set[int], barriers: list[bool]) -> list[int]:
    """Program order, but an entry of wave w >= 2 waits until every producer of a pending sum
    of a wave below w is out; a barrier first lets out everything held."""
    top = max(waves, default=0)
    remaining = [sum(1 for p in producers if waves[p] < w) for w in range(top + 1)]
    order: list[int] = []
    held: list[int] = []

    def emit(i: int) -> None:
        order.append(i)
        if i in producers:
            for w in range(waves[i] + 1, top + 1):
                remaining[w] -= 1

    def release() -> None:
        nonlocal held
        while held:
            out = [d for d in held if remaining[waves[d]] == 0]
            if not out:
                return
            held = [d for d in held if remaining[waves[d]] != 0]
            for d in out:
                emit(d)

    for i in range(len(waves)):
        if barriers[i]:
            for d in held:
                emit(d)
            held = []
            emit(i)
        elif waves[i] >= 2 and remaining[waves[i]] > 0:
            held.append(i)
        else:
            emit(i)
        release()
    for d in held:
        emit(d)
    return order


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
