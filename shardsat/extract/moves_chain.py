"""Chain moves: the productions of a producer -> consumer chain (a forward pass, a backward pass)
re-chosen jointly by exact dynamic programming along it (Viterbi), the rest of the plan fixed.
One value at a time cannot switch a chain's layout: each alone would pay resharding both sides."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .planstate import PlanState
from .searchgraph import SearchGraph, improvement_bar

Best = dict[int, tuple[float, int]]  # per chain position: layout -> (cheapest prefix value, node)


def chains(sg: SearchGraph, st: PlanState) -> list[list[int]]:
    """A path cover of the used values along producer -> consumer edges, heaviest tensors
    first: the chains whose layouts must switch together (a forward pass, a backward pass)."""
    choice = st.choice
    edges = []
    for grp, n in choice.items():
        for h in sg.demands(n):
            if h in choice:
                vids = sg.g.group_values[h]
                size = sg.spaces.spaces[sg.group_space[h]].shape if vids else ()
                edges.append((-float(np.prod(size)) if size else 0.0, h, grp))
    edges.sort()
    succ: dict[int, int] = {}
    pred: dict[int, int] = {}
    for _, h, grp in edges:
        if h not in succ and grp not in pred:
            succ[h] = grp
            pred[grp] = h
    out = []
    for start in sorted(choice, key=lambda x: sg.rank[x]):
        if start in pred:
            continue
        chain = [start]
        while chain[-1] in succ:
            chain.append(succ[chain[-1]])
        if len(chain) > 1:
            out.append(chain)
    return out


# per chain neighbourhood (_neighbourhood): the productions its dynamic program proposed, None
# where a position had none. An extractor's runs revisit the same neighbourhoods (two thirds of
# a GPT step's chain moves on 2x4), and the program's outcome depends on nothing else
ChainSeen = dict[tuple, "list[int] | None"]


def relabel_chain(sg: SearchGraph, st: PlanState, chain: list[int], seen: ChainSeen | None = None) -> bool:
    """Re-choose the productions of a chain jointly (exact dynamic programming along the
    chain, the rest of the plan fixed); keep the result if the true DAG cost drops. `seen`:
    proposals by neighbourhood, read and filled (the same costs only: one per extractor)."""
    fixed, off = _outside_demands(sg, st, chain)
    key = _neighbourhood(sg, st, chain, fixed, off) if seen is not None else None
    if seen is not None and key in seen:
        new = seen[key]
    else:
        new = _propose(sg, st, chain, fixed, off)
        if seen is not None:
            seen[key] = new
    if new is None or all(st.choice[grp] == n for grp, n in zip(chain, new, strict=True)):
        return False
    return _accept(sg, st, chain, new)


def _propose(sg: SearchGraph, st: PlanState, chain: list[int], fixed: list[frozenset[int]],
             off: dict[int, frozenset[int]]) -> list[int] | None:
    """The chain's cheapest productions by the dynamic program; None where a position has none."""
    unary = _unary(sg, st, chain, off)
    best: list[Best] = []  # per position: layout -> (value, node)
    back: list[dict[int, int]] = []  # per position: node -> predecessor node
    for i in range(len(chain)):
        cur, links = _position(sg, st, chain, i, unary, best, fixed)
        if not cur:
            return None
        best.append(cur)
        back.append(links)
    return _backtrack(sg, chain, best, back, fixed)


def _neighbourhood(sg: SearchGraph, st: PlanState, chain: list[int], fixed: list[frozenset[int]],
                   off: dict[int, frozenset[int]]) -> tuple:
    """Everything _propose reads of the plan: the chain, what its values' other readers demand
    of them, their production lists (a pinned or tied one's by content: the graph's own by
    identity), and each operand any of their productions may read: whether it is produced and
    by what, and what the rest of the plan demands of it. The graph and its costs are fixed."""
    on_chain = set(chain)
    ops: set[int] = set(off)
    prods: list[tuple[int, ...] | None] = []
    for grp in chain:
        nodes = st.prod[grp]
        prods.append(None if nodes is sg.prod[grp] else tuple(nodes))
        ops |= sg.operands_of(grp, nodes)
    ops -= on_chain
    choice = st.choice
    around = tuple((h, choice.get(h, -1), off.get(h)) for h in sorted(ops))
    return (tuple(chain), tuple(fixed), tuple(prods), around)


