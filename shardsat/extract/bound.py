"""A lower bound on every plan's cost from each value alone: `value_bound`
(`Extractor.lower_bound`). The split bound (extract/splitbound.py) links each operand's layout
to its reader and is the tighter one where it runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .searchgraph import SearchGraph


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
