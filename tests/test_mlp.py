"""Acceptance: the MLP tanh(x @ W1) @ W2 on a 2x4 mesh with the H100 profile."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_equivalent, assert_hlo_matches
from jax.sharding import PartitionSpec as P

import shardsat


def mlp(p, x):
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


def shapes(b, d, h):
    p = {"w1": jax.ShapeDtypeStruct((d, h), jnp.float32), "w2": jax.ShapeDtypeStruct((h, d), jnp.float32)}
    return p, jax.ShapeDtypeStruct((b, d), jnp.float32)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def spec(plan, arg, key=None):
    s = plan.in_shardings[arg]
    return (s[key] if key else s).spec


def axes_of(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def test_small_batch_big_weights_is_megatron(mesh):
    p, x = shapes(8, 8192, 32768)
    plan = shardsat.saturate_and_extract(mlp, mesh, p, x, profile="h100")
    w1, w2 = spec(plan, 0, "w1"), spec(plan, 0, "w2")
    # W1 split on its output features, W2 on its input features, over `model`
    assert len(w1) == 2 and "model" in axes_of(w1[1]), plan.explain()
    assert "model" in axes_of(w2[0]), plan.explain()
    reductions = [c for c in plan.cost.collectives if c.kind in ("all-reduce", "reduce-scatter")]
    assert len(reductions) == 1 and "model" in reductions[0].axes, plan.explain()
    assert len(plan.cost.collectives) == 1
    assert_hlo_matches(plan, p, x)


def test_big_batch_small_weights_is_data_parallel(mesh):
    p, x = shapes(32768, 64, 256)
    plan = shardsat.saturate_and_extract(mlp, mesh, p, x, profile="h100")
    assert spec(plan, 0, "w1") == jax.sharding.PartitionSpec()
    assert spec(plan, 0, "w2") == jax.sharding.PartitionSpec()
    xs = spec(plan, 1)
    assert set(axes_of(xs[0])) == {"data", "model"} and all(e is None for e in xs[1:])
    assert plan.cost.collectives == []
    assert_hlo_matches(plan, p, x)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8), (8, 1)])
def test_mlp_runs_and_matches(mesh_shape):
    mesh = jax.make_mesh(mesh_shape, ("data", "model"))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    p = {"w1": jax.random.normal(k1, (64, 256)), "w2": jax.random.normal(k2, (256, 64))}
    x = jax.random.normal(k3, (32, 64))
    for profile in ("h100", "cpu", "tpu_v5e"):
        plan = shardsat.saturate_and_extract(mlp, mesh, p, x, profile=profile)
        assert_equivalent(plan, mlp, p, x)
        assert_hlo_matches(plan, p, x)


def soft_moe(p, x):
    """A Soft-MoE layer: tokens mixed into expert slots and back by two softmaxes."""
    logits = jnp.einsum("btd,des->btes", x, p["phi"])
    dispatch = jax.nn.softmax(logits, axis=1)
    b, t, e, s = logits.shape
    combine = jax.nn.softmax(logits.reshape(b, t, e * s), axis=-1).reshape(b, t, e, s)
    slots = jnp.einsum("btes,btd->besd", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("besd,edf->besf", slots, p["w1"]))
    return x + jnp.einsum("btes,besd->btd", combine, jnp.einsum("besf,efd->besd", h, p["w2"]))


def test_forward_pass_starts_from_data_parallel_too(mesh):
    """A program without state gets a data-parallel start (batch: the argument an output keeps
    the leading dimension of; its experts' leading dimension matches the batch by chance): the
    free plan is never costlier than the one pinned to data parallelism."""
    b, t, d, e, s, f = 8, 512, 512, 8, 32, 1024
    sds = jax.ShapeDtypeStruct
    p = {"phi": sds((d, e, s), jnp.float32), "w1": sds((e, d, f), jnp.float32), "w2": sds((e, f, d), jnp.float32)}
    x = sds((b, t, d), jnp.float32)
    free = shardsat.saturate_and_extract(soft_moe, mesh, p, x, profile="h100")
    dp = shardsat.saturate_and_extract(soft_moe, mesh, p, x, profile="h100",
                                       in_shardings=({k: P() for k in p}, P(("data", "model"))))
    assert free.cost.total_s <= dp.cost.total_s * (1 + 1e-9), (free.explain(), dp.explain())
    keys = jax.random.split(jax.random.key(0), 4)
    real_p = {k: jax.random.normal(kk, v.shape) * 0.05 for (k, v), kk in zip(p.items(), keys, strict=False)}
    real_x = jax.random.normal(keys[3], x.shape)
    assert_equivalent(free, soft_moe, real_p, real_x, rtol=1e-4)
