"""Mid-sized programs on a mesh of four axes: every layout against each narrowing (issue 13).

    .venv/bin/python benchmarks/priors_mid.py              # every program (~4 min on 2 cores)
    .venv/bin/python benchmarks/priors_mid.py --only moe

On 2x2x2x2 a rank-4 value has up to 1,273 layouts, and the whole e-graph grows with their
square: programs far under the (value, layout) pair budget of `policy.NARROW_PAIRS` plan slowly
whole. Per program: its pairs, then the predicted step (us) and planning seconds of
`priors=None` (every layout), `"families"`, `"builtin"` (the learned prior) and `"auto"` (the
default: the learned prior from `policy.NARROW_PAIRS_MANY_AXES` pairs on meshes of four axes).
Arguments are ShapeDtypeStructs; nothing is compiled or run. 16 simulated CPU devices.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()

import argparse
import datetime
import platform
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import shardsat
from shardsat.egraph.layout import MeshAxes, SpaceTable
from shardsat.prepare import prepare

S = jax.ShapeDtypeStruct
F32 = jnp.float32
PRIORS = (None, "families", "builtin", "auto")


def attention() -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    q = S((16, 8, 4, 8), F32)
    return (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)), (q, q, q), None


def block_grad() -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    """One pre-norm transformer block (d 32, 4 heads), its weights' gradient."""
    def block(p: Any, x: Any) -> Any:
        b, s, d = x.shape
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)
        q, k, v = ((h @ p[n]).reshape(b, s, 4, d // 4) for n in ("wq", "wk", "wv"))
        x = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d) @ p["wo"]
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

    d = 32
    shapes = dict(wq=(d, d), wk=(d, d), wv=(d, d), wo=(d, d), w1=(d, 4 * d), w2=(4 * d, d))
    p = {n: S(s, F32) for n, s in shapes.items()}
    return (lambda p, x: jax.grad(lambda p: block(p, x).sum())(p)), (p, S((16, 8, d), F32)), None


def moe_grad() -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    """A soft mixture of 4 experts (every token through every expert, gated), its gradient."""
    def moe(p: Any, x: Any) -> Any:
        gates = jax.nn.softmax(jnp.einsum("btd,de->bte", x, p["router"]), -1)
        h = jax.nn.relu(jnp.einsum("btd,edf->btef", x, p["w1"]))
        y = jnp.einsum("btef,efd->bted", h, p["w2"])
        return jnp.mean(jnp.einsum("bted,bte->btd", y, gates) ** 2)

    p = {"router": S((32, 4), F32), "w1": S((4, 32, 64), F32), "w2": S((4, 64, 32), F32)}
    return (lambda p, x: jax.grad(moe)(p, x)), (p, S((8, 16, 32), F32)), None


def mlp_adam() -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    """A 6-layer GELU MLP's Adam step, the state carried."""
    adam = optax.adam(1e-3)
    ws = [S((64, 256), F32), S((256, 64), F32)] * 3

    def step(state: Any, x: Any) -> Any:
        ws, st = state

        def loss(ws: Any) -> Any:
            h = x
            for w in ws:
                h = jax.nn.gelu(h @ w)
            return jnp.mean(h ** 2)

        u, st = adam.update(jax.grad(loss)(ws), st, ws)
        return optax.apply_updates(ws, u), st

    return step, ((ws, jax.eval_shape(adam.init, ws)), S((128, 64), F32)), (0,)


def conv_grad() -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    """Two 3x3 convolutions (NHWC), their weights' gradient."""
    def conv(p: Any, x: Any) -> Any:
        for w in p:
            x = jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                         dimension_numbers=("NHWC", "HWIO", "NHWC")))
        return jnp.mean(x ** 2)

    p = [S((3, 3, 8, 16), F32), S((3, 3, 16, 16), F32)]
    return (lambda p, x: jax.grad(conv)(p, x)), (p, S((16, 16, 16, 8), F32)), None


PROGRAMS = {"attention": attention, "block": block_grad, "moe": moe_grad, "mlp_adam": mlp_adam,
            "conv": conv_grad}


def pairs(fn: Callable[..., Any], mesh: Mesh, args: tuple[Any, ...]) -> int:
    prog = prepare(fn, mesh, args, (), None).program
    spaces = SpaceTable(MeshAxes.from_mesh(mesh))
    return sum(len(spaces.space(v.shape, v.dtype).layouts) for vid, v in enumerate(prog.values)
               if vid not in prog.aliases)


def cell(fn: Callable[..., Any], mesh: Mesh, args: tuple[Any, ...], state: Any, priors: str | None) -> str:
    t = time.perf_counter()
    try:
        plan = shardsat.saturate_and_extract(fn, mesh, *args, priors=priors, state_argnums=state)
    except Exception as e:  # a failing plan is a table entry
        return f"ERR {type(e).__name__}"
    return f"{plan.cost.total_s * 1e6:,.2f} us, {time.perf_counter() - t:.1f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(PROGRAMS), help="one program")
    ns = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    mesh = Mesh(np.array(jax.devices()[:16]).reshape(2, 2, 2, 2), ("a", "b", "c", "d"))
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, jax {jax.__version__}, "
          f"shardsat {shardsat.__version__}, mesh 2x2x2x2\n")
    print("| program | pairs | whole (None) | families | learned (builtin) | auto |")
    print("|---|---:|---|---|---|---|")
    for name, build in PROGRAMS.items():
        if ns.only not in (None, name):
            continue
        fn, args, state = build()
        cells = " | ".join(cell(fn, mesh, args, state, pr) for pr in PRIORS)
        print(f"| {name} | {pairs(fn, mesh, args) / 1e3:.0f}k | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
