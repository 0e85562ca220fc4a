"""Random bits drawn where they are used: with partitionable threefry (jax's default) each
element's bits depend on the key and the element's index only, so a plan draws each device's
block of a dropout mask instead of the whole mask on every device. Every plan here is checked
bit for bit against jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_equivalent
from hypothesis import given, settings
from hypothesis import strategies as st

import shardsat

MESHES = {"2x4": ((2, 4), ("data", "model")), "2x2x2": ((2, 2, 2), ("data", "fsdp", "model"))}


def mesh_of(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names)


def dropout_loss(w1, w2, x, key):
    h = jax.nn.relu(x @ w1)
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    h = jnp.where(keep, h / 0.9, 0.0)
    return jnp.mean((h @ w2) ** 2)


def dropout_args(d=512, f=2048, batch=512):
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (d, f)) / d**0.5, jax.random.normal(k[1], (f, d)) / f**0.5,
            jax.random.normal(k[2], (batch, d)), jax.random.key(7))


@pytest.mark.parametrize("mesh", ["2x4", "2x2x2"])
def test_a_dropout_mask_is_drawn_split(mesh):
    """The mask of a (512, 2048) activation is 4 MiB of bits (and, on CPU, four 32-bit words per
    element while threefry runs): drawn whole on every device, XLA's temporaries alone held
    more than the whole mask; drawn split, every device's temporaries are a fraction of it."""
    args = dropout_args()
    step = jax.value_and_grad(dropout_loss, argnums=(0, 1))
    plan = shardsat.saturate_and_extract(step, mesh_of(mesh), *args, profile="h100")
    ma = plan.jit().lower(*args).compile().memory_analysis()
    mask_bytes = 512 * 2048 * 4
    assert ma.temp_size_in_bytes < mask_bytes, ma.temp_size_in_bytes
    assert_equivalent(plan, step, *args, rtol=1e-4)


def draws(kind, key, shape):
    """Each of jax.random's bit consumers on `shape` (bit widths 8, 16 and 32, a batch of keys)."""
    if kind == "normal":
        return jax.random.normal(key, shape)
    if kind == "uniform":
        return jax.random.uniform(key, shape, minval=-2.0, maxval=3.0)
    if kind == "randint":
        return jax.random.randint(key, shape, 0, 1000)
    if kind == "bits8":
        return jax.random.bits(key, shape, jnp.uint8)
    if kind == "bits16":
        return jax.random.bits(key, shape, jnp.uint16)
    if kind == "batched":  # one key per row: random_bits on a (rows,) key array
        return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(jax.random.split(key, shape[0]))
    raise ValueError(kind)


@settings(max_examples=25)
@given(kind=st.sampled_from(["normal", "uniform", "randint", "bits8", "bits16", "batched"]),
       rows=st.sampled_from([8, 16, 24]), cols=st.sampled_from([8, 32, 12]),
       mesh=st.sampled_from(sorted(MESHES)), impl=st.sampled_from(["threefry2x32", "rbg"]))
def test_random_draws_match_jit_bit_for_bit(kind, rows, cols, mesh, impl):
    """Whatever layout the plan draws in, the values are jax.jit's: the draw is scaled into a
    product with a weight, so the search has a reason to split it. rbg keys draw replicated."""
    def f(w, key):
        r = draws(kind, key, (rows, cols)).astype(jnp.float32)
        return jnp.tanh(r @ w), r

    w = jnp.ones((cols, 64), jnp.float32) / cols
    key = jax.random.key(3, impl=impl)
    plan = shardsat.saturate_and_extract(f, mesh_of(mesh), w, key, profile="h100")
    got, want = plan.jit()(w, key), jax.jit(f)(w, key)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)


def test_dropout_per_layer_in_a_scan():
    """A scanned stack of layers, each with its own mask from fold_in(key, layer): the draw is
    inside the loop body, planned once."""
    def loss(ws, x, key):
        def layer(h, wi):
            w, i = wi
            h = jax.nn.relu(h @ w)
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, h.shape)
            return jnp.where(keep, h / 0.8, 0.0), None

        h, _ = jax.lax.scan(layer, x, (ws, jnp.arange(ws.shape[0])))
        return jnp.mean(h ** 2)

    k = jax.random.split(jax.random.key(1), 2)
    ws = jax.random.normal(k[0], (3, 256, 256)) / 16
    x = jax.random.normal(k[1], (128, 256))
    step = jax.grad(loss)
    plan = shardsat.saturate_and_extract(step, mesh_of("2x4"), ws, x, jax.random.key(5), profile="h100")
    assert_equivalent(plan, step, ws, x, jax.random.key(5), rtol=1e-4)


def test_check_plan_compares_a_returned_key_by_its_bits():
    """A training step hands back its next PRNG key (a typed key array): check_plan compares
    its bits, and a different key or a raw uint32 array in its place is a mismatch."""
    from shardsat.testing import PlanMismatchError, check_plan

    def step(key, x):
        k1, k2 = jax.random.split(key)
        return x + jax.random.normal(k1, x.shape), k2

    args = (jax.random.key(1), jnp.ones((64, 64)))
    plan = shardsat.saturate_and_extract(step, mesh_of("2x4"), *args)
    check_plan(plan, *args)
    with pytest.raises(PlanMismatchError, match=r"out\[1\]: 2 of 2 elements differ"):
        check_plan(plan, *args, reference=lambda key, x: (step(key, x)[0], jax.random.split(key)[0]))
    with pytest.raises(PlanMismatchError, match=r"out\[1\]: key<fry>\[\] vs uint32\[2\]"):
        check_plan(plan, *args, reference=lambda key, x: (step(key, x)[0], jax.random.key_data(step(key, x)[1])))
