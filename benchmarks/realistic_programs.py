"""Ten training steps as people write them, for benchmarks/realistic.py.

Language models and vision: llama (RMSNorm, RoPE, grouped-query attention, SwiGLU, gradient
clipping + AdamW), vit (patches, layer norm, AdamW), moe (a top-2 router with per-sequence
capacity and a load-balancing loss), clip (a contrastive loss over the whole batch),
mixed_precision (bfloat16 compute on float32 master weights, a scaled loss). Other shapes of
training code: resnet_bn (BatchNorm, its running statistics carried as state), grad_accum
(lax.scan over microbatches), recsys (a 200k x 64 embedding table, Adagrad), unet (GroupNorm,
strided convolutions, nearest resize, skip connections), ssm (a linear recurrence by
lax.associative_scan).

Each entry of PROGRAMS builds (fn, concrete example arguments, state_argnums, {argnum: batch dim}
of every data argument): the weights and optimizer state are what a step donates, the data
arguments what data parallelism splits. Sizes are small so that each compiles in seconds on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
Program = tuple[Callable[..., Any], tuple[Any, ...], tuple[int, ...], dict[int, int]]
PROGRAMS: dict[str, Callable[[], Program]] = {}


def program(build: Callable[[], Program]) -> Callable[[], Program]:
    """Register a program builder under its function name (the name --only selects)."""
    PROGRAMS[build.__name__] = build
    return build


def _key(i: int) -> jax.Array:
    return jax.random.key(i)


def _normal(key: jax.Array, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return jax.random.normal(key, shape, F32) * scale


def _init(key: jax.Array, shapes: dict[str, tuple[int, ...]], scale: float = 0.02) -> dict[str, jax.Array]:
    """Norm gains one, biases zero, the rest small normals: a model's usual starting point."""
    out = {}
    for i, (k, shape) in enumerate(sorted(shapes.items())):
        if k.endswith(("norm", "_g")):
            out[k] = jnp.ones(shape, F32)
        elif k.endswith("_b"):
            out[k] = jnp.zeros(shape, F32)
        else:
            out[k] = scale * jax.random.normal(jax.random.fold_in(key, i), shape, F32)
    return out


