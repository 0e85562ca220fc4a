"""The optimizer's reductions lowered so that XLA's combiner cannot chain them (runtime/combine.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import shardsat
from shardsat.runtime.combine import _held_back
from shardsat.runtime.hlo import count_collectives
from shardsat.testing import check_collectives, check_plan

D, LAYERS, BATCH = 512, 4, 2048
OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


def _loss(p, x, y):
    h = x
    for i in range(LAYERS):
        h = jnp.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
    return jnp.mean((h - y) ** 2)


def _step(p, o, x, y):
    loss, g = jax.value_and_grad(_loss)(p, x, y)
    u, o = OPT.update(g, o, p)
    return optax.apply_updates(p, u), o, loss


@pytest.fixture(scope="module")
def clipped():
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    p = {f"w{i}": jax.random.normal(keys[i], (D, D)) / np.sqrt(D) for i in range(LAYERS)}
    p |= {f"b{i}": jnp.zeros(D) for i in range(LAYERS)}
    args = (p, OPT.init(p), jax.random.normal(keys[-2], (BATCH, D)), jax.random.normal(keys[-1], (BATCH, D)))
    mesh = jax.make_mesh((1, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    return shardsat.saturate_and_extract(_step, mesh, *args, state_argnums=(0, 1), profile="h100"), args


def _entry_all_reduces(hlo: str) -> int:
    entry = hlo[hlo.index("\nENTRY"):]
    return sum(" all-reduce(" in line or " all-reduce-start(" in line for line in entry.splitlines())


def test_a_clipped_steps_gradients_and_norms_take_two_all_reduces(clipped):
    """The plan reduces every gradient (the weights' by reduce-scatter: XLA:CPU's all-reduce and
    slice) and then each gradient's sum of squares, taken on its shard. XLA's combiner, left to
    itself, merged each norm's scalar with the next gradient's reduction and chained five
    all-reduces; lowered by waves, the gradients share one and the scalars another."""
    plan, args = clipped
    sums = plan.cost.count()
    assert sums["all-reduce"] + sums["reduce-scatter"] >= 12  # the scenario: many reductions, in two waves
    hlo = plan.jit().lower(*args).compile().as_text()
    assert _entry_all_reduces(hlo) <= 2
    # each pending sum counted once, the flat buffer of the scalars included
    assert dict(count_collectives(hlo)) == dict(sums)
    check_collectives(plan, *args)
    check_plan(plan, *args)


def test_an_equation_after_two_reductions_waits_for_the_pending_sums_of_the_waves_before_it():
    """Waves 0, 1, 2, 0, 0; entries 0 and 3 make pending sums of wave 0. Entry 2 (two reductions
    deep) waits for entry 3; entry 1 (one deep) keeps its place: the first wave's reductions are
    left for XLA to combine, and moving their readers moved XLA:CPU's schedule."""
    assert _held_back([0, 1, 2, 0, 0], {0, 3}, [False] * 5) == [0, 1, 3, 2, 4]


def test_a_barrier_lets_out_what_is_held_before_it_runs():
    """An effect or a region run (entry 2) keeps its place among everything: the held entry 1
    runs before it, the producer 3 after it."""
    assert _held_back([0, 2, 0, 0], {0, 3}, [False, False, True, False]) == [0, 1, 2, 3]
