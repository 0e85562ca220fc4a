"""MLP chains (`x = relu(x @ W_i)`, weights alternating d x h and h x d), forward alone and as an
AdamW training step on a squared-error loss.

Experts (argument layouts pinned through `in_shardings`, intermediates left to the extractor):
- DP: weights replicated, batch split over every axis;
- Megatron: weights column-/row-split over the tensor-parallel axis, batch over the others;
- FSDP: each weight split over every axis on its largest dimension, batch over every axis;
- FSDP+TP (meshes with "model"): Megatron over "model" plus the other axes on the free dimension;
- DP+FSDP+TP (meshes with "fsdp"): Megatron over "model", "fsdp" on the free dimension, the batch
  over every axis but "model";
- DP+WUS (training): weights replicated, optimizer state laid out as FSDP (weight-update sharding).
In training the optimizer state mirrors the weights' layout unless stated otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from common import ALL_MESHES, Problem, S, Workload, adamw_step, axes_of, fsdp_spec, opt_specs, replicated
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

SIZES = ((1024, 4096, 4, 2048), (512, 512, 6, 4096))  # (d, h, layers, batch)


def weights(d: int, h: int, layers: int) -> list[jax.ShapeDtypeStruct]:
    return [S(d, h) if i % 2 == 0 else S(h, d) for i in range(layers)]


def forward(params: list[jax.Array], x: jax.Array) -> jax.Array:
    for w in params:
        x = jax.nn.relu(x @ w)
    return x


def mse(params: list[jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)


def experts(mesh: Mesh, params: list[Any], opt_state: Any | None) -> dict[str, Any]:
    """in_shardings per expert; `opt_state` None: forward only, (params, x)."""
    ax = axes_of(mesh)
    batch_all = P(ax.all)
    batch_dp = P(ax.dp) if ax.dp else P()

    def pack(pspecs: Any, ospecs: Any, xspec: P) -> Any:
        if opt_state is None:
            return (pspecs, xspec)
        return ((pspecs, opt_specs(opt_state, ospecs)), {"x": xspec, "y": xspec})

    rep = replicated(params)
    megatron = [P(None, ax.tp) if i % 2 == 0 else P(ax.tp, None) for i in range(len(params))]
    fsdp = [fsdp_spec(w, ax.all, mesh.size) for w in params]
    out = {
        "DP": pack(rep, rep, batch_all),
        "Megatron": pack(megatron, megatron, batch_dp),
        "FSDP": pack(fsdp, fsdp, batch_all),
    }
    if ax.dp:
        fsdp_tp = [P(ax.dp, "model") if i % 2 == 0 else P("model", ax.dp) for i in range(len(params))]
        out["FSDP+TP"] = pack(fsdp_tp, fsdp_tp, batch_dp)
    if "fsdp" in mesh.shape:
        dp_fsdp_tp = [P("fsdp", "model") if i % 2 == 0 else P("model", "fsdp") for i in range(len(params))]
        out["DP+FSDP+TP"] = pack(dp_fsdp_tp, dp_fsdp_tp, batch_dp)
    if opt_state is not None:
        out["DP+WUS"] = pack(rep, fsdp, batch_all)
    return out


def build(d: int, h: int, layers: int, batch: int, train: bool, mesh: Mesh) -> Problem:
    params = weights(d, h, layers)
    x = S(batch, d)
    if not train:
        return Problem(forward, (params, x), experts(mesh, params, None))
    opt, step = adamw_step(mse)
    opt_state = jax.eval_shape(opt.init, params)
    y = S(batch, d if layers % 2 == 0 else h)
    return Problem(step, ((params, opt_state), {"x": x, "y": y}), experts(mesh, params, opt_state),
                   state_argnums=(0,))


def workloads() -> list[Workload]:
    out = []
    for d, h, layers, batch in SIZES:
        for train in (False, True):
            name = f"MLP{layers} {'train' if train else 'fwd'} d{d} h{h} b{batch}"
            fn: Callable[[Mesh], Problem] = partial(build, d, h, layers, batch, train)
            out.append(Workload(name, ALL_MESHES, fn))
    return out