def _outside_demands(sg: SearchGraph, st: PlanState, chain: list[int]
                     ) -> tuple[list[frozenset[int]], dict[int, frozenset[int]]]:
    """The layouts demanded of each chain value by everyone except its chain successor, and of
    each off-chain operand of the chain without the chain's own current demands (each set in
    the order of the plan's demand counter: a resharding tree's first sum is taken in it)."""
    choice, demand = st.choice, st.demand
    on_chain = set(chain)
    fixed: list[frozenset[int]] = []
    for i, grp in enumerate(chain):
        mine = sg.demands(choice[chain[i + 1]]).get(grp, ()) if i + 1 < len(chain) else ()
        fixed.append(frozenset(k for k, v in demand[grp].items() if v > mine.count(k)))
    taken: dict[int, dict[int, int]] = {}  # off-chain operand -> layout -> the chain's demands of it
    for grp in chain:
        for h, lays in sg.demands(choice[grp]).items():
            if h not in on_chain:
                t = taken.setdefault(h, {})
                for lay in lays:
                    t[lay] = t.get(lay, 0) + 1
    return fixed, {h: frozenset(k for k, v in demand[h].items() if v > t.get(k, 0)) for h, t in taken.items()}


def _unary(sg: SearchGraph, st: PlanState, chain: list[int], off: dict[int, frozenset[int]]
           ) -> Callable[[int, int], float]:
    """Node n's price at chain position i: its own cost plus its off-chain operands' extra
    resharding (inf if it reads the chain other than through its predecessor)."""
    choice = st.choice
    on_chain = set(chain)
    empty: frozenset[int] = frozenset()
    # an off-chain operand's extra cost for one set of demanded layouts: the same for every
    # production that asks for them
    op_memo: dict[tuple[int, tuple[int, ...]], float] = {}
    cost_l, own, demands, cached = sg.cost_l, sg.own, sg.demands, sg.cache.demands
    prev_of = [-1, *chain[:-1]]  # position i's only allowed on-chain operand (none at 0)

    def unary(i: int, n: int) -> float:
        v = cost_l[n]
        dm = cached.get(n)
        for h, lays in (dm if dm is not None else demands(n)).items():
            if h in on_chain:
                if h != prev_of[i]:
                    return math.inf  # keep chain links the only on-chain dependencies
                continue
            if h not in choice:
                return math.inf
            d = op_memo.get((h, lays))
            if d is None:
                base = off.get(h, empty)
                ph = choice[h]
                d = op_memo[(h, lays)] = own(h, ph, base | frozenset(lays)) - (
                    own(h, ph, base) if base else cost_l[ph])
            v += d
        return v

    return unary


def _position(sg: SearchGraph, st: PlanState, chain: list[int], i: int, unary: Callable[[int, int], float],
              best: list[Best], fixed_sets: list[frozenset[int]]) -> tuple[Best, dict[int, int]]:
    """Position i of the dynamic program: per layout the cheapest chain prefix ending in a
    production of chain[i] there, and per production the predecessor node it extends."""
    node_layout, demands, cached = sg.node_layout, sg.demands, sg.cache.demands
    cur: Best = {}
    links: dict[int, int] = {}
    w_memo: dict[tuple[int, ...], tuple[float, int]] = {}
    prev_rows: Ranked | None = None
    prev = chain[i - 1] if i > 0 else -1
    isfinite = math.isfinite
    for n in st.prod[chain[i]]:
        u = unary(i, n)
        if not isfinite(u):
            continue
        if i > 0:
            dm = cached.get(n)
            need = (dm if dm is not None else demands(n)).get(prev, ())
            hit = w_memo.get(need)
            if hit is None:
                if prev_rows is None:
                    prev_rows = Ranked(sg, prev, best[i - 1])
                hit = w_memo[need] = _link(sg, prev, prev_rows, fixed_sets[i - 1] | frozenset(need))
            u += hit[0]
            links[n] = hit[1]
        lay = node_layout[n]
        old = cur.get(lay)
        if old is None or u < old[0]:
            cur[lay] = (u, n)
    return cur, links


