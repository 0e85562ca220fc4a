"""Predicted vs compiled memory on realistic programs outside the expert benchmark: a cumulative
sum, remat, lax.scan over layers (with and without jax.checkpoint), a GNN step, attention, LSTMs,
a conv net, an embedding's scatter-add, top-k and sort, a while loop, layer norm + GELU with
AdamW, a cond, a vocabulary-sized cross-entropy; and loops as training code writes them:
gradient accumulation over microbatches, several SGD steps in a fori_loop, nested scans, a cond
inside a scan, a scanned transformer with AdamW, a checkpoint policy, a power iteration; conds as
code writes them (a switch returning its operand, two results, skipping a non-finite step,
clipping); dropout (an MLP, with an rbg key too, and two transformer blocks with three dropout
sites each); bfloat16 products, cast from float32 weights and on bfloat16 weights; an int8
product; and the programs of benchmarks/probe_models.py (normalisations, optimizers, model shapes). Each is planned
free (no pins) on each mesh and compiled on 8 simulated CPU devices, measured and tabled as benchmarks/memory.py does
(predicted / compiled per-device total: arguments + outputs not aliased + temps).

    .venv/bin/python benchmarks/memory_probe.py                        # every program, 2x4 2x2x2 1x8
    .venv/bin/python benchmarks/memory_probe.py --meshes 2,4 --only gnn  # a subset

Why: the estimate is calibrated on the expert benchmark's workloads; these are the shapes of
programs it was not calibrated on, the way unseen workloads will find its errors. A row outside
[0.95, 1.10] is marked; exit status 0 either way (a benchmark, not a test).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory  # benchmarks/memory.py: the same measurement and table
import probe_models  # more programs: normalisations, optimizers, model shapes

S = jax.ShapeDtypeStruct
F32 = jnp.float32
PROGRAMS: dict[str, Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]] = {}


def program(f: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]) -> Callable[[], Any]:
    PROGRAMS[f.__name__] = f
    return f


def _sgd(loss: Callable[..., Any], lr: float = 0.01) -> Callable[..., Any]:
    def step(p: Any, *xs: Any) -> Any:
        return jax.tree.map(lambda a, b: a - lr * b, p, jax.grad(loss)(p, *xs))
    return step


def _adam(loss: Callable[..., Any], opt: optax.GradientTransformation) -> Callable[..., Any]:
    def step(p: Any, st: Any, x: Any) -> Any:
        u, st = opt.update(jax.grad(loss)(p, x), st, p)
        return optax.apply_updates(p, u), st
    return step


@program
def cumsum_fwd():
    return (lambda x: jnp.cumsum(x, 1) * 2), (S((16, 2048, 256), F32),)


@program
def remat_mlp_train():
    def loss(ps, x):
        for p in ps:
            x = jax.checkpoint(lambda x, p: x + jax.nn.gelu(x @ p["w1"]) @ p["w2"])(x, p)
        return jnp.mean(x ** 2)
    ps = [{"w1": S((512, 2048), F32), "w2": S((2048, 512), F32)} for _ in range(4)]
    return _sgd(loss), (ps, S((64, 256, 512), F32))


def _scan_loss(remat: bool) -> Callable[..., Any]:
    def body(x, p):
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"], None

    def loss(ps, x):
        x, _ = lax.scan(jax.checkpoint(body) if remat else body, x, ps)
        return jnp.mean(x ** 2)
    return loss


@program
def scan_layers_train():
    ps = {"w1": S((6, 512, 2048), F32), "w2": S((6, 2048, 512), F32)}
    opt = optax.adam(1e-3)
    return _adam(_scan_loss(False), opt), (ps, jax.eval_shape(opt.init, ps), S((32, 128, 512), F32))


@program
def scan_remat_train():
    ps = {"w1": S((6, 512, 2048), F32), "w2": S((6, 2048, 512), F32)}
    return _sgd(_scan_loss(True)), (ps, S((32, 128, 512), F32))


@program
def gnn_step():
    n, e, d = 16384, 131072, 128

    def loss(w, h, src, dst):
        for i in range(2):
            h = jax.nn.relu(jax.ops.segment_sum(jnp.take(h, src, axis=0) @ w[i], dst, num_segments=n)) + h
        return jnp.mean(h ** 2)
    return _sgd(loss), (S((2, d, d), F32), S((n, d), F32), S((e,), jnp.int32), S((e,), jnp.int32))


@program
def attention_fwd():
    def f(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 8.0
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)
    a = S((8, 8, 512, 64), F32)
    return f, (a, a, a)


def _lstm(w, u, xs):
    def cell(c, x):
        h, cc = c
        i, fg, o, g = jnp.split(x @ w + h @ u, 4, -1)
        cc = jax.nn.sigmoid(fg) * cc + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(cc)
        return (h, cc), h
    b, hid = xs.shape[1], u.shape[0]
    return lax.scan(cell, (jnp.zeros((b, hid)), jnp.zeros((b, hid))), xs)[1]


@program
def lstm_fwd():
    return _lstm, (S((256, 1024), F32), S((256, 1024), F32), S((64, 128, 256), F32))


@program
def lstm_train():
    return _sgd(lambda wu, xs: jnp.mean(_lstm(*wu, xs) ** 2), 0.1), (
        (S((256, 1024), F32), S((256, 1024), F32)), S((64, 128, 256), F32))


@program
def conv_fwd():
    def f(w1, w2, x):
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dn))
        return jnp.mean(lax.conv_general_dilated(y, w2, (2, 2), "SAME", dimension_numbers=dn), (1, 2))
    return f, (S((3, 3, 32, 64), F32), S((3, 3, 64, 64), F32), S((64, 64, 64, 32), F32))


@program
def embed_scatter_train():
    return _sgd(lambda p, tok: jnp.mean((p[0][tok] @ p[1]) ** 2), 0.1), (
        (S((50000, 256), F32), S((256, 256), F32)), S((64, 512), jnp.int32))


@program
def topk_sort():
    def f(x):
        v, i = lax.top_k(x, 16)
        return jnp.sort(x, -1)[:, :128] + v.sum(-1, keepdims=True), i
    return f, (S((4096, 4096), F32),)


@program
def while_matmul():
    def f(w, x):
        return lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]
    return f, (S((1024, 1024), F32), S((2048, 1024), F32))


@program
def layernorm_gelu_train():
    def loss(p, x):
        mu = x.mean(-1, keepdims=True)
        x = (x - mu) * lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * p["g"]
        return jnp.mean(jax.nn.gelu(x @ p["w"]) ** 2)
    opt = optax.adamw(1e-3)
    p = {"g": S((1024,), F32), "w": S((1024, 4096), F32)}
    return _adam(loss, opt), (p, jax.eval_shape(opt.init, p), S((32, 256, 1024), F32))


@program
def cond_branches():
    def f(w, x, flag):
        return lax.cond(flag > 0, lambda x: jnp.tanh(x @ w), lambda x: (x @ w.T) * 2, x)
    return f, (S((1024, 1024), F32), S((4096, 1024), F32), S((), jnp.int32))


@program
def softmax_xent_vocab():
    def loss(w, h, y):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h @ w), y[:, None], 1))
    return _sgd(lambda w, h, y: loss(w, h, y), 0.1), (S((512, 32768), F32), S((2048, 512), F32),
                                                      S((2048,), jnp.int32))


def _mlp(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


@program
def grad_accum_adam():
    opt = optax.adam(1e-3)

    def step(p, st, xs):
        def micro(g, x):
            gi = jax.grad(lambda p: jnp.mean(_mlp(p, x) ** 2))(p)
            return jax.tree.map(jnp.add, g, gi), None
        g, _ = lax.scan(micro, jax.tree.map(jnp.zeros_like, p), xs)
        u, st = opt.update(g, st, p)
        return optax.apply_updates(p, u), st
    ps = {"w1": S((1024, 4096), F32), "w2": S((4096, 1024), F32)}
    return step, (ps, jax.eval_shape(opt.init, ps), S((4, 256, 1024), F32))


@program
def fori_sgd_steps():
    def run(p, x):
        def one(i, p):
            g = jax.grad(lambda p: jnp.mean(_mlp(p, x) ** 2))(p)
            return jax.tree.map(lambda a, b: a - 0.01 * b, p, g)
        return lax.fori_loop(0, 3, one, p)
    return run, ({"w1": S((1024, 2048), F32), "w2": S((2048, 1024), F32)}, S((512, 1024), F32))


@program
def inner_sgd_then_eval():
    """A few SGD steps of a four-layer MLP in a fori_loop, then the adapted weights' loss on
    other data (a meta-learning inner loop): the loop's state is not an output."""
    def deep(p, x):
        for w in p[:-1]:
            x = jnp.tanh(x @ w)
        return x @ p[-1]

    def run(p, x, y):
        def one(i, p):
            g = jax.grad(lambda p: jnp.mean(deep(p, x) ** 2))(p)
            return jax.tree.map(lambda a, b: a - 0.01 * b, p, g)
        return jnp.mean(deep(lax.fori_loop(0, 3, one, p), y) ** 2)
    return run, ([S((1024, 1024), F32)] * 4, S((512, 1024), F32), S((512, 1024), F32))


