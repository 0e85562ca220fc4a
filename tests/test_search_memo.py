"""The local search's shortcuts give the plans the plain computation gives: a chain move's
proposal remembered by its neighbourhood (extract/moves_chain.py), and the start's estimate
reached in Python or numpy (extract/start.py). Each is checked against the plain computation
on every call of real searches."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import shardsat
from shardsat.extract import greedy, moves_chain, start

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

PROFILE = shardsat.DeviceProfile(flops_per_s=100e12, hbm_bytes_per_s=2e12, link_bytes_per_s=100e9, latency_s=5e-6)


def _gpt_step():
    cfg = GPTConfig(layers=1, d_model=32, heads=2, mlp=64, vocab=64, seq=16, batch=8)
    _, step = make_gpt_step(cfg)
    params = gpt_params(cfg, abstract=True)
    return step, ((params, jax.eval_shape(optax.adamw(1e-3).init, params)), gpt_batch(cfg, abstract=True))


def _plan(mesh_shape: tuple[int, ...]) -> shardsat.Plan:
    step, args = _gpt_step()
    names = ("data", "fsdp", "model")[-len(mesh_shape):]
    return shardsat.saturate_and_extract(step, jax.make_mesh(mesh_shape, names), *args, profile=PROFILE,
                                         state_argnums=(0,))


@pytest.mark.parametrize("mesh_shape", [(2, 4), (2, 2, 2)])
def test_a_remembered_chain_proposal_is_the_one_the_program_makes(monkeypatch, mesh_shape):
    """Every chain move of a plan's searches (local search, families, their releases; pinned,
    seeded and tied inputs) recomputes its proposal: where its neighbourhood was seen before,
    the remembered proposal is the same. The memory must be used, or this checks nothing."""
    real = moves_chain.relabel_chain
    made: dict[tuple, list[int] | None] = {}
    seen_again = [0]

    def checked(sg, st, chain, seen=None):
        fixed, off = moves_chain._outside_demands(sg, st, chain)
        key = (id(sg), moves_chain._neighbourhood(sg, st, chain, fixed, off))
        fresh = moves_chain._propose(sg, st, chain, fixed, off)
        if key in made:
            seen_again[0] += 1
            assert made[key] == fresh, chain
        made[key] = fresh
        return real(sg, st, chain, seen)

    monkeypatch.setattr(greedy, "relabel_chain", checked)
    _plan(mesh_shape)
    assert seen_again[0] > len(made) // 4, (seen_again[0], len(made))


def test_the_chain_memory_changes_no_plan(monkeypatch):
    """The same plan, to the production, with the memory and without it."""
    remembered = _plan((2, 4))
    real = moves_chain.relabel_chain
    monkeypatch.setattr(greedy, "relabel_chain", lambda sg, st, chain, seen=None: real(sg, st, chain, None))
    plain = _plan((2, 4))
    assert {g: c.node for g, c in plain.extraction.choices.items()} == {
        g: c.node for g, c in remembered.extraction.choices.items()}
    assert plain.extraction.total_s == remembered.extraction.total_s


def _plain_estimates(sg, st) -> list[float]:
    """The estimate as computed before the Python reach: a numpy row minimum per value."""
    uses = [float(max(1, len(ps))) for ps in sg.parents]
    for grp, _ in st.roots:
        uses[grp] += 1
    est = [math.inf] * sg.g.num_classes
    for grp in sg.order:
        if not sg.group_classes[grp]:
            continue
        sp = sg.paths[sg.group_key[grp]]
        prod_est = np.full(len(sp.layouts), math.inf)
        for n in st.prod[grp]:
            v = sg.cost_l[n] + sum(est[c] / uses[sg.class_group_l[c]] for c in sg.kids[n])
            r = sp.index[sg.node_layout[n]]
            if v < prod_est[r]:
                prod_est[r] = v
        finite = np.isfinite(prod_est)
        if not finite.any():
            continue
        reach = np.min(prod_est[finite][:, None] + sg.weight_l[grp] * sp.dist[finite], axis=0).tolist()
        for c in sg.group_classes[grp]:
            est[c] = reach[sp.index[sg.class_layout_l[c]]]
    return est


@pytest.mark.parametrize("pairs", [0, start.PY_REACH_PAIRS, 10**9])
def test_the_estimate_is_the_plain_one_to_the_bit(monkeypatch, pairs):
    """Reached in Python (small values), in numpy (the rest), or all one way: every start of a
    plan's searches gets the estimate and the top-down choice the plain computation gives."""
    monkeypatch.setattr(start, "PY_REACH_PAIRS", pairs)
    real_est, real_top = start.estimates, start.choose_top_down
    calls = [0]

    def checked_est(sg, st):
        est, uses, node_v = real_est(sg, st)
        assert est == _plain_estimates(sg, st)  # inf == inf; NaN would fail, and must not occur
        calls[0] += 1
        return est, uses, node_v

    def checked_top(sg, st, est, uses, node_v):
        plain = st.copy()
        real_top(sg, plain, est, uses, {})  # every production weighed afresh
        real_top(sg, st, est, uses, node_v)
        assert st.choice == plain.choice and st.demand == plain.demand

    monkeypatch.setattr(greedy, "estimates", checked_est)
    monkeypatch.setattr(greedy, "choose_top_down", checked_top)
    _plan((2, 4))
    assert calls[0] > 5


