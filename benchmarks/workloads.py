"""Benchmark workloads for shardsat: model functions, their abstract arguments, and the
hand-written ("expert") sharding pins they are compared against.

Everything here is abstract (jax.ShapeDtypeStruct); nothing is allocated or compiled.

Workloads
---------
* MLP chain, residual: `x = x + tanh(x @ W1_i) @ W2_i` for i in 0..n-1.
* Transformer layer forward (pre-LayerNorm): LayerNorm -> causal multi-head self-attention
  (q/k/v projections by einsum, causal mask with jnp.where, softmax, output projection) -> residual
  -> LayerNorm -> GELU MLP -> residual. Plain jax.numpy, no flax.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

F32 = jnp.float32


def _s(*shape: int, dtype: Any = F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


# -- MLP chain ----------------------------------------------------------------------------------


def mlp_chain(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """Residual MLP chain: x = x + tanh(x @ W1_i) @ W2_i."""
    for blk in params:
        x = x + jnp.tanh(x @ blk["w1"]) @ blk["w2"]
    return x


def mlp_chain_args(blocks: int, batch: int, d: int, hidden: int) -> tuple[Any, Any]:
    params = [{"w1": _s(d, hidden), "w2": _s(hidden, d)} for _ in range(blocks)]
    return params, _s(batch, d)


# -- Transformer layer --------------------------------------------------------------------------


def layernorm(x: jax.Array, g: jax.Array, b: jax.Array, eps: float = 1e-5) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def softmax(s: jax.Array) -> jax.Array:
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def transformer_layer(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One pre-LN transformer layer, forward. x: [batch, seq, d_model]."""
    seq = x.shape[1]
    head_dim = p["wq"].shape[-1]
    h = layernorm(x, p["ln1_g"], p["ln1_b"])
    q = jnp.einsum("bsd,dhk->bhsk", h, p["wq"])
    k = jnp.einsum("bsd,dhk->bhsk", h, p["wk"])
    v = jnp.einsum("bsd,dhk->bhsk", h, p["wv"])
    scores = jnp.einsum("bhqk,bhsk->bhqs", q, k) * (1.0 / math.sqrt(head_dim))
    causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    attn = softmax(scores)
    o = jnp.einsum("bhqs,bhsk->bhqk", attn, v)
    x = x + jnp.einsum("bhqk,hkd->bqd", o, p["wo"])
    h = layernorm(x, p["ln2_g"], p["ln2_b"])
    x = x + jax.nn.gelu(h @ p["w1"], approximate=True) @ p["w2"]
    return x


def transformer_args(batch: int, seq: int, d_model: int, heads: int, mlp: int) -> tuple[Any, Any]:
    hd = d_model // heads
    p = {
        "ln1_g": _s(d_model), "ln1_b": _s(d_model),
        "wq": _s(d_model, heads, hd), "wk": _s(d_model, heads, hd), "wv": _s(d_model, heads, hd),
        "wo": _s(heads, hd, d_model),
        "ln2_g": _s(d_model), "ln2_b": _s(d_model),
        "w1": _s(d_model, mlp), "w2": _s(mlp, d_model),
    }
    return p, _s(batch, seq, d_model)


# -- hand-written pins --------------------------------------------------------------------------


def _all_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    return tuple(mesh.axis_names)


def _batch_spec_megatron(mesh: jax.sharding.Mesh) -> P:
    """x is batch-split over "data" when that axis has more than one device, else replicated."""
    return P("data") if mesh.shape["data"] > 1 else P()


def data_parallel_pins(params: Any, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """Parameters replicated, batch dimension of x split over every mesh axis."""
    return (jax.tree_util.tree_map(lambda _: P(), params), P(_all_axes(mesh)))


def megatron_mlp_pins(params: list[dict[str, Any]], mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """W1 column-parallel, W2 row-parallel over "model"."""
    pins = [{"w1": P(None, "model"), "w2": P("model", None)} for _ in params]
    return (pins, _batch_spec_megatron(mesh))


def megatron_transformer_pins(params: dict[str, Any], mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """q/k/v split over heads, output projection row-split over heads, MLP W1 column- / W2
    row-parallel, LayerNorm parameters replicated."""
    pins = {
        "ln1_g": P(), "ln1_b": P(), "ln2_g": P(), "ln2_b": P(),
        "wq": P(None, "model", None), "wk": P(None, "model", None), "wv": P(None, "model", None),
        "wo": P("model", None, None),
        "w1": P(None, "model"), "w2": P("model", None),
    }
    return (pins, _batch_spec_megatron(mesh))


# -- registry -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    megatron: Callable[[Any, jax.sharding.Mesh], tuple[Any, Any]]


def mlp_tp(blocks: int = 4) -> Workload:
    return Workload(
        f"MLP chain x{blocks}, TP regime (b8 d8192 h32768)",
        mlp_chain, mlp_chain_args(blocks, 8, 8192, 32768), megatron_mlp_pins,
    )


def mlp_dp(blocks: int = 4) -> Workload:
    return Workload(
        f"MLP chain x{blocks}, DP regime (b32768 d64 h256)",
        mlp_chain, mlp_chain_args(blocks, 32768, 64, 256), megatron_mlp_pins,
    )


def transformer(batch: int = 8, seq: int = 512, d_model: int = 1024, heads: int = 16,
                mlp: int = 4096) -> Workload:
    return Workload(
        f"Transformer layer (b{batch} s{seq} d{d_model} h{heads} mlp{mlp})",
        transformer_layer, transformer_args(batch, seq, d_model, heads, mlp), megatron_transformer_pins,
    )
