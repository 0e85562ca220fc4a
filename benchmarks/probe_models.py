"""More of benchmarks/memory_probe.py's programs: normalisations, optimizers and model shapes
the first probe lacks (found by writing them as users do, 2026-12-06): a U-Net-like step with
group norms, a ResNet with batch norms, a transformer with flax-style layer norms (mean and
mean of squares), Adafactor, Lion, AdamW behind global-norm clipping, an EMA teacher, a CLIP
contrastive loss, a top-k routed mixture of experts, and grouped-query attention with rotary
embeddings. memory_probe.py plans and measures them with its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

S = jax.ShapeDtypeStruct
F32 = jnp.float32

def _with_opt(loss: Callable[..., Any], ps: Any, opt: optax.GradientTransformation,
              *xs: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    def step(p: Any, st: Any, *xs: Any) -> Any:
        u, st = opt.update(jax.grad(loss)(p, *xs), st, p)
        return optax.apply_updates(p, u), st
    return step, (ps, jax.eval_shape(opt.init, ps), *xs)


def _conv(x: Any, w: Any, stride: int = 1) -> Any:
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def groupnorm_unet_train():
    def gn(x, groups=8):
        b, h, w, c = x.shape
        y = x.reshape(b, h, w, groups, c // groups)
        m, v = y.mean((1, 2, 4), keepdims=True), y.var((1, 2, 4), keepdims=True)
        return ((y - m) * lax.rsqrt(v + 1e-5)).reshape(b, h, w, c)

    def loss(p, x):
        h = jax.nn.silu(gn(_conv(x, p["c1"])))
        h = jax.nn.silu(gn(_conv(h, p["c2"], 2)))
        h = jnp.repeat(jnp.repeat(h, 2, 1), 2, 2)
        return jnp.mean((_conv(h, p["c3"]) - x) ** 2)
    ps = {"c1": S((3, 3, 32, 128), F32), "c2": S((3, 3, 128, 128), F32), "c3": S((3, 3, 128, 32), F32)}
    return _with_opt(loss, ps, optax.sgd(1e-2, momentum=0.9), S((32, 64, 64, 32), F32))


def batchnorm_resnet_train():
    def bn(x, g, b):
        return (x - x.mean((0, 1, 2))) * lax.rsqrt(x.var((0, 1, 2)) + 1e-5) * g + b

    def loss(p, x, y):
        h = jax.nn.relu(bn(_conv(x, p["c0"]), p["g0"], p["b0"]))
        for i in (1, 2):
            h = h + jax.nn.relu(bn(_conv(h, p[f"c{i}"]), p[f"g{i}"], p[f"b{i}"]))
        return optax.softmax_cross_entropy_with_integer_labels(h.mean((1, 2)) @ p["fc"], y).mean()
    c = 64
    ps = {"c0": S((3, 3, 16, c), F32), "c1": S((3, 3, c, c), F32), "c2": S((3, 3, c, c), F32), "fc": S((c, 10), F32)}
    ps |= {f"{n}{i}": S((c,), F32) for i in range(3) for n in ("g", "b")}
    return _with_opt(loss, ps, optax.sgd(0.1, momentum=0.9), S((64, 32, 32, 16), F32), S((64,), jnp.int32))


def flax_layernorm_transformer():
    def ln(x, g, b):
        m, m2 = x.mean(-1, keepdims=True), (x * x).mean(-1, keepdims=True)
        return (x - m) * lax.rsqrt(jnp.maximum(m2 - m * m, 0.0) + 1e-6) * g + b

    def loss(p, x):
        for i in range(2):
            q, k, v = (ln(x, p["g"][i], p["b"][i]) @ p["wqkv"][i]).reshape(*x.shape[:2], 3, 8, 64).transpose(2, 0, 3, 1, 4)
            a = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / 8.0, -1) @ v
            x = x + a.transpose(0, 2, 1, 3).reshape(x.shape) @ p["wo"][i]
            x = x + jax.nn.gelu(ln(x, p["g"][i], p["b"][i]) @ p["w1"][i]) @ p["w2"][i]
        return jnp.mean(x ** 2)
    d = 512
    ps = {"g": S((2, d), F32), "b": S((2, d), F32), "wqkv": S((2, d, 3 * d), F32), "wo": S((2, d, d), F32),
          "w1": S((2, d, 2048), F32), "w2": S((2, 2048, d), F32)}
    return _with_opt(loss, ps, optax.adamw(1e-3), S((16, 128, d), F32))


def _mlp_loss(p: Any, x: Any) -> Any:
    return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"]) ** 2)


_MLP = {"w1": S((1024, 4096), F32), "w2": S((4096, 1024), F32)}


def adafactor_mlp():
    return _with_opt(_mlp_loss, _MLP, optax.adafactor(1e-3), S((512, 1024), F32))


def lion_classifier():
    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(jax.nn.relu(x @ p["w1"]) @ p["w2"], y).mean()
    ps = {"w1": S((1024, 4096), F32), "w2": S((4096, 1000), F32)}
    return _with_opt(loss, ps, optax.lion(1e-4), S((1024, 1024), F32), S((1024,), jnp.int32))


def clipped_adamw_residual():
    def ln(x, g):
        m = x.mean(-1, keepdims=True)
        return (x - m) * lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g

    def loss(p, x):
        for i in range(3):
            x = x + jax.nn.relu(ln(x, p["g"][i]) @ p["w1"][i]) @ p["w2"][i]
        return jnp.mean(x ** 2)
    ps = {"g": S((3, 512), F32), "w1": S((3, 512, 2048), F32), "w2": S((3, 2048, 512), F32)}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return _with_opt(loss, ps, opt, S((64, 128, 512), F32))


def ema_teacher():
    def loss(p, t, x):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - lax.stop_gradient(jnp.tanh(x @ t["w1"]) @ t["w2"])) ** 2)

    def step(p, t, x):
        p = jax.tree.map(lambda a, b: a - 0.01 * b, p, jax.grad(loss)(p, t, x))
        return p, jax.tree.map(lambda a, b: 0.99 * a + 0.01 * b, t, p)
    return step, (_MLP, _MLP, S((512, 1024), F32))


def clip_contrastive():
    def loss(p, a, b):
        za, zb = a @ p["wa"], b @ p["wb"]
        za = za / jnp.linalg.norm(za, axis=-1, keepdims=True)
        zb = zb / jnp.linalg.norm(zb, axis=-1, keepdims=True)
        logits, labels = za @ zb.T * 10.0, jnp.arange(a.shape[0])
        xent = optax.softmax_cross_entropy_with_integer_labels
        return (xent(logits, labels).mean() + xent(logits.T, labels).mean()) / 2
    ps = {"wa": S((768, 512), F32), "wb": S((1024, 512), F32)}
    return _with_opt(loss, ps, optax.adam(1e-3), S((2048, 768), F32), S((2048, 1024), F32))


def topk_moe_train():
    experts, k = 8, 2

    def loss(p, x):
        v, i = lax.top_k(jax.nn.softmax(x @ p["wg"], -1), k)
        gates = jnp.sum(jax.nn.one_hot(i, experts) * v[..., None], -2)
        h = jax.nn.relu(jnp.einsum("td,edf->tef", x, p["w1"]))
        out = jnp.einsum("ted,te->td", jnp.einsum("tef,efd->ted", h, p["w2"]), gates)
        return jnp.mean((out - x) ** 2)
    ps = {"wg": S((512, experts), F32), "w1": S((experts, 512, 1024), F32), "w2": S((experts, 1024, 512), F32)}
    return _with_opt(loss, ps, optax.adam(1e-3), S((1024, 512), F32))


def gqa_rope_block():
    heads, kv, dh, t = 8, 2, 64, 256

    def rope(x):
        a = jnp.arange(t)[:, None] * (1.0 / (10000 ** (jnp.arange(0, dh, 2) / dh)))
        c, s = jnp.cos(a)[None, :, None, :], jnp.sin(a)[None, :, None, :]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)

    def rms(x, g):
        return x * lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g

    def loss(p, x):
        b, h = x.shape[0], rms(x, p["g"])
        q = rope((h @ p["wq"]).reshape(b, t, heads, dh))
        k = jnp.repeat(rope((h @ p["wk"]).reshape(b, t, kv, dh)), heads // kv, 2)
        v = jnp.repeat((h @ p["wv"]).reshape(b, t, kv, dh), heads // kv, 2)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0, -1e9)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, heads * dh) @ p["wo"]
        x = x + (jax.nn.silu(rms(x, p["g"]) @ p["w1"]) * (x @ p["w3"])) @ p["w2"]
        return jnp.mean(x ** 2)
    d = heads * dh
    ps = {"g": S((d,), F32), "wq": S((d, d), F32), "wk": S((d, kv * dh), F32), "wv": S((d, kv * dh), F32),
          "wo": S((d, d), F32), "w1": S((d, 1408), F32), "w3": S((d, 1408), F32), "w2": S((1408, d), F32)}
    return _with_opt(loss, ps, optax.adamw(1e-3), S((16, t, d), F32))


PROGRAMS: dict[str, Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]] = {f.__name__: f for f in (
    groupnorm_unet_train, batchnorm_resnet_train, flax_layernorm_transformer,
    adafactor_mlp, lion_classifier, clipped_adamw_residual, ema_teacher,
    clip_contrastive, topk_moe_train, gqa_rope_block)}
