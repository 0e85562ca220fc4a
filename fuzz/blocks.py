"""Building blocks of the fuzz programs, written the way an ML engineer writes them.

The generated programs (fuzz/programs.py) are short sources that call these functions, so a
failing program reads like model code and its reproducer is the program source plus this file.
Parameters are dicts of arrays; static configuration (heads, k, window, mode) is keyword
arguments with Python values. Nothing here knows about sharding: the point is to feed shardsat
the jaxprs real model code produces (einsums, gathers from `table[ids]`, scatters from `.at[]`,
top_k routing, reduce_window pooling, scans, conds, while loops, callbacks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

Array = Any
Params = dict[str, Any]

# ---- dense layers ---------------------------------------------------------------------------

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
    "leaky_relu": lambda x: jnp.where(x > 0, x, 0.01 * x),
    "softplus": jax.nn.softplus,
}


def dense(x: Array, p: Params) -> Array:
    """x @ w + b, over the last axis."""
    return x @ p["w"] + p["b"]


def mlp(x: Array, p: Params, act: str = "gelu") -> Array:
    """Two dense layers with an activation between them (a transformer's feed-forward)."""
    return dense(ACTIVATIONS[act](dense(x, p["up"])), p["down"])


def swiglu(x: Array, p: Params) -> Array:
    """LLaMA's feed-forward: silu(x W_gate) * (x W_up), then W_down."""
    return (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


def geglu(x: Array, p: Params) -> Array:
    """GLU with an exact-gelu gate, the gate and up projections fused in one matmul."""
    gate, up = jnp.split(x @ p["gate_up"], 2, axis=-1)
    return (jax.nn.gelu(gate, approximate=False) * up) @ p["down"]


# ---- normalisation --------------------------------------------------------------------------


def layer_norm(x: Array, p: Params, eps: float = 1e-5) -> Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def rms_norm(x: Array, p: Params, eps: float = 1e-6) -> Array:
    """RMS norm with the statistics in float32 (as in mixed-precision LLM code)."""
    ms = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * lax.rsqrt(ms + eps).astype(x.dtype)) * p["scale"]


def batch_norm(x: Array, p: Params, channel_axis: int = -1, eps: float = 1e-5) -> Array:
    """Training-mode batch norm: statistics over every axis but the channel axis."""
    axis = channel_axis % x.ndim
    axes = tuple(i for i in range(x.ndim) if i != axis)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.var(x, axis=axes, keepdims=True)
    scale, bias = p["scale"].reshape(shape), p["bias"].reshape(shape)
    return (x - mean) / jnp.sqrt(var + eps) * scale + bias


def dropout(x: Array, key: Array, rate: float) -> Array:
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


# ---- attention ------------------------------------------------------------------------------


def rope(x: Array, positions: Array, base: float = 10000.0) -> Array:
    """Rotary position embedding of x: (batch, seq, heads, head_dim), head_dim even."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attend(q: Array, k: Array, v: Array, mask: Array | None) -> Array:
    """Causal softmax attention of (b, s, h, d) queries, keys and values."""
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1])).astype(q.dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    allowed = causal[None, None] if mask is None else causal[None, None] & mask[:, None, None, :]
    scores = jnp.where(allowed, scores.astype(jnp.float32), -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def causal_attention(x: Array, p: Params, use_rope: bool = False, mask: Array | None = None) -> Array:
    """Multi-head causal self-attention with per-head projections wq/wk/wv: (d, h, k), wo: (h, k, d)."""
    q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", x, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    if use_rope:
        positions = jnp.arange(x.shape[1])
        q, k = rope(q, positions), rope(k, positions)
    return jnp.einsum("bshk,hkd->bsd", _attend(q, k, v, mask), p["wo"])


def fused_qkv_attention(x: Array, p: Params, heads: int) -> Array:
    """Attention with one fused qkv matmul, split and reshaped into heads (GPT-2 style)."""
    b, s, d = x.shape
    q, k, v = jnp.split(x @ p["wqkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
    out = _attend(q, k, v, None).reshape(b, s, d)
    return out @ p["wo"]


def single_example_attention(x: Array, p: Params) -> Array:
    """Attention of one (seq, d) example: written unbatched, meant for jax.vmap."""
    return causal_attention(x[None], p)[0]


# ---- embeddings and losses ------------------------------------------------------------------


def embed(table: Array, ids: Array) -> Array:
    return table[ids]


def embed_take(table: Array, ids: Array) -> Array:
    return jnp.take(table, ids, axis=0)


def embed_one_hot(table: Array, ids: Array) -> Array:
    return jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype) @ table


def cross_entropy(logits: Array, labels: Array) -> Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0].mean()


def cross_entropy_one_hot(logits: Array, labels: Array) -> Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * logp, axis=-1).mean()


def cross_entropy_optax(logits: Array, labels: Array) -> Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def masked_cross_entropy(logits: Array, labels: Array, mask: Array) -> Array:
    """Mean token loss over the positions `mask` keeps (padding excluded)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1)


