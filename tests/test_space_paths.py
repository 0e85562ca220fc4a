"""All-pairs resharding paths and the chain search's whole-row tree prices.

Spaces of a rank-4 value on a 4-axis mesh have over a thousand layouts: Floyd-Warshall there
took 10 s a space and a conv net on 2x2x2x2 planned in 750 s (benchmarks/experts). Large spaces
take Dijkstra, and the chain search prices a whole row of trees at once; both must agree with
the small-space code exactly (distances) and bit for bit (tree sums)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardsat.extract.searchgraph as searchgraph
from shardsat.extract.searchgraph import SearchCache, SearchGraph
from shardsat.extract.spacepaths import SpacePaths, _dijkstra, _floyd


def _random_space(seed: int, n: int) -> tuple[SpacePaths, SpacePaths]:
    """A random directed resharding graph with many equal prices (ties between paths are the
    rule in real spaces), as SpacePaths under both algorithms."""
    rng = random.Random(seed)
    direct: dict[tuple[int, int], float] = {}
    for u in range(n):
        for v in rng.sample(range(n), min(n, rng.randint(1, 5))):
            if u != v:
                direct[(u, v)] = rng.choice([1e-6, 2e-6, 3e-6, 0.0, rng.random() * 1e-5])
    layouts = tuple(range(100, 100 + n))
    index = {lid: i for i, lid in enumerate(layouts)}
    out = []
    for algo in (_floyd, _dijkstra):
        dist, pred = algo(n, direct)
        out.append(SpacePaths(index, layouts, dist, pred, {}, dict(direct)))
    return out[0], out[1]


def _walk(sp: SpacePaths, src: int, targets: frozenset[int]) -> float:
    holder = SimpleNamespace(cache=SearchCache())
    return SearchGraph._steiner_sum(holder, (0, src, targets), sp, src, targets)  # type: ignore[arg-type]


@given(st.integers(0, 10_000), st.integers(2, 30))
def test_dijkstra_distances_equal_floyd(seed: int, n: int) -> None:
    fl, dj = _random_space(seed, n)
    assert (np.isfinite(fl.dist) == np.isfinite(dj.dist)).all()
    fin = np.isfinite(fl.dist)
    np.testing.assert_allclose(fl.dist[fin], dj.dist[fin], rtol=1e-12, atol=1e-18)
    # every predecessor chain reaches its source (no cycle, free edges included) and is a
    # cheapest path: walking it sums to the distance
    for s in range(n):
        for t in range(n):
            if fin[s, t]:
                x, steps = t, 0
                while x != s and steps <= n:
                    x, steps = int(dj.pred[s, x]), steps + 1
                assert x == s, (s, t)
                assert _walk(dj, 100 + s, frozenset({100 + t})) == pytest.approx(dj.dist[s, t], rel=1e-12, abs=1e-18)


@given(st.integers(0, 10_000), st.integers(2, 30))
def test_dijkstra_pred_is_the_lowest_tight_edge(seed: int, n: int) -> None:
    """Ties are broken by a rule, not by scipy's heap order: each step back from a target is the
    lowest-numbered layout on a cheapest last edge (free edges aside), whatever order the edges
    came in."""
    rng = random.Random(seed)
    direct = {(u, v): rng.choice([1e-6, 2e-6, 3e-6]) for u in range(n) for v in rng.sample(range(n), min(n, 4)) if u != v}
    dist, pred = _dijkstra(n, direct)
    shuffled = list(direct.items())
    rng.shuffle(shuffled)
    assert (_dijkstra(n, dict(shuffled))[1] == pred).all()
    for s in range(n):
        for t in range(n):
            tight = [u for (u, v), c in direct.items()
                     if v == t and dist[s, u] < dist[s, t] and math.isclose(dist[s, u] + c, dist[s, t], rel_tol=1e-12)]
            assert pred[s, t] == (min(tight) if tight and s != t else -1), (s, t)


@given(st.integers(0, 10_000), st.integers(2, 30), st.data())
def test_tree_sums_bit_identical_to_the_walk(seed: int, n: int, data: st.DataObject) -> None:
    fl, dj = _random_space(seed, n)
    targets = frozenset(data.draw(st.lists(st.integers(100, 99 + n), min_size=1, max_size=4)))
    for sp in (fl, dj):
        row = sp.tree_sums(targets)
        for s in range(n):
            want = _walk(sp, 100 + s, targets)
            assert row[s] == want or (math.isinf(want) and math.isinf(row[s])), (s, row[s], want)


def test_chain_search_same_plan_with_rows_priced_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-row pricing is the scan's arithmetic: forcing it on every space leaves the
    plan and its cost bit-identical."""
    import jax
    import jax.numpy as jnp

    import shardsat
    from shardsat.runtime.record import decisions
    from shardsat.testing import check_plan

    def step(w1: jax.Array, w2: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        def loss(w1: jax.Array, w2: jax.Array) -> jax.Array:
            return jnp.mean(jnp.tanh(x @ w1) @ w2)
        g1, g2 = jax.grad(loss, (0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    args = (jnp.ones((64, 128)) * 0.01, jnp.ones((128, 64)) * 0.02, jnp.arange(32 * 64.0).reshape(32, 64) / 1e3)
    plans = []
    for threshold in (10**9, 0):
        monkeypatch.setattr(searchgraph, "ROW_WALK_MIN", threshold)
        plans.append(shardsat.saturate_and_extract(step, mesh, *args, priors=None))
    assert plans[0].cost.total_s == plans[1].cost.total_s
    assert decisions(plans[0]) == decisions(plans[1])
    check_plan(plans[1], *args)
