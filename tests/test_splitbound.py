"""The split bound (shardsat/extract/splitbound.py) on training steps: never above the optimum
the integer program proves, and tight where state is loop-carried and the plan is good.

The synthetic e-graphs of test_exact.py have no ties; here the ties and the pinned placements
come from real programs (`state_argnums`, `in_shardings`)."""

import time

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import H100_GPU
from jax.sharding import PartitionSpec as P
from test_invariant import MESHES, PROFILE, mlp_step

import shardsat
from shardsat import api
from shardsat.extract import splitdp
from shardsat.extract.agreement import agreed_bound
from shardsat.extract.greedy import Extractor
from shardsat.extract.splitbound import split_bound, split_rounds

S = jax.ShapeDtypeStruct


def planned(monkeypatch, fn, mesh, *args, rounds=40, **kw):
    """The plan, and the bounds of its problem: split_bound with and without the ties, and with
    `rounds` rounds of agreement prices."""
    seen = {}
    real = api.best_plan

    def spy(p, node_cost, *a, **k):
        seen.setdefault("problem", (p, node_cost))
        return real(p, node_cost, *a, **k)

    monkeypatch.setattr(api, "best_plan", spy)
    plan = shardsat.saturate_and_extract(fn, mesh, *args, **{"profile": PROFILE, **kw})
    p, node_cost = seen["problem"]
    ex = Extractor(p.graph, node_cost, p.value_space, p.spaces, p.edges, p.model, describe=p.describe,
                   combinable=p.combinable, weight=p.weight)
    tied = split_bound(ex, p.roots, ties=p.ties, pins=p.place_pins, plan=plan.extraction)
    plain = split_bound(ex, p.roots, pins=p.place_pins)
    pins = p.place_pins or {}
    split = split_rounds(ex.graph, p.roots, p.ties, pins, plan.extraction)
    agreed = agreed_bound(ex.graph, p.roots, split, plan.extraction.total_s, float("inf"), max_rounds=rounds)
    return plan, tied, plain, agreed


# (layers, d, h, batch, optimizer, mesh): small enough that the integer program proves its plan
# optimal; the bound must then be at most that plan's cost
OPTIMAL = [(1, 64, 256, 64, "momentum", "8"), (2, 64, 256, 64, "adam", "8"), (1, 32, 96, 24, "adam", "2x4"),
           (2, 32, 64, 64, "momentum", "4x2"), (1, 48, 256, 8, "adam", "1x8")]


@pytest.mark.parametrize("cfg", OPTIMAL, ids=[f"{c[0]}L-d{c[1]}-{c[4]}-{c[5]}" for c in OPTIMAL])
def test_bound_below_the_proven_optimum(monkeypatch, cfg):
    layers, d, h, batch, opt, mesh = cfg
    step, args = mlp_step(layers, d, h, batch, opt)
    plan, tied, plain, agreed = planned(monkeypatch, step, jax.make_mesh(*MESHES[mesh]), *args,
                                        state_argnums=(0, 1), extraction="exact")
    assert plan.extraction.exact_status == "optimal"
    opt_s = plan.extraction.total_s
    assert 0.0 <= plain <= tied <= agreed <= opt_s * (1 + 1e-9), (plain, tied, agreed, opt_s)


def test_bound_below_pinned_plans(monkeypatch):
    """With pins the bound bounds the pinned problem: below its plan, above the free bound."""
    step, args = mlp_step(2, 64, 256, 64, "adam")
    mesh = jax.make_mesh(*MESHES["8"])
    _, free, _, free_agreed = planned(monkeypatch, step, mesh, *args, state_argnums=(0, 1))
    rep = jax.tree.map(lambda _: P(), args[:2])
    pinned, tied, _, agreed = planned(monkeypatch, step, mesh, *args, state_argnums=(0, 1),
                                      in_shardings=(*rep, P("data")))
    assert free <= tied * (1 + 1e-9) and tied <= agreed <= pinned.extraction.total_s * (1 + 1e-9)
    assert free_agreed <= pinned.extraction.total_s * (1 + 1e-9)


