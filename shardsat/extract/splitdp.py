"""The split bound's dynamic program (extract/splitbound.py), one value group at a time, each
group's productions priced at once with numpy: the bound runs once per plan, and agreement
prices (extract/agreement.py) run it tens of times.

Every group's values, and each *copied* group's value of one read per copy (a reader group or
a root), live in one flat array, so a production's operands are one gather: `SplitTables`
holds where each lives and each group's productions as index rows, built once per graph and
pins; `SplitDP` holds one evaluation's values.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..egraph.export import NodeKind
from .searchgraph import SearchGraph

Roots = list[tuple[int, frozenset[int] | None]]
Prices = dict[int, dict[int, np.ndarray]]  # group -> copy -> price per source layout
_PLACE = int(NodeKind.PLACE)


@dataclass
class Reads:
    """Who reads each group: k_h, and per (reader group, group) the most reads by one production."""

    k: list[int]
    pair: dict[tuple[int, int], int]
    readers: dict[int, list[int]]

    @classmethod
    def of(cls, sg: SearchGraph, roots: Roots) -> Reads:
        """Readers no root reaches are left out: no plan holds them (an alternative rewrite's
        dead branch), and counting them in k_h lowers every share of h and of what h reads."""
        k = [0] * sg.g.num_groups
        pair: dict[tuple[int, int], int] = {}
        live = reachable(sg, roots)
        for p, prods in enumerate(sg.prod_any):
            if p not in live:
                continue
            most: Counter[int] = Counter()
            for n in prods:
                for h, c in Counter(h for h, _ in sg.kid_gl[n]).items():
                    most[h] = max(most[h], c)
            for h, c in most.items():
                k[h] += c
                pair[(p, h)] = c
        for grp, _ in roots:
            k[grp] += 1
        readers: dict[int, list[int]] = {}
        for p, h in pair:
            readers.setdefault(h, []).append(p)
        return cls(k, pair, readers)

    def copies(self, h: int, roots: Roots) -> list[int]:
        """The places that read h: reader groups, then roots encoded -1 - root index."""
        return self.readers.get(h, []) + [-1 - r for r, (g, _) in enumerate(roots) if g == h]


def reachable(sg: SearchGraph, roots: Roots) -> set[int]:
    """Groups some production chain from a root reads: the only ones a plan can hold."""
    live = {g for g, _ in roots}
    stack = list(live)
    while stack:
        for n in sg.prod_any[stack.pop()]:
            for h, _ in sg.kid_gl[n]:
                if h not in live:
                    live.add(h)
                    stack.append(h)
    return live


@dataclass
class Shares:
    """Per-source-layout shares of one group among its copies: readers (group ids) and roots
    (encoded -1 - root index); gamma splits its production's cost, beta its resharding."""

    copies: list[int]
    reads: list[int]  # per copy: the most reads by one production (1 for a root)
    gamma: np.ndarray  # [copies, layouts]
    beta: np.ndarray
    value: dict[int, np.ndarray] = field(default_factory=dict)  # copy -> its share per layout

    def compute(self, best: np.ndarray, src: np.ndarray, dist: np.ndarray) -> None:
        """Each copy's share per layout l: min over sources s of gamma(s) best(s) + beta(s) dist(s, l)."""
        self.value = dict(zip(self.copies, self.totals(best, src, dist).min(axis=1), strict=True))

    def totals(self, best: np.ndarray, src: np.ndarray, dist: np.ndarray) -> np.ndarray:
        """Per copy, source and layout: gamma(s) best(s) + beta(s) dist(s, l)."""
        g, b = self.gamma[:, src], self.beta[:, src]
        with np.errstate(invalid="ignore"):  # a zero share of an unreachable layout: 0, not nan
            cost = np.where(g > 0, g * best[src], 0.0)[:, :, None]
            move = np.where(b[:, :, None] > 0, b[:, :, None] * dist[None], 0.0)
        return cost + move


@dataclass
class _Rows:
    """One group's productions: node ids, costs, source layout indices, and per operand read
    the flat index of its value and the divisor that makes it a share (padding: slot 0, 1.0)."""

    nodes: np.ndarray
    cost: np.ndarray
    lay: np.ndarray
    kid: np.ndarray  # int [productions, most operands]
    div: np.ndarray  # float, same shape
    by_layout: dict[int, np.ndarray] = field(default_factory=dict)  # source index -> its rows, in order

    def __post_init__(self) -> None:
        order = np.argsort(self.lay, kind="stable")
        cuts = np.flatnonzero(np.diff(self.lay[order])) + 1
        for part in np.split(order, cuts) if len(order) else ():
            self.by_layout[int(self.lay[part[0]])] = part


