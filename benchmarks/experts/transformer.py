"""Decoder training steps (fwd + grad + AdamW): the GPT of examples/models.py (gather embedding,
learned positions, LayerNorm, GELU MLP) and a llama-style decoder (RMSNorm, rotary embeddings,
SwiGLU MLP, untied embedding), both 2 layers, d_model 512, 8 heads, vocabulary 4096, sequence 128,
batch 16.

Experts (argument layouts pinned through `in_shardings`, intermediates left to the extractor;
optimizer state mirrors the parameters):
- DP: parameters replicated, tokens split over every axis;
- DP+Megatron: attention heads, MLP columns/rows and the vocabulary (embedding rows, unembedding
  columns) split over the tensor-parallel axis, tokens over the other axes;
- FSDP: each parameter split over every axis on its largest dimension, tokens over every axis;
- FSDP+TP (meshes with "model"): DP+Megatron plus the data axes on each parameter's largest free
  dimension;
- DP+FSDP+TP (meshes with "fsdp"): DP+Megatron plus "fsdp" alone on each parameter's largest free
  dimension, tokens over every axis but "model";
- FSDP+TP+SP (meshes with "seq", 4 axes): FSDP+TP over the data axes but "seq", and the tokens'
  sequence dimension split over "seq".
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from common import (
    ALL_MESHES,
    F32,
    Problem,
    S,
    Workload,
    adamw_step,
    add_fsdp,
    axes_of,
    leaf_name,
    opt_specs,
    tree_specs,
)
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

LAYERS, D_MODEL, HEADS, VOCAB, SEQ, BATCH = 2, 512, 8, 4096, 128, 16
GPT_MLP, LLAMA_MLP = 2048, 1536


# -- llama ----------------------------------------------------------------------------------------


def rms(x: jax.Array, g: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding of x [batch, heads, seq, head_dim]."""
    s, k = x.shape[-2], x.shape[-1]
    half = k // 2
    inv = 1.0 / (10000 ** (jnp.arange(half, dtype=F32) / half))
    ang = jnp.arange(s, dtype=F32)[:, None] * inv[None, :]
    c, sn = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * c - x2 * sn, x1 * sn + x2 * c], -1)