def test_a_chain_of_pinned_productions_is_another_neighbourhood(monkeypatch):
    """A chain whose first value is an input, planned again with that input narrowed to fewer
    productions (a family's pins) around the same plan: its dynamic program runs again (it may
    not propose the production left out); with the same productions in another list, it does not."""
    problems = []
    real_best = shardsat.api.best_plan
    monkeypatch.setattr(shardsat.api, "best_plan", lambda p, *a, **k: problems.append(p) or real_best(p, *a, **k))
    _plan((2, 4))
    p = problems[0]
    ex = greedy.Extractor(p.graph, p.node_cost, p.value_space, p.spaces, p.edges, p.model, combinable=p.combinable,
                          weight=p.weight)
    sg, st = ex.graph, ex.run(p.roots, math.inf, explain=False).state
    chain = next(c for c in moves_chain.chains(sg, st) if len(st.prod[c[0]]) > 1 and not sg.kids[st.choice[c[0]]])
    proposed = [0]
    real_propose = moves_chain._propose
    monkeypatch.setattr(moves_chain, "_propose", lambda *a: proposed.__setitem__(0, proposed[0] + 1) or real_propose(*a))
    seen: moves_chain.ChainSeen = {}
    for _ in range(2):  # a pinned list is a new one each run: known by its contents
        same = st.copy()
        same.prod[chain[0]] = list(st.prod[chain[0]])
        moves_chain.relabel_chain(sg, same, chain, seen)
    assert proposed[0] == 1
    narrowed = st.copy()
    narrowed.prod[chain[0]] = [n for n in st.prod[chain[0]] if n != st.choice[chain[0]]]
    moves_chain.relabel_chain(sg, narrowed, chain, seen)
    assert proposed[0] == 2


def test_a_space_moves_saving_is_the_same_with_the_values_costs_kept(monkeypatch):
    """Every tensor-space move a plan's searches try saves, to the bit, what it saves priced
    afresh: the values' seconds kept between tries (`now`) are those of the plan as it is."""
    from shardsat.extract import moves_space

    real = moves_space.try_moves
    tried = [0]

    def checked(sg, st, plan, tie_roots, keep, now=None):
        if now is not None:
            assert real(sg, st, plan, tie_roots, keep=False) == real(sg, st, plan, tie_roots, keep=False, now=now)
            tried[0] += 1
        return real(sg, st, plan, tie_roots, keep, now)

    monkeypatch.setattr(moves_space, "try_moves", checked)
    _plan((2, 4))
    assert tried[0] > 10


