"""Other workloads: a Soft-MoE layer (forward; training step), a pre-dispatched grouped MoE expert
MLP (forward), a small conv net and a tied-embedding language model (training steps, AdamW).

Experts (argument layouts pinned through `in_shardings`, intermediates left to the extractor;
in training the optimizer state mirrors the parameters unless stated otherwise):
- Soft-MoE: DP (replicated, batch over every axis); EP(all) (experts over every axis, batch over
  every axis); EP(model)+DP (experts over "model", batch over the other axes);
- grouped MoE: EP(all) (experts and the token groups over every axis); DP(capacity split)
  (weights replicated, capacity over every axis); EP(model)+DP (experts over "model", capacity over
  the other axes);
- conv net: DP; FSDP (each parameter over every axis on its largest dimension); DP+WUS
  (parameters replicated, optimizer state as FSDP);
- tied embedding: DP; VocabPar(tp)+DP (embedding rows over the tensor-parallel axis, tokens over
  the other axes); VocabPar(all)+DP (embedding rows and tokens over every axis); FSDP.
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
    axes_of,
    fsdp_spec,
    leaf_name,
    opt_specs,
    replicated,
    tree_specs,
)
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# -- Soft-MoE -------------------------------------------------------------------------------------


def moe_params(d: int, experts: int, slots: int, f: int) -> dict[str, Any]:
    return {"phi": S(d, experts, slots), "w1": S(experts, d, f), "w2": S(experts, f, d)}


def soft_moe(p: dict[str, Any], x: jax.Array) -> jax.Array:
    """Soft-MoE layer with a residual, x [B, T, d]."""
    logits = jnp.einsum("btd,des->btes", x, p["phi"])
    dispatch = jax.nn.softmax(logits, axis=1)  # over tokens
    b, t, e, s = logits.shape
    combine = jax.nn.softmax(logits.reshape(b, t, e * s), axis=-1).reshape(b, t, e, s)
    xs = jnp.einsum("btes,btd->besd", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("besd,edf->besf", xs, p["w1"]))
    ys = jnp.einsum("besf,efd->besd", h, p["w2"])
    return x + jnp.einsum("btes,besd->btd", combine, ys)


def soft_moe_mse(p: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((soft_moe(p, batch["x"]) - batch["y"]) ** 2)


def grouped_moe(p: dict[str, Any], x: jax.Array) -> jax.Array:
    """Expert MLP on tokens already grouped per expert with capacity C: x [E, C, d]."""
    h = jax.nn.relu(jnp.einsum("ecd,edf->ecf", x, p["w1"]))
    return jnp.einsum("ecf,efd->ecd", h, p["w2"])


def soft_moe_experts(mesh: Mesh, params: dict[str, Any]) -> dict[str, tuple[Any, P]]:
    """(parameter specs, batch spec) per expert."""
    ax = axes_of(mesh)
    out = {
        "DP": ({k: P() for k in params}, P(ax.all)),
        "EP(all)": ({"phi": P(), "w1": P(ax.all), "w2": P(ax.all)}, P(ax.all)),
    }
    if ax.dp:
        out["EP(model)+DP"] = ({"phi": P(), "w1": P("model"), "w2": P("model")}, P(ax.dp))
    return out


def grouped_moe_experts(mesh: Mesh) -> dict[str, tuple[Any, P]]:
    ax = axes_of(mesh)
    out = {
        "EP(all)": ({"w1": P(ax.all), "w2": P(ax.all)}, P(ax.all)),
        "DP(capacity split)": ({"w1": P(), "w2": P()}, P(None, ax.all)),
    }
    if ax.dp:
        out["EP(model)+DP"] = ({"w1": P("model"), "w2": P("model")}, P("model", ax.dp))
    return out


def build_soft_moe(b: int, t: int, d: int, e: int, s: int, f: int, train: bool, mesh: Mesh) -> Problem:
    params = moe_params(d, e, s, f)
    ex = soft_moe_experts(mesh, params)
    if not train:
        return Problem(soft_moe, (params, S(b, t, d)), dict(ex))
    opt, step = adamw_step(soft_moe_mse)
    opt_state = jax.eval_shape(opt.init, params)
    pinned = {k: ((ps, opt_specs(opt_state, ps)), {"x": xs, "y": xs}) for k, (ps, xs) in ex.items()}
    return Problem(step, ((params, opt_state), {"x": S(b, t, d), "y": S(b, t, d)}), pinned, state_argnums=(0,))


def build_grouped_moe(e: int, c: int, d: int, f: int, mesh: Mesh) -> Problem:
    params = {"w1": S(e, d, f), "w2": S(e, f, d)}
    return Problem(grouped_moe, (params, S(e, c, d)), dict(grouped_moe_experts(mesh)))


# -- conv net -------------------------------------------------------------------------------------


def conv_params(chans: list[int], classes: int) -> dict[str, Any]:
    p = {}
    cin = chans[0]
    for i, c in enumerate(chans[1:]):
        p[f"c{i}"] = S(3, 3, cin, c)
        p[f"b{i}"] = S(c)
        cin = c
    p["head"] = S(cin, classes)
    return p


def conv_loss(p: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    """3x3 convolutions + ReLU, 2x2 average pooling after every second one, global pooling, linear
    head, softmax cross-entropy against soft labels."""
    x = batch["x"]
    i = 0
    while f"c{i}" in p:
        x = jax.lax.conv_general_dilated(x, p[f"c{i}"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = jax.nn.relu(x + p[f"b{i}"])
        if i % 2 == 1:
            n, h, w, c = x.shape
            x = x.reshape(n, h // 2, 2, w // 2, 2, c).mean((2, 4))
        i += 1
    x = x.mean((1, 2))
    lp = jax.nn.log_softmax(x @ p["head"])
    return -(lp * batch["y"]).sum(-1).mean()


def build_conv(n: int, hw: int, c0: int, c1: int, c2: int, classes: int, mesh: Mesh) -> Problem:
    ax = axes_of(mesh)
    params = conv_params([c0, c1, c1, c2, c2], classes)
    opt, step = adamw_step(conv_loss)
    opt_state = jax.eval_shape(opt.init, params)
    rep = replicated(params)
    fsdp = {k: fsdp_spec(v, ax.all, mesh.size) for k, v in params.items()}
    batch = {"x": P(ax.all), "y": P(ax.all)}
    ex = {
        "DP": ((rep, opt_specs(opt_state, rep)), batch),
        "FSDP": ((fsdp, opt_specs(opt_state, fsdp)), batch),
        "DP+WUS": ((rep, opt_specs(opt_state, fsdp)), batch),
    }
    args = ((params, opt_state), {"x": S(n, hw, hw, c0), "y": S(n, classes)})
    return Problem(step, args, ex, state_argnums=(0,))


# -- tied embedding -------------------------------------------------------------------------------


def emb_params(vocab: int, d: int, f: int, layers: int) -> dict[str, Any]:
    return {"embed": S(vocab, d), "layers": [{"w1": S(d, f), "w2": S(f, d)} for _ in range(layers)]}


def emb_loss(p: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    x = jnp.take(p["embed"], batch["tokens"], axis=0)
    for layer in p["layers"]:
        x = x + jax.nn.gelu(x @ layer["w1"]) @ layer["w2"]
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    logits = jnp.einsum("bsd,vd->bsv", x, p["embed"])  # tied
    lp = jax.nn.log_softmax(logits, -1)
    lab = jax.nn.one_hot(batch["targets"], lp.shape[-1], dtype=F32)
    return -(lp * lab).sum(-1).mean()


def build_emb(vocab: int, d: int, f: int, layers: int, b: int, s: int, mesh: Mesh) -> Problem:
    ax = axes_of(mesh)
    params = emb_params(vocab, d, f, layers)
    opt, step = adamw_step(emb_loss)
    opt_state = jax.eval_shape(opt.init, params)
    tok_all, tok_dp = P(ax.all), (P(ax.dp) if ax.dp else P())

    def pack(pspecs: Any, tok: P) -> Any:
        return ((pspecs, opt_specs(opt_state, pspecs)), {"tokens": tok, "targets": tok})

    def vocab_par(axes: Any) -> Any:
        return tree_specs(params, lambda p, x: P(axes, None) if leaf_name(p) == "embed" else P())

    ex = {
        "DP": pack(replicated(params), tok_all),
        "VocabPar(tp)+DP": pack(vocab_par(ax.tp), tok_dp),
        "VocabPar(all)+DP": pack(vocab_par(ax.all), tok_all),
        "FSDP": pack(tree_specs(params, lambda p, x: fsdp_spec(x, ax.all, mesh.size)), tok_all),
    }
    tokens = S(b, s, dtype=jnp.int32)
    return Problem(step, ((params, opt_state), {"tokens": tokens, "targets": tokens}), ex, state_argnums=(0,))


# -- workloads ------------------------------------------------------------------------------------


def workloads() -> list[Workload]:
    def w(name: str, fn: Callable[[Mesh], Problem]) -> Workload:
        return Workload(name, ALL_MESHES, fn)

    return [
        w("SoftMoE fwd B8 T512 d512 E8 S32 f1024", partial(build_soft_moe, 8, 512, 512, 8, 32, 1024, False)),
        w("SoftMoE train B8 T256 d512 E8 S32 f1024", partial(build_soft_moe, 8, 256, 512, 8, 32, 1024, True)),
        w("GroupedMoE fwd E8 C512 d1024 f2048", partial(build_grouped_moe, 8, 512, 1024, 2048)),
        w("ConvNet train N64 32x32 ch16-64-128", partial(build_conv, 64, 32, 16, 64, 128, 10)),
        w("TiedEmb train V32768 d512 f2048 L2 b8 s256", partial(build_emb, 32768, 512, 2048, 2, 8, 256)),
    ]
