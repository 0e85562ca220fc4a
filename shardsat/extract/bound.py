"""A lower bound on every plan's cost that links each operand's layout to its consumer.

`Extractor.lower_bound` prices each needed value alone (its cheapest production and one
resharding to some layout it is read in), so a plan whose values disagree on layouts pays
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

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .greedy import Extractor


def _reads(ex: Extractor, roots: list[tuple[int, frozenset[int] | None]]) -> list[int]:
    """k_h per group: the most reads of h by one production, summed over parent groups, plus roots."""
    k = [0] * ex.g.num_groups
    for prods in ex._prod_any:
        most: Counter[int] = Counter()
        for n in prods:
            for h, c in Counter(h for h, _ in ex.kid_gl[n]).items():
                most[h] = max(most[h], c)
        for h, c in most.items():
            k[h] += c
    for grp, _ in roots:
        k[grp] += 1
    return k


def split_bound(ex: Extractor, roots: list[tuple[int, frozenset[int] | None]], passes: int = 2) -> float:
    """The bound above (0.0 where a group's space is unknown)."""
    G = ex.g.num_groups
    k = _reads(ex, roots)
    value: list[np.ndarray | None] = [None] * G
    for _ in range(passes):
        for grp in ex.order:
            prods = ex._prod_any[grp]
            key = ex.group_key[grp]
            if not prods or key not in ex.paths:
                continue
            sp = ex.paths[key]
            best = np.full(len(sp.layouts), np.inf)  # per source layout: the cheapest production
            for n in prods:
                s = ex.cost_l[n]
                for h, lay in ex.kid_gl[n]:
                    vh = value[h]
                    if vh is not None and k[h]:
                        s += vh[ex.paths[ex.group_key[h]].index[lay]] / k[h]
                i = sp.index[ex.node_layout[n]]
                if s < best[i]:
                    best[i] = s
            src = np.flatnonzero(np.isfinite(best))
            if not len(src):
                continue
            value[grp] = (best[src, None] + ex.weight_l[grp] * sp.dist[src, :]).min(axis=0)
    total = 0.0
    for grp, lays in roots:
        vg = value[grp]
        if vg is None or not k[grp]:
            continue
        sp = ex.paths[ex.group_key[grp]]
        ok = [sp.index[lay] for lay in (lays if lays is not None else sp.layouts)
              if not ex.spaces.layouts[lay].partial and lay in sp.index]
        if ok:
            total += float(np.min(vg[ok])) / k[grp]
    return total if np.isfinite(total) else 0.0
