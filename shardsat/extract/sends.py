"""XLA:CPU's array all-to-all as sliced sends, for the memory estimate (liveness.py).

XLA:CPU runs an all-to-all over n devices as a tuple one: the source is copied into n slices,
n pieces arrive, and the readers concatenate them inside their fusions, or, a product, into one
buffer of their own. A computed source that only such collectives read is never a buffer: XLA
computes it inside the slicing fusions, which its breadth-first schedule runs as soon as their
operands exist. These functions say which buffers that leaves, and when.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..egraph.collectives import COLLECTIVES
from ..rules.registry import rule_for
from . import fusion

if TYPE_CHECKING:
    from .liveness import Buf, Key, PlanLiveness, Timeline


def assembled_views(live: PlanLiveness, reads: list[list[tuple[Key, int | None, bool]]]) -> dict[Buf, int]:
    """Views a product reads in their own order, not through a copy into another, and the first
    product's position: where an all-to-all makes such a view, XLA concatenates its pieces into
    one buffer for that product, or beside the first's copy, and the pieces die there; later
    products read that buffer (a top-2 MoE step's expert inputs: `concatenate_bitcast_fusion.1`,
    4 MiB, made beside the first product's transposed copy and read by a product 74
    instructions later; as four 1 MiB pieces, output allocations held them). A library
    reduction reduces each piece apart instead."""
    first: dict[Buf, int] = {}
    out: set[Buf] = set()
    for t, row in enumerate(reads):
        if not fusion.may_transpose(live.tl.seq[t]):
            continue
        copied = live.copied.get(t, {})
        for pos, (k, lid, whole) in enumerate(row):
            if whole and lid is not None and lid != live.produced.get(k):
                first[(k, lid)] = min(first.get((k, lid), t), t)
                if pos not in copied:
                    out.add((k, lid))
    return {b: first[b] for b in out}


def sent_fused(live: PlanLiveness, reads: list[list[tuple[Key, int | None, bool]]]) -> frozenset[Key]:
    """Cheap values stored only for readers that cannot fuse them, all of which read them, in
    this plan, through all-to-alls XLA:CPU runs as sliced sends: those read the pieces, not the
    value; XLA computes the value inside the slicing fusions and inside each reader that fuses
    it, and never stores it (a contrastive loss's transposed logits, sent to a cross-entropy
    over the other axis)."""
    tl = live.tl
    platform = tl.spaces.mesh.platform
    ok = {k for k in tl.sendable if k in live.produced}
    sent: set[Key] = set()
    for row in reads:
        for k, lid, whole in row:
            if k not in ok or not whole:
                continue
            s = live.step_to.get((k, lid)) if lid is not None else None
            if s is None or s.src != live.produced[k] or not COLLECTIVES[s.kind].sliced_send_on(platform):  # type: ignore[attr-defined]
                ok.discard(k)
            else:
                sent.add(k)
    ok &= sent
    for (k, _), s in live.step_to.items():
        if k in ok and not COLLECTIVES[s.kind].sliced_send_on(platform):  # type: ignore[attr-defined]
            ok.discard(k)
    return frozenset(ok)


def sent_whole(live: PlanLiveness) -> set[Buf]:
    """The computed sources that only all-to-alls XLA:CPU runs as sliced sends read: their
    slices are the value (sliced_sends)."""
    tl = live.tl
    platform = tl.spaces.mesh.platform
    steps: dict[Buf, list[object]] = {}
    for v, step in live.step_to.items():
        steps.setdefault((v[0], step.src), []).append(step)  # type: ignore[attr-defined]
    return {sb for sb, ss in steps.items()
            if sb[1] == live.produced.get(sb[0]) and sb[0] in tl.made_at
            and (sb[0] in live.sent_fused or (not tl.stored.get(sb[0], True) and not live.direct.get(sb[0])))
            and all(COLLECTIVES[s.kind].sliced_send_on(platform) for s in ss)}  # type: ignore[attr-defined]


def sent_early(live: PlanLiveness) -> None:
    """XLA fuses a sent source's computation into the slicing fusions, which its breadth-first
    schedule runs as soon as their operands exist, not where the value's equation sits in our
    order: the slices are made then, the all-to-all a step later (a contrastive loss's
    transposed logits go out beside the logits' all-gather, before the reduction reading it)."""
    live.sends_whole = sent_whole(live)
    for sb in live.sends_whole:
        t = live.tl.made_at[sb[0]]
        if live.tl.birth_time(t) == t:
            live.born[sb] = min(live.born.get(sb, t), max(fused_birth(live, t), 0))
            read_operands(live, t, live.born[sb])


def stored_for_whole_reads(tl: Timeline, k: Key) -> bool:
    """Is `k` a buffer only because a reader cannot fuse it (fusion.stored's whole_read), not
    for a library fusion's sake? (Timeline.sendable: the keys that are, the candidates of
    sent_fused.)"""
    t = tl.made_at.get(k)
    if t is None or not tl.stored.get(k, False) or k in tl.boundary or k in tl.in_library or k in tl.shared_inside:
        return False
    e = tl.seq[t]
    return (fusion.kind(e) == fusion.Fuse.CHEAP and e.name != "broadcast_in_dim" and len(e.outputs) == 1
            and not rule_for(e.primitive).fused_once and not tl.unfused_concatenation(e))


def sliced_sends(live: PlanLiveness, sends: list[tuple[Buf, int]]) -> dict[Buf, list[int]]:
    """XLA:CPU runs an array all-to-all over n devices (made at t) as a tuple one: n slices of
    the source in, n pieces out that its readers concatenate inside their fusions; neither is
    one buffer an op may write into or an output allocation may hold whole (`live.pieces`). A
    computed source that only such collectives read is the slices (`live.sends_whole`: XLA
    fuses its computation into them; a source others read too XLA also keeps as a buffer,
    computing it twice, unless it is cheap and kept only for readers the sends serve). Any
    other source is sliced at t (the returned slices, per view); where the collective is the
    last read of a buffer made before t, that buffer is freed once sliced, before the pieces
    arrive. Where nothing reads the pieces before t + 2, they arrive a step after the slices
    are made (`live.sent`; the slices live from t): XLA makes the slices of a source's
    all-to-alls while the source lives and runs the collectives after, one by one, not all in
    the instant the slices are made.
    (A source made at t is a chain's middle hop: chains.py prices the chain.)"""
    tl, out = live.tl, {}
    for b, t in sends:
        s = live.step_to[b]
        n = math.prod(tl.spaces.mesh.sizes[a] for a in s.axes)  # type: ignore[attr-defined]
        if n < 2:
            continue
        live.pieces[b] = n
        k, src = b[0], s.src  # type: ignore[attr-defined]
        sb = (k, src)
        if sb in live.sends_whole:
            live.pieces[sb] = n
            continue
        rb = live.reads_from.get(b, sb)  # the buffer sliced (past a slice that fuses in)
        if live.last.get(rb) == t and live.born.get(rb, t) < t:
            live.last[rb] = t - 1
        out[b] = [tl.size(k, src) // n] * n
        if live.born.get(b) == t and min(live.view_readers.get(b, {t})) > t + 1:
            live.sent[b], live.born[b] = t, t + 1
    return out


def fused_birth(live: PlanLiveness, t: int, depth: int = 0) -> int:
    """When the operands of the value made at `t` exist (through the values fused into it):
    -1 for arguments only."""
    tl, born = live.tl, -1
    for k, lid in operands(live, t):
        p = live.produced.get(k)
        if p is None:
            continue
        made = tl.made_at.get(k)
        if lid not in (None, p):
            born = max(born, live.born.get((k, lid), tl.birth_time(t)))  # type: ignore[arg-type]
        elif made is not None and not live.stored.get(k, True) and depth < 8:
            born = max(born, fused_birth(live, made, depth + 1))
        else:
            born = max(born, live.born.get((k, p), -1))  # type: ignore[arg-type]
    return born

def operands(live: PlanLiveness, t: int) -> list[tuple[Key, int | None]]:
    """The value operands of the equation at `t`: (key, the layout the plan reads it in, or
    None where the plan's graph does not say: its produced layout)."""
    tl = live.tl
    vals = [a for a in tl.seq[t].inputs if isinstance(a, int)]
    lids: list[int | None] = list(tl.operand_layouts(t, live.ch))
    if len(lids) != len(vals):
        lids = [None] * len(vals)
    out = []
    for a, lid in zip(vals, lids, strict=True):
        k = tl.key(a)
        if k is not None:
            out.append((tl.redirect.get(k, k), lid))
    return out

def read_operands(live: PlanLiveness, t: int, at: int, depth: int = 0) -> None:
    """The operands of the value made at `t` (through the values fused into it) read at
    `at`, where a fusion computes it: the slices an all-to-all sends."""
    tl = live.tl
    for k, lid in operands(live, t):
        p = live.produced.get(k)
        made = tl.made_at.get(k)
        if p is not None and lid in (None, p) and made is not None and not live.stored.get(k, True) and depth < 8:
            read_operands(live, made, at, depth + 1)
        elif p is not None:
            live.read(k, lid, at, at, True)  # type: ignore[arg-type]