def _counted_outside_demands(sg, st, chain):
    """moves_chain._outside_demands as it was, with Counters copied and decremented."""
    from collections import Counter

    fixed = []
    for i, grp in enumerate(chain):
        d = st.demand[grp].copy()
        if i + 1 < len(chain):
            for lay in sg.demands(st.choice[chain[i + 1]]).get(grp, ()):
                d[lay] -= 1
        fixed.append(frozenset(Counter({k: v for k, v in d.items() if v > 0})))
    off = {}
    for grp in chain:
        for h, lays in sg.demands(st.choice[grp]).items():
            if h not in chain:
                d = off.setdefault(h, st.demand[h].copy())
                for lay in lays:
                    d[lay] -= 1
    return fixed, {h: frozenset(Counter({k: v for k, v in d.items() if v > 0})) for h, d in off.items()}


def test_a_chains_outside_demands_are_the_counted_ones_in_their_order(monkeypatch):
    """The sets a chain move prices, on every chain move of a plan's searches: the same layouts
    as Counters copied and decremented gave, iterated in the same order (a resharding tree's
    first float sum is taken in it)."""
    real = moves_chain._outside_demands
    calls = [0]

    def checked(sg, st, chain):
        fixed, off = real(sg, st, chain)
        want_fixed, want_off = _counted_outside_demands(sg, st, chain)
        assert [list(f) for f in fixed] == [list(f) for f in want_fixed]
        assert {h: list(s) for h, s in off.items()} == {h: list(s) for h, s in want_off.items()}
        calls[0] += 1
        return fixed, off

    monkeypatch.setattr(moves_chain, "_outside_demands", checked)
    _plan((2, 2, 2))
    assert calls[0] > 100


def _looped_node_bytes(p, per_run):
    """search.node_bytes as it was: one e-node at a time."""
    from shardsat.extract import search

    g = p.graph
    out = np.zeros(g.num_nodes)
    group_space = g.group_spaces(p.value_space)
    for n in range(g.num_nodes):
        c = int(g.node_class[n])
        grp = int(g.class_group[c])
        sp = group_space[grp]
        if sp < 0:
            continue
        if int(g.node_kind[n]) == search.NodeKind.PLACE:
            out[n] = p.spaces.shard_bytes(p.spaces.spaces[sp], int(g.node_b[n]))
        elif int(g.node_kind[n]) == search.NodeKind.LOCAL:
            size = p.spaces.shard_bytes(p.spaces.spaces[sp], int(g.class_layout[c]))
            out[n] = search.ACTIVATION_WEIGHT * size / (1.0 if per_run else float(p.weight[grp]))
    return out


def test_node_bytes_are_the_looped_ones(monkeypatch):
    """The bytes the memory-pressure searches price, per e-node, computed in numpy: the same
    floats as one node at a time, for a step with a scanned loop (its values weighed by their
    runs) and for a training step."""
    from shardsat.extract import search

    problems = []
    real_best = shardsat.api.best_plan
    monkeypatch.setattr(shardsat.api, "best_plan", lambda p, *a, **k: problems.append(p) or real_best(p, *a, **k))

    def scanned(ws, x):
        def body(h, w):
            return jax.numpy.tanh(h @ w), None
        return jax.lax.scan(body, x, ws)[0].sum()

    S = jax.ShapeDtypeStruct
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardsat.saturate_and_extract(jax.grad(scanned), mesh, S((4, 32, 32), np.float32), S((16, 32), np.float32),
                                  profile=PROFILE)
    _plan((2, 4))
    assert any((p.weight > 1).any() for p in problems)
    for p in problems:
        for per_run in (False, True):
            got = search.node_bytes(p, per_run)
            assert got.tobytes() == _looped_node_bytes(p, per_run).tobytes()
            assert search.node_bytes(p, per_run) is got  # once per problem
