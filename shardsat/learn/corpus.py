"""A deterministic corpus of small, realistic JAX programs: the full search plans them to label a prior.

Each `Case` is a training step, ``step((params, opt_state), batch) -> ((params, opt_state), loss)``, or a
forward pass, given by abstract arguments only. Sizes are random but fixed by (family, seed); every dimension
is a power of two or a multiple of 8 (so it divides mesh axes of size 2 and 4), and programs stay small (at
most 400 equations, tensors of at most 4 MB) so that planning one takes seconds. Only numpy and jax are
imported: the optimizers are written here, not taken from optax, so the corpus (and hence the labels) cannot
change when an optional dependency does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Batch = dict[str, jax.Array]
LossFn = Callable[[PyTree, Batch], jax.Array]
T = TypeVar("T")

FAMILIES: tuple[str, ...] = ("mlp", "gpt", "llama", "moe", "conv", "gnn", "tied", "mixer")

_ELEMENTS = 2**20  # largest activation, in float32 elements (4 MB)
_COUNT_BOUND = 1000  # example optimizer step counters are drawn below this


@dataclass(frozen=True)
class Case:
    """One corpus program, `fn(*args)`, with `args` pytrees of `jax.ShapeDtypeStruct` only.

    `int_bounds` gives, for every integer leaf of `args`, the exclusive upper bound of its valid values
    (token ids below the vocabulary, node ids below the node count, ...), keyed by `jax.tree_util.keystr` of
    the leaf's path in `args`, e.g. ``("[1]['tokens']", 512)``; `example_inputs` draws indices from it.
    """

    name: str
    family: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    state_argnums: tuple[int, ...] | None
    int_bounds: tuple[tuple[str, int], ...] = ()


# ----------------------------------------------------------------------------------------------- shapes


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _dense_spec(n_in: int, n_out: int, bias: bool = True) -> dict[str, jax.ShapeDtypeStruct]:
    return {"w": _f32(n_in, n_out), "b": _f32(n_out)} if bias else {"w": _f32(n_in, n_out)}


def _ln_spec(d: int, bias: bool = True) -> dict[str, jax.ShapeDtypeStruct]:
    return {"scale": _f32(d), "bias": _f32(d)} if bias else {"scale": _f32(d)}


def _pick(rng: np.random.Generator, options: Sequence[T]) -> T:
    """One of `options`, drawn from `rng` (plain Python values, unlike `rng.choice`)."""
    return options[int(rng.integers(len(options)))]


def _fit(batch: int, per_example: int) -> int:
    """Halve the batch until the largest activation fits in `_ELEMENTS`, so planning stays fast."""
    while batch > 4 and batch * per_example > _ELEMENTS:
        batch //= 2
    return batch


# ----------------------------------------------------------------------------------------------- layers


def _dense(x: jax.Array, p: Mapping[str, jax.Array]) -> jax.Array:
    return x @ p["w"] + p["b"] if "b" in p else x @ p["w"]


def _act(name: str) -> Callable[[jax.Array], jax.Array]:
    return jax.nn.relu if name == "relu" else jax.nn.gelu


def _layer_norm(x: jax.Array, p: Mapping[str, jax.Array], eps: float = 1e-5) -> jax.Array:
    xc = x - x.mean(-1, keepdims=True)
    y = xc * jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + eps) * p["scale"]
    return y + p["bias"] if "bias" in p else y


def _rms_norm(x: jax.Array, p: Mapping[str, jax.Array], eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps) * p["scale"]


def _mse(pred: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(pred - target))


def _softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax, written out: `jax.nn.softmax` adds a dozen equations to its gradient."""
    e = jnp.exp(x - jax.lax.stop_gradient(x).max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy against int targets, via a one-hot product as many codebases do."""
    z = logits - jax.lax.stop_gradient(logits).max(-1, keepdims=True)
    logp = z - jnp.log(jnp.exp(z).sum(-1, keepdims=True))
    return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, logits.shape[-1]) * logp, axis=-1))


def _ffn(x: jax.Array, p: Mapping[str, Any]) -> jax.Array:
    """A transformer MLP: GELU, or SwiGLU (three matrices, no biases) when `w_gate` is present."""
    if "w_gate" in p:
        return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
    return _dense(jax.nn.gelu(_dense(x, p["fc1"]), approximate=False), p["fc2"])


def _rope_tables(seq: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """Rotary-embedding sin and cos, (1, seq, 1, head_dim), computed once per step and shared by layers."""
    half = head_dim // 2
    freq = 1.0 / 10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq
    angle = jnp.concatenate([angle, angle], axis=-1)[None, :, None, :]
    return jnp.sin(angle), jnp.cos(angle)


def _rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotary position embedding of (b, s, heads, head_dim), written as Hugging Face's Llama (rotate_half)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _attention(x: jax.Array, p: Mapping[str, jax.Array], rope: tuple[jax.Array, jax.Array] | None
               ) -> jax.Array:
    """Causal multi-head self-attention, einsum-based, with per-head weights (d, heads, head_dim): separate
    for q, k and v (Llama), or fused as one (d, 3, heads, head_dim) `wqkv` (GPT-2's c_attn)."""
    if "wqkv" in p:
        q, k, v = (t[:, :, 0] for t in jnp.split(jnp.einsum("bsd,dthk->bsthk", x, p["wqkv"]), 3, axis=2))
    else:
        q, k, v = (jnp.einsum("bsd,dhk->bshk", x, p[w]) for w in ("wq", "wk", "wv"))
    if rope is not None:
        q, k = _rope(q, *rope), _rope(k, *rope)
    seq = x.shape[1]
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
    mask = jnp.where(jnp.tril(jnp.ones((seq, seq), dtype=bool)), 0.0, -1e9)  # additive causal mask
    out = jnp.einsum("bhqs,bshk->bqhk", _softmax(scores + mask), v)
    return jnp.einsum("bqhk,hkd->bqd", out, p["wo"])


# ----------------------------------------------------------------------------------------------- optimizers


def _adamw(
    params: PyTree, grads: PyTree, state: PyTree, lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8, wd: float = 0.01,
) -> tuple[PyTree, PyTree]:
    """AdamW; both bias corrections are folded into one scalar step size, and only matrices are decayed
    (not biases and norm scales), as in nanoGPT."""
    count = state["count"] + 1
    t = count.astype(jnp.float32)
    step = lr * jnp.sqrt(1.0 - b2**t) / (1.0 - b1**t)
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state["nu"], grads)

    def apply(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
        return (p * (1.0 - lr * wd) if p.ndim > 1 else p) - step * m / (jnp.sqrt(v) + eps)

    new = jax.tree.map(apply, params, mu, nu)
    return new, {"count": count, "mu": mu, "nu": nu}


def _momentum(
    params: PyTree, grads: PyTree, state: PyTree, lr: float = 1e-2, beta: float = 0.9
) -> tuple[PyTree, PyTree]:
    """SGD with heavy-ball momentum."""
    mu = jax.tree.map(lambda m, g: beta * m + g, state["mu"], grads)
    new = jax.tree.map(lambda p, m: p - lr * m, params, mu)
    return new, {"count": state["count"] + 1, "mu": mu}


# name -> (update, names of the per-parameter moments in its state)
_OPTIMIZERS: dict[str, tuple[Callable[..., tuple[PyTree, PyTree]], tuple[str, ...]]] = {
    "adamw": (_adamw, ("mu", "nu")),
    "momentum": (_momentum, ("mu",)),
}


def _train_step(loss_fn: LossFn, opt: str) -> Callable[[PyTree, Batch], tuple[PyTree, jax.Array]]:
    """`step((params, opt_state), batch)`: the loop-carried state comes first, as in real training loops."""
    update = _OPTIMIZERS[opt][0]

    def step(state: PyTree, batch: Batch) -> tuple[PyTree, jax.Array]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return update(params, grads, opt_state), loss

    return step


def _int_bounds(args: tuple[Any, ...], bounds: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """Bounds of the integer leaves of `args`, looked up by each leaf's last dict key."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            out.append((jax.tree_util.keystr(path), bounds[path[-1].key]))
    return tuple(out)


def _training(
    name: str, family: str, seed: int, loss_fn: LossFn, params: PyTree, batch: PyTree, opt: str,
    bounds: Mapping[str, int] | None = None,
) -> Case:
    """A training-step Case; the optimizer state mirrors `params` once per moment, plus a step counter."""
    opt_state = {"count": _i32(), **{m: params for m in _OPTIMIZERS[opt][1]}}
    args = ((params, opt_state), batch)
    int_bounds = _int_bounds(args, {**(bounds or {}), "count": _COUNT_BOUND})
    return Case(f"{name} {opt} @{seed}", family, _train_step(loss_fn, opt), args, (0,), int_bounds)


# ----------------------------------------------------------------------------------------------- families


def _mlp(seed: int) -> Case:
    """A chain of dense layers with MSE loss; one in four is a forward pass only."""
    rng = np.random.default_rng(seed)
    depth = int(rng.integers(1, 5))
    widths = [_pick(rng, (64, 128, 256, 512, 1024)) for _ in range(depth + 1)]
    batch, act = _pick(rng, (16, 32, 64, 128, 256)), _pick(rng, ("relu", "gelu"))
    forward_only, opt = bool(rng.integers(4) == 0), _pick(rng, ("adamw", "momentum"))
    params = [_dense_spec(a, b) for a, b in itertools.pairwise(widths)]

    def forward(params: PyTree, x: jax.Array) -> jax.Array:
        for i, p in enumerate(params):
            x = _dense(x, p)
            x = _act(act)(x) if i < len(params) - 1 else x
        return x

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        return _mse(forward(params, batch["x"]), batch["y"])

    name = f"mlp w{'-'.join(map(str, widths))} b{batch} {act}"
    x = _f32(batch, widths[0])
    if forward_only:
        return Case(f"{name} fwd @{seed}", "mlp", forward, (params, x), None)
    return _training(name, "mlp", seed, loss_fn, params, {"x": x, "y": _f32(batch, widths[-1])}, opt)


def _transformer_params(llama: bool, layers: int, d: int, heads: int, ff: int, vocab: int, seq: int
                        ) -> PyTree:
    """Bias-free, as nanoGPT (bias=False) and Llama are. GPT: fused qkv (GPT-2's c_attn), GELU MLP, learned
    positions. Llama: separate q, k, v and a SwiGLU MLP (positions are rotary)."""
    hd = d // heads

    def layer() -> PyTree:
        if llama:
            attn = {"wq": _f32(d, heads, hd), "wk": _f32(d, heads, hd), "wv": _f32(d, heads, hd)}
            mlp = {"w_gate": _f32(d, ff), "w_up": _f32(d, ff), "w_down": _f32(ff, d)}
        else:
            attn = {"wqkv": _f32(d, 3, heads, hd)}
            mlp = {"fc1": _dense_spec(d, ff, bias=False), "fc2": _dense_spec(ff, d, bias=False)}
        attn["wo"] = _f32(heads, hd, d)
        return {"norm1": _ln_spec(d, bias=False), "attn": attn, "norm2": _ln_spec(d, bias=False), "mlp": mlp}

    params = {"embed": _f32(vocab, d), "layers": [layer() for _ in range(layers)]}
    params["norm_f"], params["unembed"] = _ln_spec(d, bias=False), _f32(d, vocab)
    if not llama:
        params["pos"] = _f32(seq, d)
    return params


def _transformer_loss(params: PyTree, batch: Batch, llama: bool, onehot: bool) -> jax.Array:
    """Pre-norm decoder-only LM: embed, residual attention and MLP, final norm, unembed, cross-entropy."""
    tokens, table = batch["tokens"], params["embed"]
    h = jax.nn.one_hot(tokens, table.shape[0]) @ table if onehot else table[tokens]
    h = h if llama else h + params["pos"]
    norm = _rms_norm if llama else _layer_norm
    rope = _rope_tables(tokens.shape[1], params["layers"][0]["attn"]["wo"].shape[1]) if llama else None
    for layer in params["layers"]:
        h = h + _attention(norm(h, layer["norm1"]), layer["attn"], rope)
        h = h + _ffn(norm(h, layer["norm2"]), layer["mlp"])
    return _xent(norm(h, params["norm_f"]) @ params["unembed"], batch["targets"])


def _transformer(family: str, seed: int) -> Case:
    """A GPT (LayerNorm, GELU, learned positions) or Llama (RMSNorm, SwiGLU, rotary) training step, AdamW.

    One layer only: with AdamW (12-13 equations per parameter) a second layer adds ~300 equations, past the
    budget, and repeats of an identical layer teach the prior nothing the first one does not."""
    rng = np.random.default_rng(seed)
    llama = family == "llama"
    layers, d, heads = 1, _pick(rng, (64, 128, 256)), _pick(rng, (2, 4, 8))
    vocab, seq, onehot = _pick(rng, (256, 512, 1024, 2048)), _pick(rng, (16, 32, 64)), bool(rng.integers(2))
    ff = 32 * math.ceil(8 * d / 3 / 32) if llama else 4 * d  # Llama's 8/3 d, rounded up to 32
    batch = _fit(_pick(rng, (4, 8, 16)), seq * max(vocab, ff, heads * seq))
    params = _transformer_params(llama, layers, d, heads, ff, vocab, seq)
    data = {"tokens": _i32(batch, seq), "targets": _i32(batch, seq)}
    embed = "onehot" if onehot else "gather"
    name = f"{family} L{layers} d{d} h{heads} f{ff} V{vocab} s{seq} b{batch} {embed}"
    loss_fn = partial(_transformer_loss, llama=llama, onehot=onehot)
    return _training(name, family, seed, loss_fn, params, data, "adamw", {"tokens": vocab, "targets": vocab})


def _top1_moe(x: jax.Array, p: PyTree) -> jax.Array:
    """Top-1 routing with dense dispatch: a one-hot (token, expert) mask, einsum in and out of experts."""
    probs = _softmax(x @ p["router"])
    mask = jax.nn.one_hot(jnp.argmax(probs, axis=-1), probs.shape[-1])
    xe = jnp.einsum("bse,bsd->besd", mask, x)
    h = jax.nn.gelu(jnp.einsum("besd,edf->besf", xe, p["w1"]))
    return jnp.einsum("bse,besd->bsd", mask * probs, jnp.einsum("besf,efd->besd", h, p["w2"]))


def _soft_moe(x: jax.Array, p: PyTree) -> jax.Array:
    """Soft MoE: slots are softmax(over tokens) mixtures of tokens; outputs softmax(over slots) mixtures."""
    logits = jnp.einsum("bsd,den->bsen", x, p["phi"])
    b, s, e, n = logits.shape
    dispatch = _softmax(logits, axis=1)
    combine = _softmax(logits.reshape(b, s, e * n)).reshape(b, s, e, n)
    xs = jnp.einsum("bsen,bsd->bend", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("bend,edf->benf", xs, p["w1"]))
    return jnp.einsum("bsen,bend->bsd", combine, jnp.einsum("benf,efd->bend", h, p["w2"]))


def _moe(seed: int) -> Case:
    """A residual MoE layer (soft or top-1) on normalised tokens, MSE loss, AdamW."""
    rng = np.random.default_rng(seed)
    experts, d, f = _pick(rng, (2, 4, 8)), _pick(rng, (64, 128, 256)), _pick(rng, (128, 256, 512))
    seq, soft, slots = _pick(rng, (16, 32, 64)), bool(rng.integers(2)), _pick(rng, (1, 2, 4))
    batch = _fit(_pick(rng, (4, 8, 16)), seq * experts * max(d, f))
    params = {"norm": _ln_spec(d), "w1": _f32(experts, d, f), "w2": _f32(experts, f, d)}
    params["phi" if soft else "router"] = _f32(d, experts, slots) if soft else _f32(d, experts)
    layer = _soft_moe if soft else _top1_moe

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        x = batch["x"]
        return _mse(x + layer(_layer_norm(x, params["norm"]), params), batch["y"])

    kind = f"soft n{slots}" if soft else "top1"
    name = f"moe {kind} E{experts} d{d} f{f} s{seq} b{batch}"
    data = {"x": _f32(batch, seq, d), "y": _f32(batch, seq, d)}
    return _training(name, "moe", seed, loss_fn, params, data, "adamw")


_NHWC = ("NHWC", "HWIO", "NHWC")


def _conv(seed: int) -> Case:
    """A small NHWC conv net (3x3 SAME, stride 1 or 2), global average pooling, dense head, cross-entropy."""
    rng = np.random.default_rng(seed)
    hw, depth, classes = _pick(rng, (8, 16, 32)), int(rng.integers(2, 4)), _pick(rng, (8, 16, 32))
    chans = [4] + [_pick(rng, (8, 16, 32, 64)) for _ in range(depth)]
    strides = [_pick(rng, (1, 2)) for _ in range(depth)]
    batch, opt = _fit(_pick(rng, (8, 16, 32)), hw * hw * max(chans)), _pick(rng, ("adamw", "momentum"))
    convs = [{"w": _f32(3, 3, a, b), "b": _f32(b)} for a, b in itertools.pairwise(chans)]
    params = {"convs": convs, "head": _dense_spec(chans[-1], classes)}

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        x = batch["images"]
        for p, s in zip(params["convs"], strides, strict=True):
            y = jax.lax.conv_general_dilated(x, p["w"], (s, s), "SAME", dimension_numbers=_NHWC)
            x = jax.nn.relu(y + p["b"])
        return _xent(_dense(x.mean(axis=(1, 2)), params["head"]), batch["labels"])

    name = f"conv hw{hw} c{'-'.join(map(str, chans))} st{''.join(map(str, strides))} k{classes} b{batch}"
    data = {"images": _f32(batch, hw, hw, chans[0]), "labels": _i32(batch)}
    return _training(name, "conv", seed, loss_fn, params, data, opt, {"labels": classes})


def _gnn(seed: int) -> Case:
    """Message passing on a graph given by int32 edge lists: gather senders, segment_sum onto receivers."""
    rng = np.random.default_rng(seed)
    nodes, edges = _pick(rng, (64, 128, 256, 512)), _pick(rng, (256, 512, 1024, 2048))
    d = _pick(rng, (32, 64, 128))
    rounds, d_out = int(rng.integers(1, 4)), _pick(rng, (8, 16, 32))
    params = {"rounds": [{"msg": _f32(d, d), "self": _dense_spec(d, d)} for _ in range(rounds)]}
    params["out"] = _dense_spec(d, d_out)

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        h, senders, receivers = batch["x"], batch["senders"], batch["receivers"]
        for p in params["rounds"]:
            agg = jax.ops.segment_sum(h[senders] @ p["msg"], receivers, num_segments=h.shape[0])
            h = jax.nn.relu(_dense(h, p["self"]) + agg)
        return _mse(_dense(h, params["out"]), batch["y"])

    data = {"x": _f32(nodes, d), "senders": _i32(edges), "receivers": _i32(edges), "y": _f32(nodes, d_out)}
    name = f"gnn N{nodes} E{edges} d{d} r{rounds} o{d_out}"
    bounds = {"senders": nodes, "receivers": nodes}
    return _training(name, "gnn", seed, loss_fn, params, data, "adamw", bounds)


def _tied(seed: int) -> Case:
    """A language model whose output projection is the transposed input embedding table."""
    rng = np.random.default_rng(seed)
    vocab, d = _pick(rng, (512, 1024, 2048, 4096)), _pick(rng, (64, 128, 256))
    blocks, seq = int(rng.integers(1, 3)), _pick(rng, (16, 32, 64))
    batch = _fit(_pick(rng, (4, 8, 16)), seq * max(vocab, 4 * d))
    bias = blocks == 1  # two blocks with biased Dense layers would pass the equation budget
    mlp = {"fc1": _dense_spec(d, 4 * d, bias), "fc2": _dense_spec(4 * d, d, bias)}
    block = {"norm": _ln_spec(d), "mlp": mlp}
    params = {"embed": _f32(vocab, d), "blocks": [block] * blocks, "norm_f": _ln_spec(d)}

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        table = params["embed"]
        h = table[batch["tokens"]]
        for blk in params["blocks"]:
            h = h + _ffn(_layer_norm(h, blk["norm"]), blk["mlp"])
        return _xent(_layer_norm(h, params["norm_f"]) @ table.T, batch["targets"])

    data = {"tokens": _i32(batch, seq), "targets": _i32(batch, seq)}
    name = f"tied V{vocab} d{d} n{blocks} s{seq} b{batch}{'' if bias else ' nobias'}"
    return _training(name, "tied", seed, loss_fn, params, data, "adamw", {"tokens": vocab, "targets": vocab})


def _token_mix(x: jax.Array, p: PyTree, use_einsum: bool) -> jax.Array:
    """The Mixer token-mixing MLP over the sequence axis of (b, s, c), by einsum or by transposing."""
    if use_einsum:
        h = jax.nn.gelu(jnp.einsum("bsc,st->bct", x, p["fc1"]["w"]) + p["fc1"]["b"])
        return jnp.einsum("bct,ts->bsc", h, p["fc2"]["w"]) + p["fc2"]["b"][:, None]
    return jnp.swapaxes(_ffn(jnp.swapaxes(x, 1, 2), p), 1, 2)


def _mixer(seed: int) -> Case:
    """An MLP-Mixer block (token mixing, channel mixing, LayerNorm), MSE or classification loss, AdamW.
    One block and bias-free LayerNorms, to stay within the equation budget (see _transformer)."""
    rng = np.random.default_rng(seed)
    seq, c, blocks = _pick(rng, (16, 32, 64)), _pick(rng, (64, 128, 256)), 1
    ds, dc, classes = _pick(rng, (32, 64, 128)), _pick(rng, (2, 4)) * c, _pick(rng, (8, 16, 32))
    use_einsum, mse = bool(rng.integers(2)), bool(rng.integers(2))
    batch = _fit(_pick(rng, (8, 16, 32)), seq * dc)
    block = {"norm1": _ln_spec(c, False), "token": {"fc1": _dense_spec(seq, ds), "fc2": _dense_spec(ds, seq)},
             "norm2": _ln_spec(c, False), "channel": {"fc1": _dense_spec(c, dc), "fc2": _dense_spec(dc, c)}}
    params = {"blocks": [block] * blocks, "norm_f": _ln_spec(c, False)}
    if not mse:
        params["head"] = _dense_spec(c, classes)

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        x = batch["x"]
        for blk in params["blocks"]:
            x = x + _token_mix(_layer_norm(x, blk["norm1"]), blk["token"], use_einsum)
            x = x + _ffn(_layer_norm(x, blk["norm2"]), blk["channel"])
        x = _layer_norm(x, params["norm_f"])
        return _mse(x, batch["y"]) if mse else _xent(_dense(x.mean(axis=1), params["head"]), batch["labels"])

    data = {"x": _f32(batch, seq, c), **({"y": _f32(batch, seq, c)} if mse else {"labels": _i32(batch)})}
    mix, loss = "einsum" if use_einsum else "transpose", "mse" if mse else f"xent k{classes}"
    name = f"mixer s{seq} c{c} ds{ds} dc{dc} n{blocks} b{batch} {mix} {loss}"
    return _training(name, "mixer", seed, loss_fn, params, data, "adamw", {"labels": classes})


_BUILDERS: dict[str, Callable[[int], Case]] = {
    "mlp": _mlp,
    "gpt": partial(_transformer, "gpt"),
    "llama": partial(_transformer, "llama"),
    "moe": _moe,
    "conv": _conv,
    "gnn": _gnn,
    "tied": _tied,
    "mixer": _mixer,
}


# ----------------------------------------------------------------------------------------------- public


def case(family: str, seed: int) -> Case:
    """The program of `family` whose sizes are drawn from `np.random.default_rng(seed)`; deterministic."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown corpus family {family!r}; expected one of {FAMILIES}")
    return _BUILDERS[family](seed)


def corpus(n: int, seed: int = 0) -> list[Case]:
    """`n` cases, round-robin over FAMILIES so that every family is represented in any prefix of 8."""
    return [case(FAMILIES[i % len(FAMILIES)], seed * 1000 + i) for i in range(n)]


def example_inputs(c: Case, seed: int = 0) -> tuple[Any, ...]:
    """Concrete arrays for `c.args`: floats ~ N(0, 0.02²), second moments (`nu`) made non-negative as an
    optimizer's would be, integers uniform below their `int_bounds`."""
    rng = np.random.default_rng(seed)
    bounds = dict(c.int_bounds)

    def make(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, bounds[jax.tree_util.keystr(path)], leaf.shape), leaf.dtype)
        x = 0.02 * rng.standard_normal(leaf.shape)
        nonneg = any(getattr(k, "key", None) == "nu" for k in path)
        return jnp.asarray(np.abs(x) if nonneg else x, leaf.dtype)

    return tuple(jax.tree_util.tree_map_with_path(make, c.args))