class SplitTables:
    """Where each value lives in the flat array, and each group's productions as rows (lazily):
    the same for every evaluation over one graph, reads, pins and set of copied groups."""

    def __init__(self, sg: SearchGraph, reads: Reads, roots: Roots, pins: dict[int, frozenset[int]],
                 copied: Iterable[int]) -> None:
        self.sg, self.reads, self.roots, self.pins = sg, reads, roots, pins
        self.sizes = [len(sg.paths[key].layouts) if key in sg.paths else 0 for key in sg.group_key]
        self.off = np.concatenate([[1], 1 + np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.size = 1 + int(sum(self.sizes))
        self.copy_off: dict[int, dict[int, int]] = {}
        self._rows: dict[int, _Rows | None] = {}
        self._copy(copied)

    def with_copied(self, more: Iterable[int]) -> SplitTables:
        """The same tables with more groups copied: only their readers' rows are built again."""
        out = copy.copy(self)
        out.copy_off = dict(self.copy_off)
        out._rows = dict(self._rows)
        added = out._copy(more)
        for h in added:
            for p in self.reads.readers.get(h, []):
                out._rows.pop(p, None)
        return out

    def _copy(self, groups: Iterable[int]) -> list[int]:
        added = []
        for h in sorted(set(groups)):
            if not self.sizes[h] or h in self.copy_off:
                continue
            self.copy_off[h] = {}
            for c in self.reads.copies(h, self.roots):
                self.copy_off[h][c] = self.size
                self.size += self.sizes[h]
            added.append(h)
        return added

    def rows(self, grp: int) -> _Rows | None:
        if grp not in self._rows:
            self._rows[grp] = self._build(grp)
        return self._rows[grp]

    def _build(self, grp: int) -> _Rows | None:
        sg = self.sg
        key = sg.group_key[grp]
        if not sg.prod_any[grp] or key not in sg.paths:
            return None
        pin = self.pins.get(grp)
        kinds, node_b = sg.g.node_kind, sg.g.node_b
        nodes = [n for n in sg.prod_any[grp]
                 if pin is None or int(kinds[n]) != _PLACE or int(node_b[n]) in pin]
        width = max((len(sg.kid_gl[n]) for n in nodes), default=0)
        kid = np.zeros((len(nodes), width), dtype=np.int64)
        div = np.ones((len(nodes), width))
        for p, n in enumerate(nodes):
            for m, (h, lay) in enumerate(sg.kid_gl[n]):
                kid[p, m], div[p, m] = self._slot(grp, h, lay)
        index = sg.paths[key].index
        return _Rows(np.asarray(nodes, dtype=np.int64), np.asarray([sg.cost_l[n] for n in nodes], dtype=float),
                     np.asarray([index[sg.node_layout[n]] for n in nodes], dtype=np.int64), kid, div)

    def _slot(self, reader: int, h: int, lay: int) -> tuple[int, float]:
        """Where a read of h's layout `lay` by `reader` finds its value, and its divisor."""
        key = self.sg.group_key[h]
        if key not in self.sg.paths or not self.reads.k[h]:
            return 0, 1.0
        j = self.sg.paths[key].index[lay]
        if h in self.copy_off:
            at = self.copy_off[h].get(reader)
            return (at + j, 1.0) if at is not None else (0, 1.0)
        return int(self.off[h]) + j, float(self.reads.k[h])


@dataclass
class Trace:
    """What the dynamic program chose, for walking its solution down from the roots: per group
    its productions' totals (node() finds the one a source layout took) and the cheapest source
    per layout; for the groups in `keep`, every source's total per layout; for priced groups,
    each copy's source per layout."""

    keep: frozenset[int]
    totals: dict[int, tuple[_Rows, np.ndarray, np.ndarray]] = field(default_factory=dict)  # rows, totals, minima
    arg: dict[int, np.ndarray] = field(default_factory=dict)  # layout index -> source index
    base: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)  # (best, src, totals)
    picks: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # copy -> layout -> source

    _nodes: dict[int, dict[int, int | None]] = field(default_factory=dict)  # grp -> source -> node()

    def node(self, grp: int, src: int) -> int | None:
        """The first production of `grp` at its minimum in source layout `src`, as a scan in
        production order keeps it (None where no production there is finite)."""
        known = self._nodes.get(grp)
        if known is None:
            known = self._nodes[grp] = {}
        if src not in known:
            rows, s, raw = self.totals[grp]
            part = rows.by_layout.get(src)
            ok = part is not None and np.isfinite(raw[src])
            known[src] = int(rows.nodes[part[int(np.argmin(s[part]))]]) if ok else None
        return known[src]

    def record(self, grp: int, rows: _Rows, s: np.ndarray, raw: np.ndarray, best: np.ndarray, src: np.ndarray,
               arg: np.ndarray, base: np.ndarray) -> None:
        self._nodes.pop(grp, None)
        self.totals[grp] = (rows, s, raw)
        self.arg[grp] = src[arg]
        if grp in self.keep:
            self.base[grp] = (best, src, base)


@dataclass
class SplitDP:
    """One evaluation's values, group by group: B_g (splitbound.py), placements outside a
    group's pins left out, lam[g] added to group g's productions by their layout; a copied
    group's value of one read per copy: under its shares, else B_g / k_g plus the copy's price
    of the source layout it reads from (nu, extract/agreement.py), else B_g / k_g."""

    tables: SplitTables
    lam: dict[int, np.ndarray]
    shares: dict[int, Shares]
    nu: Prices = field(default_factory=dict)
    trace: Trace | None = None
    flat: np.ndarray = field(init=False)
    value: list[np.ndarray | None] = field(init=False)

    def __post_init__(self) -> None:
        self.flat = np.zeros(self.tables.size)
        self.value = [None] * self.tables.sg.g.num_groups

    def copy_value(self, h: int, copy: int) -> np.ndarray | None:
        """The value of one read of copied group h by `copy` (None: h is not copied, or unset)."""
        at = self.tables.copy_off.get(h, {}).get(copy)
        if at is None or self.value[h] is None:
            return None
        return self.flat[at:at + self.tables.sizes[h]]

    def sources(self, grp: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Per source layout of `grp`: its cheapest production's total with its operands' shares
        (inf where none), and per production its total (None where the group has no rows)."""
        rows = self.tables.rows(grp)
        best = np.full(self.tables.sizes[grp], np.inf)
        if rows is None:
            return best, None
        s = rows.cost.copy()
        if rows.kid.shape[1]:
            vals = self.flat[rows.kid] / rows.div
            for m in range(vals.shape[1]):  # in operand order, as a scalar sum would
                s += vals[:, m]
        np.minimum.at(best, rows.lay, s)
        return best, s

    def group(self, grp: int) -> None:
        t = self.tables
        rows = t.rows(grp)
        if rows is None:
            return
        sg = t.sg
        raw, s = self.sources(grp)
        best = raw + self.lam[grp] if grp in self.lam else raw
        src = np.flatnonzero(np.isfinite(best))
        if not len(src):
            self._clear(grp)
            return
        dist = sg.paths[sg.group_key[grp]].dist
        every = len(src) == len(best)
        base = (best[:, None] if every else best[src, None]) + sg.weight_l[grp] * (dist if every else dist[src, :])
        o, size = int(t.off[grp]), t.sizes[grp]
        if self.trace is None:
            self.flat[o:o + size] = base.min(axis=0)
        else:
            arg = base.argmin(axis=0)
            self.flat[o:o + size] = base[arg, np.arange(size)]
            self.trace.record(grp, rows, s, raw, best, src, arg, base)
        self.value[grp] = self.flat[o:o + size]
        self.copies(grp, best, src, base)

    def _clear(self, grp: int) -> None:
        o, size = int(self.tables.off[grp]), self.tables.sizes[grp]
        self.flat[o:o + size] = 0.0
        for at in self.tables.copy_off.get(grp, {}).values():
            self.flat[at:at + size] = 0.0
        self.value[grp] = None

    def copies(self, grp: int, best: np.ndarray, src: np.ndarray, base: np.ndarray) -> None:
        """A copied group's value of one read per copy: under its shares, else B_g / k_g; plus
        the copy's price of the source it reads from where it has prices (traced: which)."""
        slots = self.tables.copy_off.get(grp)
        if not slots:
            return
        size, k = self.tables.sizes[grp], self.tables.reads.k[grp]
        sh = self.shares.get(grp)
        per: dict[int, np.ndarray] = {}
        if sh is not None:
            sg = self.tables.sg
            tot = sh.totals(best, src, sg.weight_l[grp] * sg.paths[sg.group_key[grp]].dist[src, :])
            per = {c: tot[i] / m for i, (c, m) in enumerate(zip(sh.copies, sh.reads, strict=True))}
        prices = self.nu.get(grp, {})
        picks = {}
        traced = self.trace is not None and grp in self.trace.keep
        with np.errstate(invalid="ignore"):
            for c, at in slots.items():
                m = prices.get(c)
                if m is None and not traced:
                    self.flat[at:at + size] = per[c].min(axis=0) if sh is not None else self.value[grp] / k
                    continue
                t = per[c] if sh is not None else base / k
                t = t + m[src, None] if m is not None else t
                arg = t.argmin(axis=0)
                self.flat[at:at + size] = t[arg, np.arange(size)]
                picks[c] = src[arg]
        if self.trace is not None and picks:
            self.trace.picks[grp] = picks