class Ranked:
    """The predecessor position's entries (value, entry number, layout row, node), cheapest
    first: resharding costs are >= 0, so once a layout's own value exceeds the best total no
    later one can win (ties go to the earlier layout, as in a scan of all of them). The same
    as columns for the spaces priced a whole row at a time."""

    def __init__(self, sg: SearchGraph, prev: int, best_prev: Best) -> None:
        index = sg.paths[sg.group_key[prev]].index
        self.rows = sorted(((val, k, index[lay], pn) for k, (lay, (val, pn)) in enumerate(best_prev.items())))
        self._cols: tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None = None

    def cols(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        if self._cols is None:
            self._cols = (np.array([r[0] for r in self.rows], dtype=float),
                          np.array([r[1] for r in self.rows], dtype=np.int64),
                          np.array([r[2] for r in self.rows], dtype=np.int64), [r[3] for r in self.rows])
        return self._cols


def _link_cols(sg: SearchGraph, prev: int, ranked: Ranked, t: frozenset[int]) -> tuple[float, int]:
    """_link over every entry at once: the cheapest total, ties to the lowest entry number,
    (inf, -1) where none is finite, exactly as the scan."""
    vals, ks, rs, pns = ranked.cols()
    tot = vals + sg.weight_l[prev] * sg.steiner_costs(prev, t)[rs]
    tot[np.isnan(tot)] = math.inf  # 0 x inf: a row the scan skips
    m = float(tot.min()) if len(tot) else math.inf
    if not math.isfinite(m):
        return math.inf, -1
    tied = np.flatnonzero(tot == m)
    return m, pns[int(tied[np.argmin(ks[tied])])]


def _link(sg: SearchGraph, prev: int, ranked: Ranked, t: frozenset[int]) -> tuple[float, int]:
    """The cheapest prefix through `prev` once resharded to the layouts `t` asked of it: its
    value and its node."""
    bv, bn = math.inf, -1
    bk = -1
    prev_rows = ranked.rows
    if t and sg.prices_rows(prev):
        return _link_cols(sg, prev, ranked, t)
    if not t:
        for val, k, _, pn in prev_rows:
            if val > bv:
                break
            if val < bv or (val == bv and k < bk):
                bv, bn, bk = val, pn, k
        return bv, bn
    wp = sg.weight_l[prev]
    layouts_prev = sg.paths[sg.group_key[prev]].layouts
    row = sg.steiner_row(prev, t)
    for val, k, r, pn in prev_rows:
        if val > bv:
            break
        c = row[r]
        if c is None:
            c = row[r] = sg.steiner_cost(prev, layouts_prev[r], t)
        tot = val + wp * c
        if tot <= bv and (tot < bv or k < bk):
            bv, bn, bk = tot, pn, k
    return bv, bn


def _backtrack(sg: SearchGraph, chain: list[int], best: list[Best], back: list[dict[int, int]],
               fixed: list[frozenset[int]]) -> list[int]:
    """The cheapest chain's productions, the last value's resharding to its other readers included."""
    last = chain[-1]
    bv, bn = math.inf, -1
    for lay, (val, n) in best[-1].items():
        t = fixed[-1]
        tot = val + (sg.weight[last] * sg.steiner_cost(last, lay, t) if t else 0.0)
        if tot < bv:
            bv, bn = tot, n
    new = [bn]
    for i in range(len(chain) - 1, 0, -1):
        new.append(back[i][new[-1]])
    new.reverse()
    return new


def _accept(sg: SearchGraph, st: PlanState, chain: list[int], new: list[int]) -> bool:
    """Apply the chain's new productions if the exact cost of every value they touch drops."""
    touched = set(chain)
    for grp, n in zip(chain, new, strict=True):
        touched |= set(sg.demands(st.choice[grp])) | set(sg.demands(n))
    before = st.cost_of(sg, touched)
    old = {grp: st.choice[grp] for grp in chain}
    st.set(sg, chain, new)
    after = st.cost_of(sg, touched)
    if after < improvement_bar(before):
        return True
    st.set(sg, chain, [old[grp] for grp in chain])
    return False
