"""A battery of unusual but ordinary JAX programs, planned and checked against jax.jit.

Each program is one a user may well hand to shardsat: attention, scans, linear algebra, PRNG
keys, callbacks, custom derivatives, optax chains, integer and complex arithmetic, pytrees with
None; and a third set: fft, transposed and grouped convolutions, resizing, special functions,
RoPE attention, an LSTM, nested control flow, higher derivatives, 17 optax optimizers. Per
program and mesh: whether the plan matches jax.jit (`check_plan`), which primitives stay
replicated by fallback, and the planning time. The fuzz campaign (`python -m fuzz`) draws
random model programs; this battery covers primitives it does not draw.

Left out: `io_callback`, which aborts the process in jax.jit itself on 8 simulated CPU devices
(XLA:CPU's all-reduce rendezvous times out; jax 0.10.2).

    .venv/bin/python benchmarks/battery.py                     # every program, on 2x4 and 2x2x2
    .venv/bin/python benchmarks/battery.py --only cond_on_data # one program
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardsat
from shardsat.testing import check_plan

KEY = jax.random.PRNGKey(0)
PROGRAMS = {}


def r(*shape, dtype=jnp.float32, seed=0):
    return jax.random.normal(jax.random.fold_in(KEY, sum(shape) * 31 + len(shape) + 1000 * seed), shape).astype(dtype)


def prog(name):
    """Register a builder: mesh -> (function, example arguments)."""
    def register(build):
        PROGRAMS[name] = build
        return build
    return register


@prog("dot_product_attention")
def _(mesh):
    q = r(4, 16, 4, 8)
    return (lambda q, kk, v: jax.nn.dot_product_attention(q, kk, v, is_causal=True)), (q, q * 0.5, q + 1)


@prog("associative_scan")
def _(mesh):
    return (lambda x: lax.associative_scan(jnp.add, x, axis=1)), (r(8, 32),)


@prog("lax_map")
def _(mesh):
    return (lambda x: lax.map(lambda row: jnp.sin(row) @ row, x)), (r(8, 16),)


@prog("vmap_scan")
def _(mesh):
    def f(x):
        return jax.vmap(lambda s: lax.scan(lambda c, y: (c + y, c * y), 0.0, s))(x)
    return f, (r(8, 16),)


@prog("shard_map_user")
def _(mesh):
    auto = jax.make_mesh(mesh.axis_sizes, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    first = mesh.axis_names[0]

    def f(x):
        g = jax.shard_map(lambda a: lax.psum(a, first), mesh=auto, in_specs=P(first), out_specs=P())
        return g(x) * 2
    return f, (r(8, 16),)


@prog("depthwise_conv")
def _(mesh):
    def f(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=8,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return f, (r(8, 8, 8, 8), r(3, 3, 1, 8))


@prog("maxpool_grad")
def _(mesh):
    def f(x):
        return jax.grad(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID").sum())(x)
    return f, (r(8, 8, 8, 4),)


@prog("linalg_solve")
def _(mesh):
    return (lambda a, b: jnp.linalg.solve(a + 8 * jnp.eye(8), b)), (r(8, 8), r(8, 4))


@prog("batched_solve")
def _(mesh):
    return (lambda a, b: jnp.linalg.solve(a + 8 * jnp.eye(8), b)), (r(16, 8, 8), r(16, 8, 1))


@prog("cummax_argsort")
def _(mesh):
    return (lambda x: (lax.cummax(x, axis=1), jnp.argsort(x, axis=0))), (r(8, 16),)


@prog("pad_reflect")
def _(mesh):
    return (lambda x: jnp.pad(x, ((1, 1), (2, 2)), mode="reflect")), (r(8, 16),)


@prog("take_clip")
def _(mesh):
    return (lambda x, i: jnp.take(x, i, axis=0, mode="clip")), (r(16, 8), jnp.arange(24) % 20)


@prog("clip_global_norm_adam")
def _(mesh):
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    p = {"w": r(16, 32), "b": r(32)}
    s = opt.init(p)
    def step(p, s, x):
        g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step, (p, s, r(64, 16))


@prog("schedule_step_count")
def _(mesh):
    opt = optax.adamw(optax.cosine_decay_schedule(1e-3, 100))
    p = {"w": r(16, 32)}
    s = opt.init(p)
    def step(p, s, x):
        g = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step, (p, s, r(64, 16))


@prog("batchnorm_state")
def _(mesh):
    def f(x, mean, var):
        m, v = x.mean(0), x.var(0)
        y = (x - m) / jnp.sqrt(v + 1e-5)
        return y, 0.9 * mean + 0.1 * m, 0.9 * var + 0.1 * v
    return f, (r(64, 16), jnp.zeros(16), jnp.ones(16))


@prog("prng_in_step")
def _(mesh):
    def f(key, x):
        key, sub = jax.random.split(key)
        return key, x * jax.random.bernoulli(sub, 0.9, x.shape)
    return f, (jax.random.PRNGKey(1), r(8, 16))


@prog("new_style_key")
def _(mesh):
    def f(key, x):
        return x + jax.random.uniform(key, x.shape)
    return f, (jax.random.key(1), r(8, 16))


@prog("reduce_precision_int8")
def _(mesh):
    def f(x, w):
        q = jnp.clip(jnp.round(w * 127), -127, 127).astype(jnp.int8)
        return lax.reduce_precision(x, 5, 10) @ q.astype(jnp.float32)
    return f, (r(16, 32), r(32, 8))


@prog("logsumexp_onehot")
def _(mesh):
    def f(logits, y):
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.sum(logits * jax.nn.one_hot(y, 32), -1))
    return f, (r(64, 32), jnp.arange(64) % 32)


@prog("einsum_3op")
def _(mesh):
    return (lambda a, b, c: jnp.einsum("ij,jk,kl->il", a, b, c)), (r(16, 32), r(32, 8), r(8, 24))


@prog("while_dus")
def _(mesh):
    def f(x):
        def body(c):
            i, buf = c
            return i + 1, lax.dynamic_update_slice(buf, jnp.full((1, 16), i, jnp.float32), (i, 0))
        return lax.while_loop(lambda c: c[0] < 8, body, (0, x))[1]
    return f, (r(8, 16),)


@prog("remat_policy_mlp")
def _(mesh):
    def f(w, x):
        g = jax.checkpoint(lambda w, x: jnp.tanh(x @ w) @ w.T,
                           policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        return jax.grad(lambda w: jnp.sum(g(w, x) ** 2))(w)
    return f, (r(16, 16), r(32, 16))


@prog("bool_ops_and_nan")
def _(mesh):
    return (lambda x: (jnp.isnan(x) | (x > 0), jnp.nan_to_num(x / (x - x)))), (r(8, 16),)


@prog("scalar_outputs_and_pytrees")
def _(mesh):
    return (lambda d: {"a": d["x"].sum(), "b": (d["x"] * 2, None), "c": []}), ({"x": r(8, 16)},)


@prog("complex_matmul")
def _(mesh):
    return (lambda a, b: jnp.abs(a.astype(jnp.complex64) @ (b * 1j))), (r(16, 8), r(8, 16))


@prog("cond_on_data")
def _(mesh):
    return (lambda x: lax.cond(x.sum() > 0, lambda a: a @ a.T, lambda a: -a @ a.T, x)), (r(8, 16),)


@prog("fori_kv_cache")
def _(mesh):
    def f(cache, x):
        def body(i, c):
            return c.at[:, i].set(x[:, i] * 2)
        return lax.fori_loop(0, 4, body, cache)
    return f, (jnp.zeros((8, 16, 4)), r(8, 16, 4))


@prog("top_k_scatter_add")
def _(mesh):
    def f(x):
        v, i = lax.top_k(x, 2)
        return jnp.zeros_like(x).at[jnp.arange(8)[:, None], i].add(v)
    return f, (r(8, 16),)


@prog("bf16_mixed_grad")
def _(mesh):
    def f(w, x):
        return jax.grad(lambda w: jnp.sum((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32) ** 2))(w)
    return f, (r(32, 16), r(64, 32))


@prog("pure_callback")
def _(mesh):
    return (lambda x: jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1), (r(8, 16),)


@prog("debug_callback")
def _(mesh):
    def f(x):
        jax.debug.callback(lambda a: None, x.sum())
        return x * 2
    return f, (r(8, 16),)


@prog("eigh_qr_svd")
def _(mesh):
    def f(a):
        s = a @ a.T
        w, _v = jnp.linalg.eigh(s)
        q, rr = jnp.linalg.qr(a)
        return w, q, rr, jnp.linalg.svd(a, compute_uv=False)
    return f, (r(8, 8),)


@prog("cholesky_trisolve")
def _(mesh):
    def f(a, b):
        c = jnp.linalg.cholesky(a @ a.T + 8 * jnp.eye(8))
        return jax.scipy.linalg.solve_triangular(c, b, lower=True)
    return f, (r(8, 8), r(8, 16))


@prog("multi_sort")
def _(mesh):
    return (lambda x, y: lax.sort((x, y), dimension=1, num_keys=1)), (r(8, 16), r(8, 16))


@prog("argmax_argmin")
def _(mesh):
    return (lambda x: (jnp.argmax(x, 1), jnp.argmin(x, 0), jnp.max(x, 1))), (r(8, 16),)


@prog("unique_size")
def _(mesh):
    return (lambda x: jnp.unique(jnp.round(x), size=8, fill_value=0.0)), (r(64),)


@prog("named_call_scope")
def _(mesh):
    def f(x):
        with jax.named_scope("blk"):
            return jax.named_call(lambda a: a @ a.T, name="mm")(x)
    return f, (r(8, 16),)


@prog("custom_vjp_grad")
def _(mesh):
    @jax.custom_vjp
    def clip_grad(x):
        return x
    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))
    return (lambda w, x: jax.grad(lambda w: jnp.sum(clip_grad(x @ w) ** 2))(w)), (r(16, 8), r(32, 16))


@prog("jvp_hvp")
def _(mesh):
    def f(w):
        return jnp.sum(jnp.tanh(w) ** 2)
    return (lambda w, v: jax.jvp(jax.grad(f), (w,), (v,))[1]), (r(16, 8), r(16, 8))


@prog("vmap_grad_per_example")
def _(mesh):
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)
    return (lambda w, xs: jax.vmap(jax.grad(loss), (None, 0))(w, xs)), (r(16, 8), r(8, 16))


@prog("int_matmul_and_shift")
def _(mesh):
    return (lambda a, b: (a @ b) >> 2), (jnp.arange(128, dtype=jnp.int32).reshape(8, 16), jnp.ones((16, 8), jnp.int32))


@prog("gather_nd")
def _(mesh):
    return (lambda x, idx: x[idx[:, 0], idx[:, 1]]), (r(16, 16), (jnp.arange(32).reshape(16, 2) * 3) % 16)


@prog("segment_sum_gnn")
def _(mesh):
    def f(h, w, src, dst):
        m = jnp.tanh(h[src] @ w)
        return jax.ops.segment_sum(m, dst, num_segments=16)
    return f, (r(16, 8), r(8, 8), jnp.arange(64) % 16, (jnp.arange(64) * 7) % 16)


@prog("rng_bit_generator")
def _(mesh):
    return (lambda key, x: x + lax.rng_bit_generator(key, x.shape, dtype=jnp.uint32)[1].astype(jnp.float32)), (jnp.zeros(4, jnp.uint32), r(8, 16))


@prog("clamp_erf_expm1")
def _(mesh):
    return (lambda x: lax.clamp(-1.0, jax.scipy.special.erf(x) + jnp.expm1(x), 1.0)), (r(8, 16),)


@prog("split_concat")
def _(mesh):
    return (lambda x: jnp.concatenate(jnp.split(x, 4, axis=1)[::-1], axis=0)), (r(8, 16),)


@prog("rev_transpose_reshape")
def _(mesh):
    return (lambda x: jnp.flip(x.reshape(4, 2, 16).transpose(2, 0, 1), 0).reshape(16, 8)), (r(8, 16),)


@prog("zero_dim_and_scalar_args")
def _(mesh):
    return (lambda x, s, n: (x * s).sum() + n), (r(8, 16), jnp.float32(2.0), 3)


@prog("iota_cumsum_mask")
def _(mesh):
    return (lambda x: jnp.cumsum(jnp.where(jnp.arange(16) < 8, x, 0.0), axis=1)), (r(8, 16),)


# ---- a third set (2026-12-03): fft, transposed and grouped convolutions, resizing, special
# functions, more linear algebra, RoPE attention, an LSTM, nested control flow, higher derivatives

@prog("fft")
def _(mesh):
    return (lambda x: jnp.abs(jnp.fft.rfft(x, axis=-1)).sum(-1) + jnp.real(jnp.fft.ifft(jnp.fft.fft(x))).sum(-1)), (r(16, 32),)

@prog("fft2_conv")
def _(mesh):
    return (lambda x, k: jnp.fft.irfft2(jnp.fft.rfft2(x) * jnp.fft.rfft2(k, s=x.shape[-2:]), s=x.shape[-2:])), (r(8, 16, 16), r(3, 3, seed=1))

@prog("conv_transpose")
def _(mesh):
    return (lambda x, k: lax.conv_transpose(x, k, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))), (r(8, 8, 8, 4), r(3, 3, 4, 6, seed=1))

@prog("image_resize")
def _(mesh):
    return (lambda x: jax.image.resize(x, (8, 16, 16, 3), "bilinear")), (r(8, 8, 8, 3),)

@prog("avg_pool_stride")
def _(mesh):
    return (lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 2, 2, 1), "SAME") / 9), (r(8, 16, 16, 4),)

@prog("conv_dilated_grouped_grad")
def _(mesh):
    def f(x, k):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME", rhs_dilation=(2, 2), feature_group_count=2, dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jnp.tanh(y) ** 2)
    return jax.grad(f, argnums=(0, 1)), (r(8, 12, 12, 4), r(3, 3, 2, 8, seed=1))

@prog("conv1d_strided")
def _(mesh):
    return (lambda x, k: lax.conv_general_dilated(x, k, (2,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))), (r(8, 33, 4), r(5, 4, 8, seed=1))

@prog("searchsorted_interp")
def _(mesh):
    xp = jnp.linspace(0, 1, 32)
    return (lambda x, fp: (jnp.interp(x, xp, fp), jnp.searchsorted(xp, x))), (jax.random.uniform(KEY, (64,)), r(32, seed=1))

@prog("median_percentile")
def _(mesh):
    return (lambda x: (jnp.median(x, axis=1), jnp.percentile(x, 90, axis=0))), (r(16, 24),)

@prog("special_fns")
def _(mesh):
    return (lambda x: (jax.scipy.special.gammaln(jnp.abs(x) + 1), jax.scipy.special.digamma(jnp.abs(x) + 1), lax.lgamma(jnp.abs(x) + 1), jax.scipy.special.betainc(2.0, 3.0, jax.nn.sigmoid(x)), jax.scipy.special.i0e(x))), (r(16, 8),)

@prog("random_gamma_perm")
def _(mesh):
    return (lambda k, x: (jax.random.gamma(k, jnp.abs(x) + 0.5), jax.random.permutation(k, x, axis=0), jax.random.categorical(k, x, axis=-1))), (KEY, r(16, 8))

@prog("dropout_train")
def _(mesh):
    def f(w, x, k):
        def loss(w):
            h = jnp.tanh(x @ w)
            keep = jax.random.bernoulli(k, 0.9, h.shape)
            return jnp.sum(jnp.where(keep, h / 0.9, 0) ** 2)
        return jax.grad(loss)(w)
    return f, (r(16, 32), r(8, 16, seed=1), KEY)

@prog("inv_det_slogdet")
def _(mesh):
    return (lambda a: (jnp.linalg.inv(a + 4 * jnp.eye(4)), jnp.linalg.det(a + 4 * jnp.eye(4)), jnp.linalg.slogdet(a + 4 * jnp.eye(4))[1])), (r(16, 4, 4),)

@prog("eig_tridiagonal")
def _(mesh):
    def f(a, d, b):
        w, v = jnp.linalg.eig(a)  # CPU only
        dl, du = jnp.pad(d[:, 1:] * 0.1, ((0, 0), (1, 0))), jnp.pad(d[:, 1:] * 0.1, ((0, 0), (0, 1)))
        return jnp.abs(w), jnp.abs(v), jax.lax.linalg.tridiagonal_solve(dl, 4 + d, du, b)
    return f, (r(16, 5, 5), r(16, 8, seed=1), r(16, 8, 2, seed=2))

@prog("constraint_other_mesh")
def _(mesh):
    """with_sharding_constraint over a mesh of half the devices: jax.jit runs the function there;
    no plan on the whole mesh can keep it, so it is dropped with a ConstraintWarning."""
    from jax.sharding import Mesh, NamedSharding
    half = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("h",)), P(None, "h"))
    return (lambda w, x: lax.with_sharding_constraint(jnp.tanh(x @ w), half) @ w.T), (r(16, 32), r(64, 16, seed=1))

@prog("pinv_norm2")
def _(mesh):
    return (lambda a: (jnp.linalg.pinv(a), jnp.linalg.norm(a, ord=2, axis=(-2, -1)))), (r(8, 6, 4),)

@prog("expm")
def _(mesh):
    return (lambda a: jax.scipy.linalg.expm(0.1 * a)), (r(8, 4, 4),)

@prog("kron_outer_tril_roll")
def _(mesh):
    return (lambda a, b: (jnp.kron(a, b), jnp.outer(a[0], b[0]), jnp.tril(a @ a.T), jnp.roll(a, 3, axis=1), jnp.tile(b, (2, 1)), jnp.repeat(a, 2, axis=0, total_repeat_length=32))), (r(16, 8), r(4, 4, seed=1))

@prog("convolve_1d")
def _(mesh):
    return (lambda x, k: jax.vmap(lambda xi: jnp.convolve(xi, k, mode="same"))(x)), (r(16, 64), r(5, seed=1))

@prog("cumulative_ops")
def _(mesh):
    return (lambda x: (jnp.cumprod(1 + 0.01 * x, axis=1), lax.cumlogsumexp(x, axis=0), lax.cummin(x, axis=1), jnp.diff(x, axis=1))), (r(16, 8),)

@prog("bit_ops")
def _(mesh):
    return (lambda x: (lax.population_count(x), lax.clz(x), x ^ (x >> 3), jnp.bitwise_not(x))), (jnp.arange(128, dtype=jnp.int32).reshape(16, 8),)

@prog("atan2_rem_nextafter")
def _(mesh):
    return (lambda a, b: (jnp.arctan2(a, b), jnp.remainder(a, jnp.abs(b) + 1), jnp.nextafter(a, b), jnp.hypot(a, b), jnp.copysign(a, b))), (r(16, 8), r(16, 8, seed=1))

@prog("approx_max_k")
def _(mesh):
    return (lambda x: lax.approx_max_k(x, 4)), (r(16, 64),)

@prog("rope_attention_grad")
def _(mesh):
    def attn(q, k, v):
        s = q.shape[1]
        pos = jnp.arange(s)[:, None] / (10000 ** (jnp.arange(0, 8, 2) / 8))
        cos, sin = jnp.cos(pos), jnp.sin(pos)
        def rot(x):
            x1, x2 = x[..., ::2], x[..., 1::2]
            return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
        a = jnp.einsum("bqd,bkd->bqk", rot(q), rot(k)) / 8 ** 0.5
        a = jnp.where(jnp.tril(jnp.ones((s, s), bool)), a, -jnp.inf)
        return jnp.sum(jax.nn.softmax(a, -1) @ v)
    return jax.grad(attn, argnums=(0, 1, 2)), (r(8, 16, 8), r(8, 16, 8, seed=1), r(8, 16, 8, seed=2))

@prog("lstm_scan_grad")
def _(mesh):
    def f(w, xs):
        def cell(c, x):
            h, m = c
            z = jnp.concatenate([x, h], -1) @ w
            i, g, o, ff = jnp.split(z, 4, -1)
            m = jax.nn.sigmoid(ff) * m + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(m)
            return (h, m), h
        _, hs = lax.scan(cell, (jnp.zeros((8, 16)), jnp.zeros((8, 16))), xs)
        return jnp.sum(hs ** 2)
    return jax.value_and_grad(f), (r(24, 64) * 0.1, r(10, 8, 8, seed=1))

@prog("reverse_scan_unroll")
def _(mesh):
    return (lambda xs: lax.scan(lambda c, x: (c * 0.9 + x, c), jnp.zeros(8), xs, reverse=True, unroll=2)), (r(12, 8),)

@prog("nested_scan_cond")
def _(mesh):
    def f(xs):
        def outer(c, x):
            def inner(ci, xi):
                return lax.cond(xi.sum() > 0, lambda: ci + xi, lambda: ci - xi), ci.sum()
            c2, ys = lax.scan(inner, c, x)
            return c2, ys
        return lax.scan(outer, jnp.zeros(8), xs)
    return f, (r(4, 5, 8),)

@prog("while_dynamic_trip")
def _(mesh):
    return (lambda x, n: lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ x)), (0, x))[1]), (r(16, 16) * 0.3, jnp.int32(5))

@prog("ste_stop_gradient")
def _(mesh):
    def f(w, x):
        q = w + lax.stop_gradient(jnp.round(w * 4) / 4 - w)
        return jnp.sum((x @ q) ** 2)
    return jax.grad(f), (r(16, 16), r(8, 16, seed=1))

@prog("softmax_where_mask")
def _(mesh):
    return (lambda x, m: jax.nn.softmax(x, axis=-1, where=m)), (r(16, 8), r(16, 8, seed=1) > -0.5)

@prog("gather_batched_index")
def _(mesh):
    return (lambda x, idx: jnp.take_along_axis(x, idx, axis=1)), (r(16, 32), jax.random.randint(KEY, (16, 4), 0, 32))

@prog("scatter_max_min")
def _(mesh):
    return (lambda x, i, v: (x.at[i].max(v), x.at[i].min(v), x.at[i].mul(v))), (r(32, 8), jax.random.randint(KEY, (16,), 0, 32), r(16, 8, seed=1))

@prog("hessian_small")
def _(mesh):
    return jax.hessian(lambda w: jnp.sum(jnp.tanh(w @ w.T))), (r(4, 3),)

@prog("jacfwd_rev")
def _(mesh):
    return (lambda x: (jax.jacfwd(jnp.sin)(x), jax.jacrev(lambda y: jnp.cumsum(y))(x))), (r(8),)

@prog("float64_disabled_astype")
def _(mesh):
    return (lambda x: (x.astype(jnp.float16) * 2).astype(jnp.bfloat16)), (r(16, 8),)

@prog("cond_with_grad_pytree")
def _(mesh):
    def f(p, x, flag):
        def loss(p):
            return lax.cond(flag, lambda: jnp.sum((x @ p["w"]) ** 2), lambda: jnp.sum(p["b"] ** 2))
        return jax.grad(loss)(p)
    return f, ({"w": r(16, 8), "b": r(8, seed=1)}, r(32, 16, seed=2), jnp.bool_(True))

@prog("map_checkpointed_scan")
def _(mesh):
    def f(w, xs):
        body = jax.checkpoint(lambda c, x: (jnp.tanh(c @ w + x), None))
        c, _ = lax.scan(body, jnp.zeros((8, 16)), xs)
        return jnp.sum(c)
    return jax.grad(f), (r(16, 16) * 0.3, r(6, 8, 16, seed=1))


@prog("vmap_psum_pmean")
def _(mesh):
    norm = jax.vmap(lambda x: (x - lax.pmean(x, "b")) / lax.psum(jnp.abs(x).sum(), "b"), axis_name="b")
    return norm, (r(16, 8),)


@prog("vmap_all_gather_axis_index")
def _(mesh):
    return jax.vmap(lambda x: lax.all_gather(x, "b").sum(0) * x + lax.axis_index("b"), axis_name="b"), (r(8, 4),)


@prog("lax_reduce_user_combiner")
def _(mesh):
    def f(x, i):
        return lax.reduce((x, i), (-jnp.inf, 0), lambda a, b: (jnp.maximum(a[0], b[0]),
                                                                jnp.where(a[0] >= b[0], a[1], b[1])), (1,))
    return f, (r(16, 8), jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (16, 8)))


@prog("sort_key_val")
def _(mesh):
    return (lambda k, v: lax.sort_key_val(k, v, dimension=1)), (r(16, 8), r(16, 8, seed=1))


@prog("while_with_cond_inside")
def _(mesh):
    def f(x):
        def body(c):
            return c[0] + 1, lax.cond(c[0] % 2 == 0, lambda y: y * 2, lambda y: y - 1, c[1])
        return lax.while_loop(lambda c: c[0] < 4, body, (0, x))[1]
    return f, (r(16, 8),)


@prog("remat_dots_policy")
def _(mesh):
    policy = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
    return jax.grad(lambda w, x: jnp.sum(jax.checkpoint(lambda w: jnp.tanh(x @ w) @ w.T, policy=policy)(w))), \
        (r(16, 16), r(32, 16, seed=1))


# found by probing (2026-12-04): a while loop under vmap (a predicate per element), Poisson
# sampling per key (a while loop on keys), device_put of a tuple of other shapes (conjugate
# gradients), ordered debug callbacks (jax runs ordered debug effects on one device only)
@prog("vmap_while_per_element")
def _(mesh):
    return (lambda x: jax.vmap(lambda v: lax.while_loop(lambda c: c[0] < 3.0 * jnp.abs(c[1]).sum(),
                                                        lambda c: (c[0] + 1.0, c[1] * 0.9), (0.0, v)))(x)), (r(8, 4),)


@prog("vmap_poisson_per_key")
def _(mesh):
    return (lambda ks, x: jax.vmap(lambda k: jax.random.poisson(k, 3.0, (4,)))(ks) + x), \
        (jax.random.split(KEY, 8), r(8, 4))


@prog("vmap_conjugate_gradient")
def _(mesh):
    import jax.scipy.sparse.linalg as spl
    return (lambda a, b: jax.vmap(lambda rhs: spl.cg(lambda v: a @ v, rhs, tol=1e-6)[0])(b)), \
        (jnp.eye(16) * 2.0 + 0.01 * r(16, 16), r(8, 16))


@prog("ordered_debug_callback")
def _(mesh):
    def f(w, x):
        h = x @ w
        jax.debug.callback(lambda v: None, h.sum(), ordered=True)
        return jnp.tanh(h)
    return f, (r(16, 8), r(4, 16))


# optax optimizers beyond adam: factored moments (adafactor), trust ratios (lamb, lars), sign
# updates (lion), Newton-Schulz iterations (muon), gradient accumulation (MultiSteps)
OPTIMIZERS = {
    "adafactor": lambda: optax.adafactor(1e-3), "lion": lambda: optax.lion(1e-4), "lamb": lambda: optax.lamb(1e-3),
    "lars": lambda: optax.lars(1e-3), "novograd": lambda: optax.novograd(1e-3), "sm3": lambda: optax.sm3(1e-3),
    "adabelief": lambda: optax.adabelief(1e-3), "rmsprop": lambda: optax.rmsprop(1e-3, momentum=0.9),
    "yogi": lambda: optax.yogi(1e-3), "radam": lambda: optax.radam(1e-3), "fromage": lambda: optax.fromage(1e-3),
    "nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True), "adan": lambda: optax.adan(1e-3),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
    "prodigy": lambda: optax.contrib.prodigy(1.0), "muon": lambda: optax.contrib.muon(1e-3),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-3),
}


def _optimizer_step(make):
    def build(mesh):
        tx = make()
        params = {"w1": r(32, 64) * 0.1, "b1": jnp.zeros(64), "w2": r(64, 16) * 0.1, "conv": r(3, 3, 4, 8) * 0.1}

        def loss(p, x, y):
            return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2) + 1e-3 * jnp.sum(p["conv"] ** 2)

        def step(p, s, x, y):
            value, g = jax.value_and_grad(loss)(p, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, value

        return step, (params, tx.init(params), r(16, 32), r(16, 16))
    return build


for _name, _make in OPTIMIZERS.items():
    prog(f"optax_{_name}")(_optimizer_step(_make))


MESHES = {"2x4": ((2, 4), ("data", "model")), "2x2x2": ((2, 2, 2), ("a", "b", "c"))}


def run(name: str, mesh_name: str) -> str:
    mesh = jax.make_mesh(*MESHES[mesh_name])
    fn, args = PROGRAMS[name](mesh)
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = shardsat.saturate_and_extract(fn, mesh, *args)
        seconds = time.perf_counter() - t
        check_plan(plan, *args, rtol=2e-2 if "bf16" in name else 1e-4)
    except Exception as e:  # a benchmark row, not a test: every program gets its row
        return f"| {name} | {mesh_name} | FAIL | {type(e).__name__}: {str(e)[:120]} | |"
    fallbacks = sorted({f.split(" ")[0] for f in plan.report.fallbacks})
    return f"| {name} | {mesh_name} | ok | {', '.join(fallbacks) or '-'} | {seconds:.2f} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="program names (default: all)")
    ap.add_argument("--meshes", nargs="*", default=list(MESHES), choices=list(MESHES))
    ns = ap.parse_args(argv)
    names = ns.only or list(PROGRAMS)
    print("| program | mesh | outcome | replicated by fallback | plan s |")
    print("|---|---|---|---|---:|")
    failed = 0
    for mesh_name in ns.meshes:
        for name in names:
            row = run(name, mesh_name)
            failed += "| FAIL |" in row
            print(row, flush=True)
    print(f"\n{len(names) * len(ns.meshes) - failed} of {len(names) * len(ns.meshes)} ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
