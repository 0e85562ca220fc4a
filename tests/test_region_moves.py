"""Region moves (extract/moves_region.py): a resharded value's readers moved forward from its
layout together, where each alone would pay a collective of its own to move."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_equivalent
from jax.sharding import PartitionSpec as P

import shardsat
from shardsat.extract import policy

PROFILE = shardsat.DeviceProfile(flops_per_s=100e12, hbm_bytes_per_s=2e12, link_bytes_per_s=100e9, latency_s=5e-6)
B, N, PD, D, H, F, NC = 16, 4, 48, 64, 4, 128, 10


def _ln(x, g, b):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b


def _vit_loss(p, patches, labels):
    """One vision-transformer block and its classifier head on the class token."""
    x = patches @ p["patch_w"] + p["patch_b"]
    x = jnp.concatenate([jnp.broadcast_to(p["cls"], (B, 1, D)), x], 1) + p["pos"]
    h = _ln(x, p["ln1_g"], p["ln1_b"])
    q, k, v = (h @ p["wqkv"]).reshape(B, N + 1, 3, H, D // H).transpose(2, 0, 1, 3, 4)
    a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // H), -1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, N + 1, D) @ p["wo"]
    x = x + jax.nn.gelu(_ln(x, p["ln2_g"], p["ln2_b"]) @ p["w1"]) @ p["w2"]
    logits = _ln(x[:, 0], p["head_g"], p["head_b"]) @ p["head_w"]
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, NC)).mean()


def _vit_step():
    shapes = {"patch_w": (PD, D), "patch_b": (D,), "cls": (1, 1, D), "pos": (1, N + 1, D), "ln1_g": (D,),
              "ln1_b": (D,), "wqkv": (D, 3 * D), "wo": (D, D), "ln2_g": (D,), "ln2_b": (D,), "w1": (D, F),
              "w2": (F, D), "head_g": (D,), "head_b": (D,), "head_w": (D, NC)}
    keys = jax.random.split(jax.random.key(0), len(shapes) + 2)
    params = {name: 0.1 * jax.random.normal(kk, shape) for kk, (name, shape) in zip(keys[:-2], shapes.items(), strict=True)}
    tx = optax.adamw(1e-3)

    def step(p, s, patches, labels):
        loss, g = jax.value_and_grad(_vit_loss)(p, patches, labels)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    patches = jax.random.normal(keys[-2], (B, N, PD))
    labels = jax.random.randint(keys[-1], (B,), 0, NC)
    return step, (params, tx.init(params), patches, labels)


def test_a_classifier_head_stays_split_with_its_batch():
    """Data parallelism pinned (state replicated, the batch split over the mesh): the head's
    layer norm, product and loss stay split with the batch, their weight gradients all-reduced
    with the others. Before region moves the search gathered the class token and the labels and
    computed the head replicated (two all-gathers, 13.9 us against 9.5): moving any one value
    of the head back cost a gather of its own."""
    step, concrete = _vit_step()
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), concrete)
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    rep = jax.tree.map(lambda _: P(), (args[0], args[1]))
    pins = (*rep, P(("data", "model")), P(("data", "model")))
    plan = shardsat.saturate_and_extract(step, mesh, *args, profile=PROFILE, state_argnums=(0, 1), in_shardings=pins)
    assert plan.predicted_collectives()["all-gather"] == 0, plan.explain()
    assert_equivalent(plan, step, *concrete)


def _mlp_step():
    tx = optax.adam(1e-3)

    def loss(p, x, y):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    ks = jax.random.split(jax.random.key(1), 4)
    p = {"w1": jax.random.normal(ks[0], (64, 256)) * 0.1, "b1": jnp.zeros((256,)),
         "w2": jax.random.normal(ks[1], (256, 32)) * 0.1}
    return step, (p, tx.init(p), jax.random.normal(ks[2], (128, 64)), jax.random.normal(ks[3], (128, 32)))


@pytest.mark.parametrize(("build", "shape"), [(_vit_step, (2, 4)), (_mlp_step, (2, 4)), (_mlp_step, (2, 2, 2))])
def test_the_region_polish_only_lowers_the_plans_cost(monkeypatch, build, shape):
    """The polish runs on the plan the search returns, after every start and family: with it
    the plan costs at most what it costs without, and computes the same."""
    step, concrete = build()
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), concrete)
    mesh = jax.make_mesh(shape, ("data", "fsdp", "model")[-len(shape):])
    on = shardsat.saturate_and_extract(step, mesh, *args, profile=PROFILE, state_argnums=(0, 1))
    derive = policy.SearchPolicy.derive
    monkeypatch.setattr(policy.SearchPolicy, "derive",
                        classmethod(lambda cls, *a, **k: dataclasses.replace(derive(*a, **k), regions=False)))
    off = shardsat.saturate_and_extract(step, mesh, *args, profile=PROFILE, state_argnums=(0, 1))
    assert on.cost.total_s <= off.cost.total_s * (1 + 1e-9)
    assert_equivalent(on, step, *concrete)