def _step(loss_fn: Callable[..., Any], opt: optax.GradientTransformation) -> Callable[..., Any]:
    """The usual step: value_and_grad of the loss, the optimizer's update, the new parameters."""
    def step(params: Any, opt_state: Any, *batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def _rms(x: jax.Array, g: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g


def _ln(x: jax.Array, g: jax.Array, b: jax.Array, eps: float = 1e-5) -> jax.Array:
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * lax.rsqrt(v + eps) * g + b


def _conv(x: jax.Array, w: jax.Array, stride: int = 1) -> jax.Array:
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _tokens(i: int, shape: tuple[int, ...], vocab: int) -> jax.Array:
    return jax.random.randint(_key(i), shape, 0, vocab, I32)


# ------------------------------------------------------------------------ language and vision
def _rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding of (B, T, heads, head dim)."""
    t, hd = x.shape[1], x.shape[-1]
    half = hd // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=F32) / half))
    ang = jnp.arange(t, dtype=F32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


@program
def llama() -> Program:
    """A two-layer Llama-style decoder: the shape of most language-model training today."""
    B, T, D, H, KV, HD, F, V, L = 16, 128, 256, 8, 2, 32, 688, 4096, 2
    shapes = {"embed": (V, D), "lm_head": (D, V), "final_norm": (D,)}
    for i in range(L):
        shapes |= {f"l{i}_attn_norm": (D,), f"l{i}_wq": (D, H * HD), f"l{i}_wk": (D, KV * HD),
                   f"l{i}_wv": (D, KV * HD), f"l{i}_wo": (H * HD, D), f"l{i}_mlp_norm": (D,),
                   f"l{i}_w_gate": (D, F), f"l{i}_w_up": (D, F), f"l{i}_w_down": (F, D)}

    def loss_fn(p: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        x = p["embed"][tokens]
        mask = jnp.tril(jnp.ones((T, T), bool))
        for i in range(L):
            h = _rms(x, p[f"l{i}_attn_norm"])
            q = _rope((h @ p[f"l{i}_wq"]).reshape(B, T, H, HD))
            k = _rope((h @ p[f"l{i}_wk"]).reshape(B, T, KV, HD))
            v = (h @ p[f"l{i}_wv"]).reshape(B, T, KV, HD)
            k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
            s = jnp.where(mask[None, None], jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD), -1e9)
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(B, T, H * HD)
            x = x + o @ p[f"l{i}_wo"]
            h = _rms(x, p[f"l{i}_mlp_norm"])
            x = x + (jax.nn.silu(h @ p[f"l{i}_w_gate"]) * (h @ p[f"l{i}_w_up"])) @ p[f"l{i}_w_down"]
        logits = _rms(x, p["final_norm"]) @ p["lm_head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))
    params = _init(_key(0), shapes)
    args = (params, opt.init(params), _tokens(1, (B, T), V), _tokens(2, (B, T), V))
    return _step(loss_fn, opt), args, (0, 1), {2: 0, 3: 0}


@program
def vit() -> Program:
    """A two-layer vision transformer: patch reshapes, a class token, layer norm."""
    B, IMG, P, C, D, H, F, L, NC = 32, 32, 4, 3, 256, 8, 1024, 2, 10
    N, PD, HD = (IMG // P) ** 2, P * P * C, D // H
    shapes = {"patch_w": (PD, D), "patch_b": (D,), "cls": (1, 1, D), "pos": (1, N + 1, D),
              "head_norm_g": (D,), "head_norm_b": (D,), "head_w": (D, NC), "head_b": (NC,)}
    for i in range(L):
        shapes |= {f"l{i}_ln1_g": (D,), f"l{i}_ln1_b": (D,), f"l{i}_wqkv": (D, 3 * D), f"l{i}_bqkv_b": (3 * D,),
                   f"l{i}_wo": (D, D), f"l{i}_bo_b": (D,), f"l{i}_ln2_g": (D,), f"l{i}_ln2_b": (D,),
                   f"l{i}_w1": (D, F), f"l{i}_b1_b": (F,), f"l{i}_w2": (F, D), f"l{i}_b2_b": (D,)}

    def loss_fn(p: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        x = images.reshape(B, IMG // P, P, IMG // P, P, C).transpose(0, 1, 3, 2, 4, 5).reshape(B, N, PD)
        x = x @ p["patch_w"] + p["patch_b"]
        x = jnp.concatenate([jnp.broadcast_to(p["cls"], (B, 1, D)), x], 1) + p["pos"]
        for i in range(L):
            h = _ln(x, p[f"l{i}_ln1_g"], p[f"l{i}_ln1_b"])
            qkv = (h @ p[f"l{i}_wqkv"] + p[f"l{i}_bqkv_b"]).reshape(B, N + 1, 3, H, HD)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD), -1)
            o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, N + 1, D)
            x = x + o @ p[f"l{i}_wo"] + p[f"l{i}_bo_b"]
            h = _ln(x, p[f"l{i}_ln2_g"], p[f"l{i}_ln2_b"])
            x = x + jax.nn.gelu(h @ p[f"l{i}_w1"] + p[f"l{i}_b1_b"]) @ p[f"l{i}_w2"] + p[f"l{i}_b2_b"]
        logits = _ln(x[:, 0], p["head_norm_g"], p["head_norm_b"]) @ p["head_w"] + p["head_b"]
        return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, NC)).mean()

    opt = optax.adamw(1e-3, weight_decay=0.05)
    params = _init(_key(0), shapes)
    images = jax.random.normal(_key(1), (B, IMG, IMG, C), F32)
    return _step(loss_fn, opt), (params, opt.init(params), images, _tokens(2, (B,), NC)), (0, 1), {2: 0, 3: 0}


def _route(probs: jax.Array, k: int, cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing with a per-sequence capacity: (dispatch, combine) masks (B, T, E, cap), top-k ids."""
    b, _, e = probs.shape
    gates, idx = lax.top_k(probs, k)
    gates = gates / jnp.sum(gates, -1, keepdims=True)
    dispatch = combine = jnp.zeros((*probs.shape, cap), F32)
    filled = jnp.zeros((b, 1, e), F32)
    for j in range(k):
        m = jax.nn.one_hot(idx[..., j], e, dtype=F32)
        pos = jnp.cumsum(m, 1) - 1 + filled  # the token's place in its expert's buffer
        m = m * (pos < cap)
        filled = filled + jnp.sum(m, 1, keepdims=True)
        slot = jax.nn.one_hot(jnp.sum(pos * m, -1).astype(I32), cap, dtype=F32)
        d = m[..., None] * slot[:, :, None, :]
        dispatch, combine = dispatch + d, combine + gates[..., j, None, None] * d
    return dispatch, combine, idx


@program
def moe() -> Program:
    """A mixture-of-experts layer with a top-2 router: one-hot dispatch and combine einsums."""
    B, T, D, E, F, V, K = 16, 128, 256, 8, 512, 1024, 2
    CAP = int(1.25 * K * T / E)
    shapes = {"embed": (V, D), "ln_g": (D,), "ln_b": (D,), "router": (D, E), "w_in": (E, D, F),
              "w_out": (E, F, D), "out_norm_g": (D,), "out_norm_b": (D,), "unembed": (D, V)}

    def loss_fn(p: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        x = p["embed"][tokens]
        h = _ln(x, p["ln_g"], p["ln_b"])
        probs = jax.nn.softmax(h @ p["router"], -1)
        dispatch, combine, idx = _route(probs, K, CAP)
        xin = jnp.einsum("btec,btd->becd", dispatch, h)
        y = jnp.einsum("becf,efd->becd", jax.nn.gelu(jnp.einsum("becd,edf->becf", xin, p["w_in"])), p["w_out"])
        x = x + jnp.einsum("btec,becd->btd", combine, y)
        logits = _ln(x, p["out_norm_g"], p["out_norm_b"]) @ p["unembed"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        first = jax.nn.one_hot(idx[..., 0], E, dtype=F32)
        aux = E * jnp.sum(jnp.mean(probs, (0, 1)) * jnp.mean(first, (0, 1)))  # load balancing
        return ce + 0.01 * aux

    opt = optax.adam(1e-3)
    params = _init(_key(0), shapes)
    args = (params, opt.init(params), _tokens(1, (B, T), V), _tokens(2, (B, T), V))
    return _step(loss_fn, opt), args, (0, 1), {2: 0, 3: 0}


@program
def clip() -> Program:
    """Two towers and a contrastive loss: the logits pair every example with every other."""
    B, DI, TL, V, DT, HID, E = 32, 1024, 32, 8192, 256, 1024, 512
    shapes = {"img_w1": (DI, HID), "img_b1_b": (HID,), "img_w2": (HID, E), "tok_embed": (V, DT),
              "txt_w1": (DT, HID), "txt_b1_b": (HID,), "txt_w2": (HID, E)}

    def loss_fn(p: Any, image_feats: jax.Array, text_tokens: jax.Array) -> jax.Array:
        zi = jax.nn.gelu(image_feats @ p["img_w1"] + p["img_b1_b"]) @ p["img_w2"]
        t = jnp.mean(p["tok_embed"][text_tokens], 1)
        zt = jax.nn.gelu(t @ p["txt_w1"] + p["txt_b1_b"]) @ p["txt_w2"]
        zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
        zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
        logits = zi @ zt.T * jnp.exp(p["logit_scale"])
        labels = jnp.arange(B)
        li = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        lt = optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()
        return (li + lt) / 2

    opt = optax.adam(1e-3)
    params = _init(_key(0), shapes) | {"logit_scale": jnp.asarray(np.log(1 / 0.07), F32)}
    feats = jax.random.normal(_key(1), (B, DI), F32)
    return _step(loss_fn, opt), (params, opt.init(params), feats, _tokens(2, (B, TL), V)), (0, 1), {2: 0, 3: 0}


@program
def mixed_precision() -> Program:
    """bfloat16 compute on float32 master weights, the loss scaled and the gradients unscaled."""
    B, T, W, L, SCALE = 32, 128, 1024, 4, 1024.0
    shapes = {f"w{i}": (W, W) for i in range(L)} | {f"b{i}_b": (W,) for i in range(L)}

    def loss_fn(p32: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        p = jax.tree.map(lambda a: a.astype(BF16), p32)
        h = x.astype(BF16)
        for i in range(L):
            h = h @ p[f"w{i}"] + p[f"b{i}_b"]
            if i < L - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h.astype(F32) - y) ** 2)

    opt = optax.adam(1e-3)

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        scaled, grads = jax.value_and_grad(lambda p: loss_fn(p, x, y) * SCALE)(params)
        grads = jax.tree.map(lambda g: g.astype(F32) / SCALE, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scaled / SCALE

    params = _init(_key(0), shapes, scale=0.03)
    x = jax.random.normal(_key(1), (B, T, W), F32)
    y = jax.random.normal(_key(2), (B, T, W), F32)
    return step, (params, opt.init(params), x, y), (0, 1), {2: 0, 3: 0}


# ---------------------------------------------------------------- other shapes of training code
def _bn_train(x: jax.Array, p: Any, s: Any, momentum: float = 0.9, eps: float = 1e-5) -> tuple[jax.Array, Any]:
    """BatchNorm in training mode: batch statistics normalise, running statistics update."""
    mean, var = jnp.mean(x, axis=(0, 1, 2)), jnp.var(x, axis=(0, 1, 2))
    y = (x - mean) * lax.rsqrt(var + eps) * p["g"] + p["b"]
    return y, {"mean": momentum * s["mean"] + (1 - momentum) * mean,
               "var": momentum * s["var"] + (1 - momentum) * var}


def _resnet_params() -> tuple[dict[str, Any], dict[str, Any]]:
    """(weights, BatchNorm running statistics) of a stem and three residual blocks."""
    key = iter(jax.random.split(_key(0), 64))
    params: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    convs = [("stem", 3, 3, 32)]
    for i, (cin, cout) in enumerate([(32, 32), (32, 64), (64, 128)]):
        convs += [(f"b{i}c1", 3, cin, cout), (f"b{i}c2", 3, cout, cout)]
        convs += [(f"b{i}proj", 1, cin, cout)] if cin != cout else []
    for name, kh, cin, cout in convs:
        params[name] = {"w": _normal(next(key), (kh, kh, cin, cout), (2.0 / (kh * kh * cin)) ** 0.5),
                        "g": jnp.ones((cout,), F32), "b": jnp.zeros((cout,), F32)}
        stats[name] = {"mean": jnp.zeros((cout,), F32), "var": jnp.ones((cout,), F32)}
    params["head"] = {"w": _normal(next(key), (128, 10), 128 ** -0.5), "b": jnp.zeros((10,), F32)}
    return params, stats


@program
def resnet_bn() -> Program:
    """A small ResNet with BatchNorm: the running statistics are state the step returns."""
    params, stats = _resnet_params()
    strides = (1, 2, 2)

    def forward(p: Any, s: Any, x: jax.Array) -> tuple[jax.Array, Any]:
        new: dict[str, Any] = {}

        def cbn(name: str, h: jax.Array, stride: int = 1) -> jax.Array:
            h, new[name] = _bn_train(_conv(h, p[name]["w"], stride), p[name], s[name])
            return h

        h = jax.nn.relu(cbn("stem", x))
        for i, st in enumerate(strides):
            r = cbn(f"b{i}proj", h, st) if f"b{i}proj" in p else h
            h = jax.nn.relu(cbn(f"b{i}c2", jax.nn.relu(cbn(f"b{i}c1", h, st))) + r)
        return jnp.mean(h, axis=(1, 2)) @ p["head"]["w"] + p["head"]["b"], new

    def loss(p: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, Any]:
        logits, new = forward(p, s, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

    opt = optax.sgd(0.1, momentum=0.9)

    def step(p: Any, s: Any, o: Any, x: jax.Array, y: jax.Array) -> Any:
        (value, new_s), g = jax.value_and_grad(loss, has_aux=True)(p, s, x, y)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), new_s, o, value

    x = _normal(_key(1), (32, 32, 32, 3))
    y = jax.random.randint(_key(2), (32,), 0, 10)
    return step, (params, stats, opt.init(params), x, y), (0, 1, 2), {3: 0, 4: 0}


@program
def grad_accum() -> Program:
    """Gradient accumulation: lax.scan over microbatches, the batch on the data's second dimension."""
    d, classes, micro, mb = 1024, 16, 4, 64
    ks = jax.random.split(_key(3), 3)
    params = {"w1": _normal(ks[0], (d, d), d ** -0.5), "b1": jnp.zeros((d,), F32),
              "w2": _normal(ks[1], (d, d), d ** -0.5), "b2": jnp.zeros((d,), F32),
              "w3": _normal(ks[2], (d, classes), d ** -0.5), "b3": jnp.zeros((classes,), F32)}
    opt = optax.adamw(1e-3, weight_decay=0.01)

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        h = jax.nn.gelu(h @ p["w2"] + p["b2"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w3"] + p["b3"], y).mean()

    def step(p: Any, o: Any, x: jax.Array, y: jax.Array) -> Any:
        def body(acc: Any, xy: Any) -> tuple[Any, None]:
            value, g = jax.value_and_grad(loss)(p, *xy)
            return (jax.tree.map(jnp.add, acc[0], g), acc[1] + value), None

        zero = (jax.tree.map(jnp.zeros_like, p), jnp.zeros((), F32))
        (g, total), _ = lax.scan(body, zero, (x, y))
        u, o = opt.update(jax.tree.map(lambda a: a / micro, g), o, p)
        return optax.apply_updates(p, u), o, total / micro

    x = _normal(_key(4), (micro, mb, d))
    y = jax.random.randint(_key(5), (micro, mb), 0, classes)
    return step, (params, opt.init(params), x, y), (0, 1), {2: 1, 3: 1}


@program
def recsys() -> Program:
    """A recommendation model: a large embedding table gathered by id, a small MLP, Adagrad."""
    rows, emb, b, nids, ndense = 200_000, 64, 256, 16, 13
    ks = jax.random.split(_key(6), 4)
    params = {"table": _normal(ks[0], (rows, emb), 0.01),
              "w1": _normal(ks[1], (emb + ndense, 256), (emb + ndense) ** -0.5), "b1": jnp.zeros((256,), F32),
              "w2": _normal(ks[2], (256, 128), 256 ** -0.5), "b2": jnp.zeros((128,), F32),
              "w3": _normal(ks[3], (128, 1), 128 ** -0.5), "b3": jnp.zeros((1,), F32)}
    opt = optax.adagrad(0.01)

    def loss(p: Any, ids: jax.Array, dense: jax.Array, label: jax.Array) -> jax.Array:
        e = jnp.take(p["table"], ids, axis=0).mean(axis=1)
        h = jax.nn.relu(jnp.concatenate([e, dense], axis=-1) @ p["w1"] + p["b1"])
        h = jax.nn.relu(h @ p["w2"] + p["b2"])
        return optax.sigmoid_binary_cross_entropy((h @ p["w3"] + p["b3"])[:, 0], label).mean()

    ids = jax.random.randint(_key(7), (b, nids), 0, rows, dtype=I32)
    dense = _normal(_key(8), (b, ndense))
    label = jax.random.bernoulli(_key(9), 0.3, (b,)).astype(F32)
    return _step(loss, opt), (params, opt.init(params), ids, dense, label), (0, 1), {2: 0, 3: 0, 4: 0}


def _gn(x: jax.Array, g: jax.Array, b: jax.Array, groups: int = 8, eps: float = 1e-5) -> jax.Array:
    """GroupNorm: statistics per example and channel group, never across the batch."""
    n, h, w, c = x.shape
    xg = x.reshape(n, h, w, groups, c // groups)
    mean, var = xg.mean(axis=(1, 2, 4), keepdims=True), xg.var(axis=(1, 2, 4), keepdims=True)
    return ((xg - mean) * lax.rsqrt(var + eps)).reshape(n, h, w, c) * g + b


def _unet_params() -> dict[str, Any]:
    """Encoder, middle and decoder convolutions of a two-level U-Net (the input has a sigma channel)."""
    key = iter(jax.random.split(_key(10), 32))
    params: dict[str, Any] = {}
    convs = [("e1", 4, 32), ("d1", 32, 64), ("d2", 64, 128), ("mid", 128, 128), ("u2", 128 + 64, 64),
             ("u1", 64 + 32, 32), ("out", 32, 3)]
    for name, cin, cout in convs:
        params[name] = {"w": _normal(next(key), (3, 3, cin, cout), (2.0 / (9 * cin)) ** 0.5),
                        "bias": jnp.zeros((cout,), F32)}
        if name != "out":
            params[name]["g"], params[name]["b"] = jnp.ones((cout,), F32), jnp.zeros((cout,), F32)
    return params


@program
def unet() -> Program:
    """A diffusion-style U-Net denoising step: strided convolutions down, resize up, skips across."""
    params = _unet_params()

    def block(p: Any, x: jax.Array, stride: int = 1) -> jax.Array:
        return jax.nn.silu(_gn(_conv(x, p["w"], stride) + p["bias"], p["g"], p["b"]))

    def net(p: Any, x: jax.Array, sigma: jax.Array) -> jax.Array:
        x = jnp.concatenate([x, jnp.broadcast_to(sigma[:, None, None, None], (*x.shape[:3], 1))], -1)
        s1 = block(p["e1"], x)
        s2 = block(p["d1"], s1, 2)
        h = block(p["mid"], block(p["d2"], s2, 2))
        n = h.shape[0]
        h = jax.image.resize(h, (n, 16, 16, h.shape[-1]), "nearest")
        h = block(p["u2"], jnp.concatenate([h, s2], -1))
        h = jax.image.resize(h, (n, 32, 32, h.shape[-1]), "nearest")
        h = block(p["u1"], jnp.concatenate([h, s1], -1))
        return _conv(h, p["out"]["w"]) + p["out"]["bias"]

    def loss(p: Any, x0: jax.Array, noise: jax.Array, sigma: jax.Array) -> jax.Array:
        return jnp.mean((net(p, x0 + sigma[:, None, None, None] * noise, sigma) - noise) ** 2)

    opt = optax.adam(1e-3)
    x0 = _normal(_key(11), (16, 32, 32, 3))
    noise = _normal(_key(12), (16, 32, 32, 3))
    sigma = jax.random.uniform(_key(13), (16,), F32, 0.1, 1.0)
    return _step(loss, opt), (params, opt.init(params), x0, noise, sigma), (0, 1), {2: 0, 3: 0, 4: 0}


@program
def ssm() -> Program:
    """A linear recurrence over the sequence (lax.associative_scan) between MLPs: an SSM's core."""
    b, length, d, layers = 16, 256, 256, 2
    key = iter(jax.random.split(_key(14), 32))
    params = {"layers": [{"lam": _normal(next(key), (d,), 1.0) + 2.0,
                          "B": _normal(next(key), (d, d), d ** -0.5),
                          "C": _normal(next(key), (d, d), d ** -0.5),
                          "w1": _normal(next(key), (d, 4 * d), d ** -0.5),
                          "w2": _normal(next(key), (4 * d, d), (4 * d) ** -0.5),
                          "ln": jnp.ones((d,), F32)} for _ in range(layers)],
              "out": _normal(next(key), (d, d), d ** -0.5)}

    def combine(left: tuple[jax.Array, jax.Array], right: tuple[jax.Array, jax.Array]) -> Any:
        return left[0] * right[0], right[0] * left[1] + right[1]

    def layer(p: Any, x: jax.Array) -> jax.Array:
        h = x * lax.rsqrt(jnp.mean(x ** 2, -1, keepdims=True) + 1e-6) * p["ln"]
        a = jnp.broadcast_to(jax.nn.sigmoid(p["lam"]), h.shape)
        _, s = lax.associative_scan(combine, (a, h @ p["B"]), axis=1)
        x = x + s @ p["C"]
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

    def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        for lp in p["layers"]:
            x = layer(lp, x)
        return jnp.mean((x @ p["out"] - y) ** 2)

    opt = optax.adam(1e-3)
    x = _normal(_key(15), (b, length, d))
    y = _normal(_key(16), (b, length, d))
    return _step(loss, opt), (params, opt.init(params), x, y), (0, 1), {2: 0, 3: 0}