def accuracy(logits: Array, labels: Array) -> tuple[Array, Array]:
    """Predicted class (int32) and whether it is right (bool)."""
    pred = jnp.argmax(logits, axis=-1)
    return pred, pred == labels


# ---- mixture of experts ---------------------------------------------------------------------


def moe(x: Array, p: Params, k: int) -> tuple[Array, Array]:
    """Top-k routed experts computed densely and combined by a gate matrix built by scatter-add.
    Returns the output and each expert's token count."""
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    logits = tokens.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    n_exp = logits.shape[-1]
    weights, experts = lax.top_k(logits, k)
    weights = jax.nn.softmax(weights, axis=-1).astype(x.dtype)
    rows = jnp.arange(b * s)[:, None]
    gates = jnp.zeros((b * s, n_exp), x.dtype).at[rows, experts].add(weights)
    hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", tokens, p["w_in"]))
    out = jnp.einsum("tef,efd->ted", hidden, p["w_out"])
    load = jnp.zeros((n_exp,), jnp.int32).at[experts.reshape(-1)].add(1)
    return jnp.einsum("te,ted->td", gates, out).reshape(b, s, d), load


def moe_gathered(x: Array, p: Params, k: int) -> tuple[Array, Array]:
    """Top-k experts whose weights are gathered per token (p["w"][experts]); also returns the
    largest gate each expert got (scatter-max)."""
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    logits = tokens @ p["router"]
    weights, experts = lax.top_k(logits, k)
    weights = jax.nn.softmax(weights.astype(jnp.float32), axis=-1).astype(x.dtype)
    w = p["w"][experts]  # (tokens, k, d, d)
    y = jnp.einsum("td,tkde,tk->te", tokens, w, weights)
    top_gate = jnp.full((logits.shape[-1],), -jnp.inf, weights.dtype).at[experts.reshape(-1)].max(weights.reshape(-1))
    return y.reshape(b, s, d), top_gate


def switch_moe(x: Array, p: Params, capacity: int) -> Array:
    """Switch-transformer routing: top-1 expert, a slot per expert from a cumsum of the one-hot
    assignment, tokens past capacity dropped (scatter with mode="drop"), experts run on their
    (capacity, d) buffers, results gathered back."""
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    probs = jax.nn.softmax((tokens @ p["router"]).astype(jnp.float32), axis=-1)
    n_exp = probs.shape[-1]
    expert = jnp.argmax(probs, axis=-1)
    gate = jnp.max(probs, axis=-1).astype(x.dtype)
    onehot = jax.nn.one_hot(expert, n_exp, dtype=jnp.int32)
    slot = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1
    buffers = jnp.zeros((n_exp, capacity, d), x.dtype).at[expert, slot].set(tokens, mode="drop")
    hidden = jax.nn.relu(jnp.einsum("ecd,edf->ecf", buffers, p["w_in"]))
    out = jnp.einsum("ecf,efd->ecd", hidden, p["w_out"])
    kept = slot < capacity
    back = out.at[expert, jnp.minimum(slot, capacity - 1)].get(mode="clip")
    return jnp.where(kept[:, None], back * gate[:, None], tokens).reshape(b, s, d)


# ---- convolutions and pooling ---------------------------------------------------------------

CONV_DIMS = {"NHWC": ("NHWC", "HWIO", "NHWC"), "NCHW": ("NCHW", "OIHW", "NCHW")}


def conv2d(x: Array, w: Array, layout: str = "NHWC", stride: int = 1, padding: Any = "SAME",
           dilation: int = 1, groups: int = 1) -> Array:
    return lax.conv_general_dilated(
        x, w, (stride, stride), padding, rhs_dilation=(dilation, dilation),
        dimension_numbers=CONV_DIMS[layout], feature_group_count=groups,
    )


def causal_conv1d(x: Array, w: Array) -> Array:
    """Causal convolution over the sequence of x: (b, s, d), w: (width, d, d_out)."""
    width = w.shape[0]
    return lax.conv_general_dilated(x, w, (1,), [(width - 1, 0)], dimension_numbers=("NWC", "WIO", "NWC"))


def _window(layout: str, size: int) -> tuple[int, int, int, int]:
    return (1, size, size, 1) if layout == "NHWC" else (1, 1, size, size)


def avg_pool(x: Array, window: int, stride: int, layout: str = "NHWC", padding: str = "VALID") -> Array:
    summed = lax.reduce_window(x, 0.0, lax.add, _window(layout, window),
                               _window(layout, stride), padding)
    return summed / (window * window)