def llama_params(layers: int, d: int, h: int, f: int, vocab: int) -> dict[str, Any]:
    return {
        "embed": S(vocab, d),
        "layers": [{"n1": S(d), "wq": S(d, h, d // h), "wk": S(d, h, d // h), "wv": S(d, h, d // h),
                    "wo": S(h, d // h, d), "n2": S(d), "wg": S(d, f), "wu": S(d, f), "wd": S(f, d)}
                   for _ in range(layers)],
        "nf": S(d),
        "unembed": S(d, vocab),
    }


def llama_loss(p: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    x = jnp.take(p["embed"], batch["tokens"], axis=0)
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    for layer in p["layers"]:
        hh = rms(x, layer["n1"])
        q = rope(jnp.einsum("bsd,dhk->bhsk", hh, layer["wq"]))
        k = rope(jnp.einsum("bsd,dhk->bhsk", hh, layer["wk"]))
        v = jnp.einsum("bsd,dhk->bhsk", hh, layer["wv"])
        sc = jnp.einsum("bhqk,bhsk->bhqs", q, k) / jnp.sqrt(F32(q.shape[-1]))
        sc = jnp.where(causal, sc, -1e9)
        w = jax.nn.softmax(sc, -1)
        x = x + jnp.einsum("bhqk,hkd->bqd", jnp.einsum("bhqs,bhsk->bhqk", w, v), layer["wo"])
        hh = rms(x, layer["n2"])
        x = x + (jax.nn.silu(hh @ layer["wg"]) * (hh @ layer["wu"])) @ layer["wd"]
    logits = rms(x, p["nf"]) @ p["unembed"]
    logp = jax.nn.log_softmax(logits, -1)
    lab = jax.nn.one_hot(batch["targets"], logits.shape[-1], dtype=F32)
    return -(logp * lab).sum(-1).mean()


# -- experts --------------------------------------------------------------------------------------


def megatron_spec(name: str, tp: str) -> P:
    """Megatron layout of a GPT or llama parameter, by its leaf name."""
    if name in ("wq", "wk", "wv"):
        return P(None, tp, None)  # heads
    if name == "wo":
        return P(tp, None, None)
    if name in ("w1", "wg", "wu"):
        return P(None, tp)  # column-parallel
    if name == "b1":
        return P(tp)
    if name in ("w2", "wd"):
        return P(tp, None)  # row-parallel
    if name == "embed":
        return P(tp, None)  # vocab-parallel embedding
    if name == "unembed":
        return P(None, tp)
    return P()


def experts(mesh: Mesh, params: Any, opt_state: Any) -> dict[str, Any]:
    ax = axes_of(mesh)
    tok_all = P(ax.all)
    tok_dp = P(ax.dp) if ax.dp else P()

    def pack(pspecs: Any, tok: P) -> Any:
        return ((pspecs, opt_specs(opt_state, pspecs)), {"tokens": tok, "targets": tok})

    out = {
        "DP": pack(tree_specs(params, lambda p, x: P()), tok_all),
        "DP+Megatron": pack(tree_specs(params, lambda p, x: megatron_spec(leaf_name(p), ax.tp)), tok_dp),
        "FSDP": pack(tree_specs(params, lambda p, x: add_fsdp(P(), x, ax.all, mesh.size)), tok_all),
    }
    if ax.dp:
        fsdp_tp = tree_specs(params, lambda p, x: add_fsdp(megatron_spec(leaf_name(p), ax.tp), x, ax.dp,
                                                           ax.dp_size))
        out["FSDP+TP"] = pack(fsdp_tp, tok_dp)
    if "fsdp" in mesh.shape:
        dp_fsdp_tp = tree_specs(params, lambda p, x: add_fsdp(megatron_spec(leaf_name(p), ax.tp), x, ("fsdp",),
                                                              mesh.shape["fsdp"]))
        out["DP+FSDP+TP"] = pack(dp_fsdp_tp, tok_dp)
    if "seq" in mesh.shape:  # DP + FSDP + TP + sequence parallelism: tokens' sequence over "seq"
        dp = tuple(a for a in ax.dp if a != "seq")
        size = ax.dp_size // mesh.shape["seq"]
        params_sp = tree_specs(params, lambda p, x: add_fsdp(megatron_spec(leaf_name(p), ax.tp), x, dp, size))
        out["FSDP+TP+SP"] = pack(params_sp, P(dp, "seq"))
    return out


# -- workloads ------------------------------------------------------------------------------------


def build(model: str, mesh: Mesh) -> Problem:
    if model == "gpt":
        cfg = GPTConfig(layers=LAYERS, d_model=D_MODEL, heads=HEADS, mlp=GPT_MLP, vocab=VOCAB, seq=SEQ,
                        batch=BATCH, embed="gather")
        opt, step = make_gpt_step(cfg)
        params = gpt_params(cfg, abstract=True)
        batch = gpt_batch(cfg, abstract=True)
    else:
        opt, step = adamw_step(llama_loss)
        params = llama_params(LAYERS, D_MODEL, HEADS, LLAMA_MLP, VOCAB)
        batch = {"tokens": S(BATCH, SEQ, dtype=jnp.int32), "targets": S(BATCH, SEQ, dtype=jnp.int32)}
    opt_state = jax.eval_shape(opt.init, params)
    return Problem(step, ((params, opt_state), batch), experts(mesh, params, opt_state), state_argnums=(0,))


def workloads() -> list[Workload]:
    out = []
    for model, f in (("gpt", GPT_MLP), ("llama", LLAMA_MLP)):
        name = f"{model} train L{LAYERS} d{D_MODEL} h{HEADS} f{f} V{VOCAB} s{SEQ} b{BATCH}"
        fn: Callable[[Mesh], Problem] = partial(build, model)
        out.append(Workload(name, ALL_MESHES, fn))
    return out
