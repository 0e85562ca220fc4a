"""Example models written with plain jax.numpy (no framework): a GPT-style decoder, a graph
network and a small conv net, each with a training step. Used by the examples, tests and
benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 2
    d_model: int = 512
    heads: int = 8
    mlp: int = 2048
    vocab: int = 4096
    seq: int = 128
    batch: int = 8
    embed: str = "gather"  # "gather" (jnp.take) or "onehot" (one-hot matmul)


def gpt_params(cfg: GPTConfig, key: Any = None, abstract: bool = False) -> dict[str, Any]:
    """Parameters as a pytree; `abstract=True` gives ShapeDtypeStructs (nothing allocated)."""
    d, h = cfg.d_model, cfg.heads
    shapes: dict[str, Any] = {
        "embed": (cfg.vocab, d),
        "pos": (cfg.seq, d),
        "layers": [
            {
                "ln1": {"scale": (d,), "bias": (d,)},
                "wq": (d, h, d // h),
                "wk": (d, h, d // h),
                "wv": (d, h, d // h),
                "wo": (h, d // h, d),
                "ln2": {"scale": (d,), "bias": (d,)},
                "w1": (d, cfg.mlp),
                "b1": (cfg.mlp,),
                "w2": (cfg.mlp, d),
                "b2": (d,),
            }
            for _ in range(cfg.layers)
        ],
        "ln_f": {"scale": (d,), "bias": (d,)},
        "unembed": (d, cfg.vocab),
    }
    leaves, tree = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    if abstract:
        return jax.tree_util.tree_unflatten(tree, [jax.ShapeDtypeStruct(s, jnp.float32) for s in leaves])
    keys = jax.random.split(key if key is not None else jax.random.key(0), len(leaves))
    out = []
    for k, s in zip(keys, leaves, strict=True):
        if len(s) == 1:
            out.append(jnp.zeros(s, jnp.float32))
        else:
            fan_in = s[0]
            out.append(jax.random.normal(k, s, jnp.float32) / jnp.sqrt(fan_in))
    params = jax.tree_util.tree_unflatten(tree, out)
    for layer in params["layers"]:
        layer["ln1"]["scale"] = jnp.ones((d,), jnp.float32)
        layer["ln2"]["scale"] = jnp.ones((d,), jnp.float32)
    params["ln_f"]["scale"] = jnp.ones((d,), jnp.float32)
    return params


def layer_norm(p: dict[str, Any], x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def attention(p: dict[str, Any], x: jax.Array) -> jax.Array:
    q = jnp.einsum("bsd,dhk->bhsk", x, p["wq"])
    k = jnp.einsum("bsd,dhk->bhsk", x, p["wk"])
    v = jnp.einsum("bsd,dhk->bhsk", x, p["wv"])
    scores = jnp.einsum("bhqk,bhsk->bhqs", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, -1e9)
    weights = jax.nn.softmax(scores, axis=-1)
    ctx = jnp.einsum("bhqs,bhsk->bhqk", weights, v)
    return jnp.einsum("bhqk,hkd->bqd", ctx, p["wo"])


def embed_tokens(params: dict[str, Any], tokens: jax.Array, embed: str = "gather") -> jax.Array:
    """Token embedding (a gather, or a one-hot matmul) plus learned positions."""
    if embed == "gather":
        x = jnp.take(params["embed"], tokens, axis=0)
    else:
        x = jax.nn.one_hot(tokens, params["embed"].shape[0], dtype=jnp.float32) @ params["embed"]
    return x + params["pos"][None, : tokens.shape[1]]


def gpt_logits(params: dict[str, Any], tokens: jax.Array, embed: str = "gather") -> jax.Array:
    x = embed_tokens(params, tokens, embed)
    for layer in params["layers"]:
        x = x + attention(layer, layer_norm(layer["ln1"], x))
        h = jax.nn.gelu(layer_norm(layer["ln2"], x) @ layer["w1"] + layer["b1"])
        x = x + h @ layer["w2"] + layer["b2"]
    x = layer_norm(params["ln_f"], x)
    return x @ params["unembed"]


def gpt_loss(params: dict[str, Any], batch: dict[str, jax.Array], embed: str = "gather",
             logits_fn: Any = None) -> jax.Array:
    logits = (logits_fn or gpt_logits)(params, batch["tokens"], embed)
    logp = jax.nn.log_softmax(logits, axis=-1)
    labels = jax.nn.one_hot(batch["targets"], logits.shape[-1], dtype=logp.dtype)
    return -(logp * labels).sum(-1).mean()


def gpt_batch(cfg: GPTConfig, key: Any = None, abstract: bool = False) -> dict[str, Any]:
    shape = (cfg.batch, cfg.seq)
    if abstract:
        return {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32), "targets": jax.ShapeDtypeStruct(shape, jnp.int32)}
    k1, k2 = jax.random.split(key if key is not None else jax.random.key(1))
    return {
        "tokens": jax.random.randint(k1, shape, 0, cfg.vocab, jnp.int32),
        "targets": jax.random.randint(k2, shape, 0, cfg.vocab, jnp.int32),
    }


def make_gpt_step(cfg: GPTConfig, learning_rate: float = 1e-3, loss_fn: Any = None,
                  eps: float = 1e-8) -> tuple[Any, Any]:
    """(optimizer, step): step(state, batch) -> (state, loss), state = (params, opt_state)."""
    import optax

    opt = optax.adamw(learning_rate, eps=eps, weight_decay=0.01)
    loss_fn = loss_fn or gpt_loss

    def step(state: tuple[Any, Any], batch: dict[str, jax.Array]) -> tuple[tuple[Any, Any], jax.Array]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg.embed)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), loss

    return opt, step


def stack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """The same parameters with `layers` stacked on a leading dimension, for `lax.scan`."""
    out = dict(params)
    out["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params["layers"])
    return out


def gpt_logits_scan(params: dict[str, Any], tokens: jax.Array, embed: str = "gather") -> jax.Array:
    """gpt_logits with the layers run by `lax.scan` over stacked layer parameters."""
    x = embed_tokens(params, tokens, embed)

    def layer(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        x = x + attention(p, layer_norm(p["ln1"], x))
        h = jax.nn.gelu(layer_norm(p["ln2"], x) @ p["w1"] + p["b1"])
        return x + h @ p["w2"] + p["b2"], None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return layer_norm(params["ln_f"], x) @ params["unembed"]


def gpt_loss_scan(params: dict[str, Any], batch: dict[str, jax.Array], embed: str = "gather") -> jax.Array:
    return gpt_loss(params, batch, embed, logits_fn=gpt_logits_scan)


def make_gpt_scan_step(cfg: GPTConfig, learning_rate: float = 1e-3) -> tuple[Any, Any]:
    """Like make_gpt_step, for stacked parameters (see stack_layers) and a scanned forward."""
    return make_gpt_step(cfg, learning_rate, loss_fn=gpt_loss_scan)
