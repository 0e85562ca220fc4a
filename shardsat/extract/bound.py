"""Lower bounds on every plan's cost: `value_bound` per value alone, `split_bound` linking each
operand's layout to its consumer.

`value_bound` (`Extractor.lower_bound`) prices each needed value alone (its cheapest production
and one resharding to some layout it is read in), so a plan whose values disagree on layouts pays
communication the bound never sees: its gaps read 35-74% on GPT steps. Here a value in layout
l costs, in a dynamic program over the value groups in topological order,

    B_g(l) = min over productions n of g of  cost(n) + w_g dist(layout(n), l)
                                             + sum over operands (h, l_h) of n of B_h(l_h) / k_h

where k_h counts the places a plan can read h: per parent group the most times one of its
productions reads h, plus the root entries of h. In any plan each group's share of the sum is
then at most 1 (by induction from the roots down: a group's share is the sum of its readers'
shares times their reads over k_h), its production is at least the cheapest one, and its
resharding tree at least the longest of the paths it serves: the bound is at most the plan's
cost. Starting every B at 0 keeps that true after any number of passes (each pass is a
monotone map and the plan's own values are a fixed point above 0), so cycles through user
rewrites only cost precision, not validity.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .searchgraph import SearchGraph

if TYPE_CHECKING:
    from .greedy import Extractor


def value_bound(sg: SearchGraph, roots: Sequence[tuple[int, frozenset[int] | None]]) -> float:
    """Seconds no plan can beat. A value is needed by every plan if it is an output or an
    operand of every production of a needed value. Each needed value costs at least its
    cheapest production plus the cheapest resharding from that production's layout to a
    layout some consumer reads it in (an output: to its allowed layouts), so a gradient
    produced as a pending sum pays at least one reduction. Operand layouts are not linked
    across values, so the bound is loose where communication dominates."""
    layouts = sg.spaces.layouts
    read_in: dict[int, set[int]] = {}
    for prods in sg.prod_any:
        for n in prods:
            for h, lay in sg.kid_gl[n]:
                read_in.setdefault(h, set()).add(lay)
    needed = {grp for grp, _ in roots}
    stack = list(needed)
    while stack:
        grp = stack.pop()
        common: set[int] | None = None
        for n in sg.prod_any[grp]:
            ops = {h for h, _ in sg.kid_gl[n]}
            common = ops if common is None else common & ops
        for h in (common or ()):
            if h not in needed:
                needed.add(h)
                stack.append(h)
    allowed: dict[int, list[frozenset[int] | None]] = {}
    for grp, lays in roots:
        allowed.setdefault(grp, []).append(lays)
    total = 0.0
    for grp in sorted(needed):
        prods = sg.prod_any[grp]
        if not prods:
            return 0.0  # an input with no placement: no bound
        sp = sg.paths[sg.group_key[grp]]
        w = sg.weight_l[grp]
        reads = read_in.get(grp, set())
        # per source layout: the cheapest resharding to a layout it must reach
        need = np.zeros(len(sp.layouts))
        if reads and grp not in allowed:  # an output may be read by no one else
            need = sp.dist[:, [sp.index[lay] for lay in reads]].min(axis=1)
        for lays in allowed.get(grp, ()):
            ok = [sp.index[lay] for lay in (lays if lays is not None else sp.layouts) if not layouts[lay].partial]
            need = np.maximum(need, sp.dist[:, ok].min(axis=1) if ok else math.inf)
        need_l = need.tolist()
        index = sp.index
        total += min(sg.cost_l[n] + w * need_l[index[sg.node_layout[n]]] for n in prods)
    return float(total) if math.isfinite(total) else 0.0


def _reads(sg: SearchGraph, roots: list[tuple[int, frozenset[int] | None]]) -> list[int]:
    """k_h per group: the most reads of h by one production, summed over parent groups, plus roots."""
    k = [0] * sg.g.num_groups
    for prods in sg.prod_any:
        most: Counter[int] = Counter()
        for n in prods:
            for h, c in Counter(h for h, _ in sg.kid_gl[n]).items():
                most[h] = max(most[h], c)
        for h, c in most.items():
            k[h] += c
    for grp, _ in roots:
        k[grp] += 1
    return k


def split_bound(ex: Extractor, roots: list[tuple[int, frozenset[int] | None]], passes: int = 2) -> float:
    """The split bound (0.0 where a group's space is unknown)."""
    sg = ex.graph
    G = sg.g.num_groups
    k = _reads(sg, roots)
    value: list[np.ndarray | None] = [None] * G
    for _ in range(passes):
        for grp in sg.order:
            prods = sg.prod_any[grp]
            key = sg.group_key[grp]
            if not prods or key not in sg.paths:
                continue
            sp = sg.paths[key]
            best = np.full(len(sp.layouts), np.inf)  # per source layout: the cheapest production
            for n in prods:
                s = sg.cost_l[n]
                for h, lay in sg.kid_gl[n]:
                    vh = value[h]
                    if vh is not None and k[h]:
                        s += vh[sg.paths[sg.group_key[h]].index[lay]] / k[h]
                i = sp.index[sg.node_layout[n]]
                if s < best[i]:
                    best[i] = s
            src = np.flatnonzero(np.isfinite(best))
            if not len(src):
                continue
            value[grp] = (best[src, None] + sg.weight_l[grp] * sp.dist[src, :]).min(axis=0)
    total = 0.0
    for grp, lays in roots:
        vg = value[grp]
        if vg is None or not k[grp]:
            continue
        sp = sg.paths[sg.group_key[grp]]
        ok = [sp.index[lay] for lay in (lays if lays is not None else sp.layouts)
              if not sg.spaces.layouts[lay].partial and lay in sp.index]
        if ok:
            total += float(np.min(vg[ok])) / k[grp]
    return total if np.isfinite(total) else 0.0