def test_zero_plan_is_proven_within_three_percent(monkeypatch):
    """A 6-layer MLP step with AdamW on 8 H100s: the plan keeps weights and moments split and
    gathers them (ZeRO). Without the ties the bound places the weights replicated for free and
    reads 27% below the plan; priced as returned, it is 2.7% below."""
    d, batch, layers = 512, 4096, 6
    tx = optax.adamw(1e-3)

    def loss(ws, x, y):
        for w in ws:
            x = jax.nn.relu(x @ w)
        return jnp.mean((x - y) ** 2)

    def step(state, x, y):
        ws, s = state
        u, s = tx.update(jax.grad(loss)(ws, x, y), s, ws)
        return optax.apply_updates(ws, u), s

    ws = [S((d, d), jnp.float32)] * layers
    args = ((ws, jax.eval_shape(tx.init, ws)), S((batch, d), jnp.float32), S((batch, d), jnp.float32))
    plan, tied, plain, _ = planned(monkeypatch, step, jax.make_mesh((8,), ("data",)), *args, state_argnums=(0,),
                                   profile=H100_GPU)
    cost = plan.extraction.total_s
    assert tied <= cost * (1 + 1e-9)
    assert tied >= 0.97 * cost, (tied, plain, cost)
    assert plain <= 0.9 * cost, (tied, plain, cost)
    assert plan.report.lower_bound_s >= tied * (1 - 1e-9) and plan.report.gap <= 0.03


def test_bound_is_the_same_on_a_loaded_machine(monkeypatch):
    """The agreement rounds run for a count of evaluations, not seconds: a dynamic program 200x
    slower (a loaded machine) gives the same bound and gap. Under a time budget it ran fewer
    rounds and the gap of one plan varied by machine (issue 17: 13.2% and 14.9% for llama)."""
    step, args = mlp_step(2, 64, 256, 64, "adam")
    mesh = jax.make_mesh(*MESHES["2x4"])
    plan, tied, _, _ = planned(monkeypatch, step, mesh, *args, state_argnums=(0, 1))
    assert plan.report.lower_bound_s > tied * 1.01  # the agreement prices raised it
    real = splitdp.SplitDP.group

    def slow(self, grp):
        time.sleep(2e-4)
        return real(self, grp)

    monkeypatch.setattr(splitdp.SplitDP, "group", slow)
    loaded = shardsat.saturate_and_extract(step, mesh, *args, profile=PROFILE, state_argnums=(0, 1))
    assert loaded.extraction.total_s == plan.extraction.total_s
    assert loaded.report.lower_bound_s == plan.report.lower_bound_s
    assert loaded.report.gap == plan.report.gap


def test_the_bound_is_computed_when_first_read_and_is_the_same_then(monkeypatch, tmp_path):
    """The bound only reports, and its agreement rounds were a quarter of a training step's
    planning: it is computed when the gap is first read (once, for the plan and its report),
    and it is the same bound however late that is: after explain(), when the plan is saved,
    and against a plan whose gap was read at once."""
    from shardsat.extract import search

    calls = []
    real = search._lower_bound

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(search, "_lower_bound", counted)
    step, args = mlp_step(2, 64, 256, 64, "adam")
    mesh = jax.make_mesh(*MESHES["2x4"])
    kw = dict(profile=PROFILE, state_argnums=(0, 1))
    now = shardsat.saturate_and_extract(step, mesh, *args, **kw)
    gap, bound = now.report.gap, now.report.lower_bound_s
    assert len(calls) == 1 and gap is not None and 0.0 < bound <= now.extraction.total_s * (1 + 1e-9)
    later = shardsat.saturate_and_extract(step, mesh, *args, **kw)
    assert len(calls) == 1 and later.report.bound.pending is not None  # planned, not yet bounded
    later.explain()
    loaded = shardsat.load_plan(later.save(tmp_path / "plan.json"), step, mesh, *args)
    assert len(calls) == 2  # saving read it
    assert later.report.gap == later.extraction.gap == loaded.report.gap == gap
    assert later.report.lower_bound_s == later.extraction.lower_bound_s == loaded.report.lower_bound_s == bound
    assert len(calls) == 2 and later.report.bound.seconds > 0.0
