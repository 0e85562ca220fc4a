"""Chains of collectives made in one instant, priced the way XLA runs them: one hop after another.

A view can take several hops (gather over (data, fsdp), then over model; all-to-all, slice,
all-to-all). The hops in the middle of such a chain are made and read in one instant of the
timeline; XLA runs each chain's hops in sequence, freeing a middle once its next hop is made,
and chains one after another. So an instant holds the chain's root and final hops (ordinary
buffers) plus the largest step of one chain, not every hop's buffers and transients together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..egraph.collectives import COLLECTIVES

if TYPE_CHECKING:
    from .liveness import Buf, PlanLiveness


def chain_transients(live: PlanLiveness, views: list[Buf], made: dict[Buf, list[int]]) -> list[tuple[int, int, int]]:
    """(start, end, bytes) transients of the views: each view's own step transient (`made`:
    slices, a whole all-reduced buffer) where it is not in a chain, and one per instant for its
    chains. (`made` lists a view's step buffers: an all-to-all's n slices are n of them, each
    of which may fit where a whole one would not.) Marks the middles (`live.middles`): they are not buffers of their own."""
    nxt: dict[Buf, list[Buf]] = {}
    for b in views:
        nxt.setdefault(_src(live, b), []).append(b)
    mids = {m for m, after in nxt.items() if _is_middle(live, m, after)}
    live.middles |= mids
    out: list[tuple[int, int, int]] = []
    tops: dict[int, list[Buf]] = {}
    for b in views:
        if b in mids and _src(live, b) not in mids:
            tops.setdefault(live.born[b], []).append(b)
        elif b not in mids and _src(live, b) not in mids:
            out += [(live.sent.get(b, live.born[b]), live.born[b], size) for size in made.get(b, ())]
            if made.get(b):
                live.stepped.add(b)
    for t, ts in tops.items():
        extra = max(_sequential(live, top, t, nxt, mids, made) for top in ts)
        if len(ts) > 1:  # breadth-first: every middle, then the final hops one by one
            ms = [live.tl.size(*m) for m in mids if live.born[m] == t]
            fs = [live.tl.size(*a) for m in mids if live.born[m] == t for a in nxt[m] if a not in mids]
            extra = max(extra, sum(ms) + max(fs, default=0) - sum(fs))
        out.append((t, t, extra))
    return out


def _src(live: PlanLiveness, b: Buf) -> Buf:
    """The buffer view `b` is made from (past slices that fuse into it)."""
    return live.reads_from.get(b) or (b[0], live.step_to[b].src)  # type: ignore[attr-defined]


def _is_middle(live: PlanLiveness, m: Buf, after: list[Buf]) -> bool:
    """A view no equation reads, made and last read in one instant by next hops made then (or
    a step later: a next hop copied into a minor order)."""
    t = live.born.get(m)
    return (m in live.step_to and m not in live.view_readers and t is not None and live.last.get(m, t) == t
            and all(live.born.get(a, -1) - t in (0, 1) for a in after))


def _sequential(live: PlanLiveness, top: Buf, t: int, nxt: dict[Buf, list[Buf]], mids: set[Buf],
                made: dict[Buf, list[int]]) -> int:
    """The peak of one chain's hops run depth first, beyond its final hops made at `t` (those
    are buffers of their own). A step holds the middles above it that are still to be read, its
    own transient and result (its source is freed once copied into the transient), and the
    finals made before it; a middle that arrived as an all-to-all's pieces is first
    concatenated (pieces and whole, side by side)."""
    size = live.tl.size
    peak = finals = 0

    def visit(h: Buf, held: int) -> None:
        nonlocal peak, finals
        p = _src(live, h)
        if p in mids and p in live.pieces:
            peak = max(peak, held + size(*p) + finals)
        own = size(*h) if (h in mids or live.born.get(h) == t) and not _copied_by_slices(live, h, nxt, made) else 0
        rest = held - size(*p) if p in mids and nxt[p][-1] == h else held  # the parent is freed
        step = sum(made.get(h, ()))
        # a step with buffers of its own (slices, a whole all-reduced buffer) reads its source
        # into them and frees it before writing the result; any other reads it as it writes
        peak = max(peak, held + step + finals, (rest + step if step else held) + own + finals)
        if h in mids:
            for a in nxt.get(h, []):
                visit(a, rest + size(*h))
        else:
            finals += own

    visit(top, 0)
    return max(0, peak - finals)


def _copied_by_slices(live: PlanLiveness, m: Buf, nxt: dict[Buf, list[Buf]], made: dict[Buf, list[int]]) -> bool:
    """A middle gathered along a minor dimension (its raw gathered buffer is its step's, `made`)
    whose next hops are all slices: XLA fuses the copy into the minor order with each slice, so
    the whole copy is never written; the slices read the raw buffer (an XLA:CPU dump of the
    Soft-MoE step with experts over all devices: an expert weight's 4 MiB raw gather, then
    0.5 MiB sliced copies)."""
    after = nxt.get(m, [])
    return bool(made.get(m)) and COLLECTIVES[live.step_to[m].kind].transposes_minor and bool(after) and \
        all(a in live.step_to and COLLECTIVES[live.step_to[a].kind].fuses for a in after)  # type: ignore[attr-defined]