def max_pool(x: Array, window: int, stride: int, layout: str = "NHWC", padding: str = "VALID") -> Array:
    return lax.reduce_window(x, -jnp.inf, lax.max, _window(layout, window),
                             _window(layout, stride), padding)


def global_avg_pool(x: Array, layout: str = "NHWC") -> Array:
    return x.mean(axis=(1, 2) if layout == "NHWC" else (2, 3))


# ---- sequence and tensor plumbing -----------------------------------------------------------


def padded_smooth(x: Array, axis: int, width: int, mode: str) -> Array:
    """Three-tap smoothing along `axis` after jnp.pad in `mode` (same shape out)."""
    pads = [(0, 0)] * x.ndim
    pads[axis] = (width, width)
    padded = jnp.pad(x, pads, mode=mode)
    n = x.shape[axis]
    taps = [lax.slice_in_dim(padded, start, start + n, axis=axis) for start in (0, width, 2 * width)]
    return (taps[0] + taps[1] + taps[2]) / 3


def running_mean(x: Array, axis: int = 1) -> Array:
    n = x.shape[axis]
    counts = jnp.arange(1, n + 1, dtype=x.dtype).reshape([n if i == axis % x.ndim else 1 for i in range(x.ndim)])
    return jnp.cumsum(x, axis=axis) / counts


def sort_tokens(x: Array) -> tuple[Array, Array]:
    """Reorders each sequence by its first feature (argsort + take_along_axis); also returns the order."""
    order = jnp.argsort(x[..., 0], axis=-1)
    return jnp.take_along_axis(x, order[..., None], axis=1), order


def top_features(x: Array, k: int) -> Array:
    """The k largest features of each token, in descending order (jnp.sort)."""
    return -jnp.sort(-x, axis=-1)[..., :k]


def split_heads_roundtrip(x: Array, heads: int) -> Array:
    """(b, s, d) -> (b, h, s, d/h) -> scale per head -> back: reshape/transpose chains."""
    b, s, d = x.shape
    per_head = x.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)
    scale = jnp.arange(1, heads + 1, dtype=x.dtype)[None, :, None, None] / heads
    return (per_head * scale).transpose(0, 2, 1, 3).reshape(b, s, d)


def swap_halves(x: Array, k: int) -> Array:
    left, right = jnp.split(x, [k], axis=-1)
    return jnp.concatenate([right, left], axis=-1)


def stack_mix(x: Array, y: Array) -> Array:
    return jnp.stack([x, y, x * y], axis=0).mean(axis=0)


def segment_pool(x: Array, segment_ids: Array, num_segments: int) -> Array:
    """Sum of token features per segment (packed sequences): jax.ops.segment_sum."""
    return jax.ops.segment_sum(x.reshape(-1, x.shape[-1]), segment_ids.reshape(-1), num_segments=num_segments)


# ---- control flow ---------------------------------------------------------------------------


def gated_mlp(x: Array, p: Params, pred: Array) -> Array:
    """lax.cond: the MLP when `pred`, a cheap damping otherwise."""
    return lax.cond(pred, lambda h: mlp(h, p), lambda h: h * 0.5, x)


def switch_activation(x: Array, p: Params, index: Array) -> Array:
    """lax.switch over three branches, one with a dense layer."""
    return lax.switch(jnp.clip(index, 0, 2), [lambda h: h, jnp.tanh, lambda h: dense(h, p)], x)


def renormalize(x: Array, max_norm: float) -> Array:
    """Halve x until its RMS is below max_norm (a data-dependent while loop, at most 30 times)."""
    def cond(carry: tuple[Array, Array]) -> Array:
        i, h = carry
        return (i < 30) & (jnp.sqrt(jnp.mean(jnp.square(h.astype(jnp.float32)))) > max_norm)

    return lax.while_loop(cond, lambda c: (c[0] + 1, c[1] * 0.5), (jnp.int32(0), x))[1]


def repeat_layer(x: Array, p: Params, n: Any) -> Array:
    """lax.fori_loop applying a shared residual layer n times (n static or traced)."""
    return lax.fori_loop(0, n, lambda i, h: h + 0.1 * jnp.tanh(h @ p["w"]), x)


def rnn(x: Array, p: Params) -> Array:
    """An Elman RNN over the sequence axis with lax.scan (time-major inside)."""
    def step(h: Array, x_t: Array) -> tuple[Array, Array]:
        h = jnp.tanh(x_t @ p["w_x"] + h @ p["w_h"])
        return h, h

    h0 = jnp.zeros((x.shape[0], p["w_h"].shape[0]), x.dtype)
    _, hs = lax.scan(step, h0, jnp.swapaxes(x, 0, 1))
    return jnp.swapaxes(hs, 0, 1)