@program
def nested_scan_rnn():
    def loss(ws, xs):
        def layer(h, w):
            def cell(c, x):
                c = jnp.tanh(c @ w + x)
                return c, c
            return lax.scan(cell, jnp.zeros((xs.shape[1], w.shape[0])), h)[1], None
        return jnp.mean(lax.scan(layer, xs, ws)[0] ** 2)
    return _sgd(loss), (S((3, 512, 512), F32), S((16, 64, 512), F32))


@program
def cond_in_scan():
    def loss(ws, x):
        def body(h, wi):
            w, i = wi
            return lax.cond(i % 2 == 0, lambda h: jnp.tanh(h @ w), lambda h: jax.nn.relu(h @ w), h), None
        return jnp.mean(lax.scan(body, x, (ws, jnp.arange(ws.shape[0])))[0] ** 2)
    return _sgd(loss), (S((4, 1024, 1024), F32), S((512, 1024), F32))


@program
def scan_transformer_adam():
    d, h, f, n = 256, 4, 1024, 4

    def block(x, p):
        q, k, v = (jnp.einsum("bsd,dhk->bhsk", x, p[w]) for w in ("wq", "wk", "wv"))
        a = jax.nn.softmax(jnp.einsum("bhsk,bhtk->bhst", q, k) / 8.0, axis=-1)
        x = x + jnp.einsum("bshk,hkd->bsd", jnp.einsum("bhst,bhtk->bshk", a, v), p["wo"])
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"], None

    def loss(ps, x):
        return jnp.mean(lax.scan(block, x, ps)[0] ** 2)
    opt = optax.adamw(1e-3)
    ps = {"wq": S((n, d, h, d // h), F32), "wk": S((n, d, h, d // h), F32), "wv": S((n, d, h, d // h), F32),
          "wo": S((n, h, d // h, d), F32), "w1": S((n, d, f), F32), "w2": S((n, f, d), F32)}
    return _adam(loss, opt), (ps, jax.eval_shape(opt.init, ps), S((16, 128, d), F32))


@program
def scan_policy_remat():
    def body(x, p):
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"], None

    def loss(ps, x):
        pol = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return jnp.mean(lax.scan(jax.checkpoint(body, policy=pol), x, ps)[0] ** 2)
    return _sgd(loss), ({"w1": S((6, 512, 2048), F32), "w2": S((6, 2048, 512), F32)}, S((32, 128, 512), F32))


@program
def while_power_iter():
    def f(a, v):
        def body(c):
            v = a @ c[0]
            return v / jnp.linalg.norm(v), c[1] + 1
        v, _ = lax.while_loop(lambda c: c[1] < 20, body, (v, 0))
        return v, a @ v
    return f, (S((4096, 4096), F32), S((4096, 64), F32))


@program
def dropout_mlp_train():
    def loss(p, x, key):
        h = jax.nn.relu(x @ p["w1"])
        return jnp.mean((jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0) @ p["w2"]) ** 2)
    return _sgd(loss), ({"w1": S((1024, 4096), F32), "w2": S((4096, 1024), F32)}, S((1024, 1024), F32),
                        S((2,), jnp.uint32))


@program
def dropout_mlp_rbg():
    """dropout_mlp_train with an rbg key (XLA's RngBitGenerator draws the bits)."""
    step, args = PROGRAMS["dropout_mlp_train"]()
    return (lambda p, x, raw: step(p, x, jax.random.wrap_key_data(raw, impl="rbg"))), (*args[:2], S((4,), jnp.uint32))


@program
def dropout_transformer_adam():
    """Two transformer blocks with dropout on the attention probabilities and both residual
    branches (keys folded per layer and site), AdamW: the draws are most of the activations."""
    d, h, f, n, rate = 256, 4, 1024, 2, 0.1

    def drop(key, x):
        return jnp.where(jax.random.bernoulli(key, 1.0 - rate, x.shape), x / (1.0 - rate), 0.0)

    def block(x, p, key):
        q, k, v = (jnp.einsum("bsd,dhk->bhsk", x, p[w]) for w in ("wq", "wk", "wv"))
        a = drop(jax.random.fold_in(key, 0), jax.nn.softmax(jnp.einsum("bhsk,bhtk->bhst", q, k) / 8.0, axis=-1))
        x = x + drop(jax.random.fold_in(key, 1), jnp.einsum("bshk,hkd->bsd", jnp.einsum("bhst,bhtk->bshk", a, v), p["wo"]))
        return x + drop(jax.random.fold_in(key, 2), jax.nn.gelu(x @ p["w1"]) @ p["w2"])

    def loss(ps, x, key):
        for i, p in enumerate(ps):
            x = block(x, p, jax.random.fold_in(key, i))
        return jnp.mean(x ** 2)

    def step(ps, st, x, key):
        u, st = opt.update(jax.grad(loss)(ps, x, key), st, ps)
        return optax.apply_updates(ps, u), st
    opt = optax.adamw(1e-3)
    ps = [{"wq": S((d, h, d // h), F32), "wk": S((d, h, d // h), F32), "wv": S((d, h, d // h), F32),
           "wo": S((h, d // h, d), F32), "w1": S((d, f), F32), "w2": S((f, d), F32)} for _ in range(n)]
    return step, (ps, jax.eval_shape(opt.init, ps), S((16, 128, d), F32), S((2,), jnp.uint32))


@program
def bf16_mlp_adam():
    def loss(p, x):
        h = jax.nn.gelu(x.astype(jnp.bfloat16) @ p["w1"].astype(jnp.bfloat16))
        return jnp.mean((h @ p["w2"].astype(jnp.bfloat16)).astype(F32) ** 2)
    ps = {"w1": S((1024, 4096), F32), "w2": S((4096, 1024), F32)}
    opt = optax.adam(1e-3)
    return _adam(loss, opt), (ps, jax.eval_shape(opt.init, ps), S((2048, 1024), F32))


@program
def bf16_params_sgd():
    def loss(p, x):
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]).astype(F32) ** 2)
    bf = jnp.bfloat16
    return _sgd(loss), ({"w1": S((1024, 4096), bf), "w2": S((4096, 1024), bf)}, S((2048, 1024), bf))


@program
def int8_matmul():
    def f(wq, scale, x):
        xq = jnp.clip(jnp.round(x * 16), -127, 127).astype(jnp.int8)
        y = lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return jax.nn.relu(y.astype(F32) * scale / 16)
    return f, (S((2048, 4096), jnp.int8), S((4096,), F32), S((1024, 2048), F32))


@program
def switch_passthrough():
    def f(w, x, i):
        return lax.switch(i, [lambda x: jnp.tanh(x @ w), lambda x: (x @ w.T) * 2, lambda x: x], x)
    return f, (S((1024, 1024), F32), S((4096, 1024), F32), S((), jnp.int32))


@program
def cond_two_results():
    def f(w, x, flag):
        return lax.cond(flag > 0, lambda x: (x @ w, jnp.sum(x, 0)), lambda x: (x @ w.T + 1, jnp.max(x, 0)), x)
    return f, (S((1024, 1024), F32), S((4096, 1024), F32), S((), jnp.int32))


@program
def skip_nonfinite_step():
    def step(p, x):
        g = jax.grad(lambda p: jnp.mean(_mlp(p, x)))(p)
        ok = jnp.all(jnp.isfinite(g["w1"]))
        return lax.cond(ok, lambda: jax.tree.map(lambda a, b: a - 0.1 * b, p, g), lambda: p)
    return step, ({"w1": S((1024, 4096), F32), "w2": S((4096, 1024), F32)}, S((512, 1024), F32))


@program
def clip_by_cond():
    def step(p, x):
        g = jax.grad(lambda p: jnp.mean(_mlp(p, x) ** 2))(p)
        n = optax.global_norm(g)
        g = lax.cond(n > 1.0, lambda g: jax.tree.map(lambda a: a / n, g), lambda g: g, g)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, ({"w1": S((1024, 4096), F32), "w2": S((4096, 1024), F32)}, S((512, 1024), F32))


PROGRAMS.update(probe_models.PROGRAMS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meshes", nargs="+", default=["2,4", "2,2,2", "1,8"], help="mesh shapes, e.g. 2,4")
    ap.add_argument("--only", help="programs whose name contains this")
    ap.add_argument("--profile", default=None, help="device profile preset (default: the platform's)")
    ns = ap.parse_args(argv)
    print(memory.TABLE_HEADER)
    for text in ns.meshes:
        shape = tuple(int(s) for s in text.split(","))
        mesh = jax.make_mesh(shape, ("data", "model") if len(shape) == 2 else ("data", "fsdp", "model")[-len(shape):])
        for name, build in PROGRAMS.items():
            if ns.only is None or ns.only in name:
                fn, args = build()
                case = memory.Case(name, shape, "shardsat", fn, args, None, None, mesh)
                print(memory.measure(case, ns.profile).markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
