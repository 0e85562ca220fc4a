"""Block emitters: each writes one block of a generated program (a call into fuzz/blocks.py or a
few lines of jax.numpy), drawing its configuration and creating its parameters.

Sequence blocks map the activation `h` of shape (batch, seq, d) to the same shape, so they
compose in any order; image blocks map (n, h, w, c) or (n, c, h, w) feature maps. Each block
says whether it is differentiable (training steps only use those) and whether it may sit inside
a scan body, a branch or a vmapped function (blocks that add aux outputs or data inputs read at
top level may not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fuzz.builder import HIDDEN, ArgSpec, Builder, Tensor

Emit = Callable[[Builder, Tensor], Tensor]


@dataclass(frozen=True)
class BlockKind:
    name: str
    emit: Emit
    weight: float
    differentiable: bool = True
    nestable: bool = True  # may be emitted inside a scan body / unrolled layer


def _divisors(n: int, options: tuple[int, ...] = (1, 2, 3, 4, 8)) -> list[int]:
    return [h for h in options if n % h == 0]


def _norm(b: Builder, h: Tensor) -> str:
    """Expression of a pre-norm of h (layer or RMS norm), or h itself."""
    d = h.shape[-1]
    kind = b.pick(["rms", "layer", "none"], [0.45, 0.35, 0.2])
    if kind == "rms":
        return f"B.rms_norm({h.name}, {b.group('norm', {'scale': ArgSpec((d,), b.dtype, 'positive')})})"
    if kind == "layer":
        p = b.group("norm", {"scale": ArgSpec((d,), b.dtype, "positive"), "bias": ArgSpec((d,), b.dtype, scale=0.1)})
        return f"B.layer_norm({h.name}, {p})"
    return h.name


def _residual(b: Builder, h: Tensor, expr: str, tag: str) -> Tensor:
    b.tag(tag)
    out = b.fresh("h")
    b.line(f"{out} = {h.name} + {expr}")
    return Tensor(out, h.shape, h.dtype)


def _assign(b: Builder, h: Tensor, expr: str, tag: str, shape: tuple[int, ...] | None = None) -> Tensor:
    b.tag(tag)
    out = b.fresh("h")
    b.line(f"{out} = {expr}")
    return Tensor(out, shape or h.shape, h.dtype)


# ---- attention and feed-forward -------------------------------------------------------------


def attention(b: Builder, h: Tensor) -> Tensor:
    bsz, s, d = h.shape
    heads = b.pick(_divisors(d))
    k = d // heads
    if not b.fits(bsz, heads, s, s):
        return h
    p = b.group("attn", {"wq": (d, heads, k), "wk": (d, heads, k), "wv": (d, heads, k), "wo": (heads, k, d)})
    use_rope = k % 2 == 0 and b.chance(0.5)
    mask = ""
    if b.nested == 0 and b.chance(0.3):
        mask = ", mask=" + b.input("mask", ArgSpec((bsz, s), "bool", "mask"))
        b.tag("attention-padding-mask")
    if use_rope:
        b.tag("rope")
    return _residual(b, h, f"B.causal_attention({_norm(b, h)}, {p}, use_rope={use_rope}{mask})", "attention")


def fused_attention(b: Builder, h: Tensor) -> Tensor:
    bsz, s, d = h.shape
    heads = b.pick(_divisors(d))
    if not b.fits(bsz, heads, s, s):
        return h
    p = b.group("attn", {"wqkv": (d, 3 * d), "wo": (d, d)})
    return _residual(b, h, f"B.fused_qkv_attention({_norm(b, h)}, {p}, heads={heads})", "attention-fused-qkv")


def vmap_attention(b: Builder, h: Tensor) -> Tensor:
    bsz, s, d = h.shape
    heads = b.pick(_divisors(d))
    k = d // heads
    if not b.fits(bsz, heads, s, s):
        return h
    p = b.group("attn", {"wq": (d, heads, k), "wk": (d, heads, k), "wv": (d, heads, k), "wo": (heads, k, d)})
    b.tag("vmap")
    return _residual(b, h, f"jax.vmap(B.single_example_attention, in_axes=(0, None))({_norm(b, h)}, {p})",
                     "attention-vmap")


def mlp(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    f = b.pick([x for x in HIDDEN if b.fits(*h.shape[:-1], x)] or [1])
    p = b.group("mlp", {"up": {"w": (d, f), "b": ArgSpec((f,), b.dtype, scale=0.1)},
                        "down": {"w": (f, d), "b": ArgSpec((d,), b.dtype, scale=0.1)}})
    act = b.pick(["gelu", "relu", "silu", "tanh", "leaky_relu", "softplus"])
    return _residual(b, h, f"B.mlp({_norm(b, h)}, {p}, act={act!r})", "mlp")


def glu(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    f = b.pick([x for x in HIDDEN if b.fits(*h.shape[:-1], 2 * x)] or [1])
    if b.chance(0.5):
        p = b.group("swiglu", {"gate": (d, f), "up": (d, f), "down": (f, d)})
        return _residual(b, h, f"B.swiglu({_norm(b, h)}, {p})", "swiglu")
    p = b.group("geglu", {"gate_up": (d, 2 * f), "down": (f, d)})
    return _residual(b, h, f"B.geglu({_norm(b, h)}, {p})", "geglu")


# ---- mixture of experts ---------------------------------------------------------------------


def moe(b: Builder, h: Tensor) -> Tensor:
    bsz, s, d = h.shape
    t = bsz * s
    n_exp = b.pick([1, 2, 3, 4, 8])
    k = b.pick([x for x in (1, 2) if x <= n_exp])
    f = b.pick([x for x in (3, 4, 8, 16) if b.fits(t, n_exp, x) and b.fits(t, n_exp, d)] or [1])
    if not b.fits(t, n_exp, d):
        return h
    p = b.group("moe", {"router": (d, n_exp), "w_in": (n_exp, d, f), "w_out": (n_exp, f, d)})
    y, load = b.fresh("moe_out"), b.fresh("load")
    b.line(f"{y}, {load} = B.moe({_norm(b, h)}, {p}, k={k})")
    if b.nested == 0:
        b.aux[load] = load
    return _residual(b, h, y, "moe-topk-scatter-add")


def moe_gathered(b: Builder, h: Tensor) -> Tensor:
    bsz, s, d = h.shape
    n_exp = b.pick([2, 3, 4])
    k = b.pick([1, 2])
    if not b.fits(bsz * s, k, d, d):
        return h
    p = b.group("moe", {"router": (d, n_exp), "w": (n_exp, d, d)})
    y, gate = b.fresh("moe_out"), b.fresh("top_gate")
    b.line(f"{y}, {gate} = B.moe_gathered({_norm(b, h)}, {p}, k={k})")
    if b.nested == 0:
        b.aux[gate] = gate
    b.tag("moe-gather-scatter-max")
    return _residual(b, h, y, "moe-topk-gather")


def switch_moe(b: Builder, h: Tensor) -> Tensor:
    bsz, s, d = h.shape
    n_exp = b.pick([1, 2, 4, 8])
    capacity = b.pick([1, 2, max(1, (bsz * s) // n_exp), bsz * s + 1])
    f = b.pick([4, 8, 16])
    if not b.fits(n_exp, capacity, max(f, d)) or not b.fits(bsz * s, n_exp):
        return h
    p = b.group("switch", {"router": (d, n_exp), "w_in": (n_exp, d, f), "w_out": (n_exp, f, d)})
    return _assign(b, h, f"B.switch_moe({h.name}, {p}, capacity={capacity})", "moe-switch-capacity")


# ---- normalisation, dropout, side effects ---------------------------------------------------


def norm(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    kind = b.pick(["layer", "rms", "batch"])
    scale = ArgSpec((d,), b.dtype, "positive")
    if kind == "rms":
        return _assign(b, h, f"B.rms_norm({h.name}, {b.group('norm', {'scale': scale})})", "rms-norm")
    p = b.group("norm", {"scale": scale, "bias": ArgSpec((d,), b.dtype, scale=0.1)})
    fn = "B.layer_norm" if kind == "layer" else "B.batch_norm"
    return _assign(b, h, f"{fn}({h.name}, {p})", f"{kind}-norm")


def dropout(b: Builder, h: Tensor) -> Tensor:
    rate = b.pick([0.1, 0.25, 0.5])
    return _assign(b, h, f"B.dropout({h.name}, {b.key()}, {rate})", "dropout-random")


def noise(b: Builder, h: Tensor) -> Tensor:
    """Gaussian noise and a random permutation of the batch, drawn inside the function."""
    expr = f"{h.name} + 0.01 * jax.random.normal({b.key()}, {h.name}.shape, {h.name}.dtype)"
    out = _assign(b, h, expr, "random-normal")
    if b.chance(0.5) and not b.training:
        return _assign(b, out, f"jax.random.permutation({b.key()}, {out.name}, axis=0)", "random-permutation")
    return out


def side_effect(b: Builder, h: Tensor) -> Tensor:
    if b.chance(0.6):
        b.tag("debug-callback")
        b.line(f"jax.debug.callback(record, {b.fresh('event')!r}, {h.name}.mean())")
    else:
        b.tag("debug-print")
        b.line(f'jax.debug.print("{b.fresh("h")} mean {{m}} l1 {{x}}", m={h.name}.mean(), x=jnp.abs({h.name}).sum())')
    return h


def mixed_precision(b: Builder, h: Tensor) -> Tensor:
    """A block computed in another float dtype, cast back (bf16 matmul in an f32 model)."""
    other = "jnp.bfloat16" if h.dtype != "bfloat16" else "jnp.float32"
    d = h.shape[-1]
    w = b.param("w", (d, d))
    expr = f"({h.name}.astype({other}) @ {w}.astype({other})).astype({h.name}.dtype)"
    return _residual(b, h, f"jnp.tanh({expr})", "mixed-precision-cast")


# ---- sequence plumbing ----------------------------------------------------------------------


def pad_smooth(b: Builder, h: Tensor) -> Tensor:
    modes = ["constant", "edge", "linear_ramp", "maximum", "mean", "median", "minimum", "reflect",
             "symmetric", "wrap", "empty"]
    if 0 in h.shape:  # the statistic modes reduce over empty slices, which jnp.pad rejects
        modes = [m for m in modes if m not in ("maximum", "mean", "median", "minimum")]
    mode = b.pick(modes)
    axis = b.pick([1, 2])
    width = b.pick([1, 2])
    return _assign(b, h, f"B.padded_smooth({h.name}, axis={axis}, width={width}, mode={mode!r})", f"pad-{mode}")


def running_mean(b: Builder, h: Tensor) -> Tensor:
    return _residual(b, h, f"0.5 * B.running_mean({h.name}, axis=1)", "cumsum")


def sort_tokens(b: Builder, h: Tensor) -> Tensor:
    out, order = b.fresh("h"), b.fresh("order")
    b.line(f"{out}, {order} = B.sort_tokens({h.name})")
    if b.nested == 0 and not b.training:
        b.aux[order] = order
    b.tag("argsort-take-along-axis")
    return Tensor(out, h.shape, h.dtype)


def top_features(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    k = b.randint(1, d) if d else 0
    if k == 0:
        return h
    w = b.param("w", (k, d))
    return _residual(b, h, f"B.top_features({h.name}, {k}) @ {w}", "sort")


def reshape_heads(b: Builder, h: Tensor) -> Tensor:
    heads = b.pick(_divisors(h.shape[-1]))
    return _assign(b, h, f"B.split_heads_roundtrip({h.name}, heads={heads})", "reshape-transpose-chain")


def swap_halves(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    if d < 2:
        return h
    return _assign(b, h, f"B.swap_halves({h.name}, {b.randint(1, d - 1)})", "split-concatenate")


def stack_mix(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    w = b.param("w", (d, d))
    return _assign(b, h, f"B.stack_mix({h.name}, jnp.tanh({h.name} @ {w}))", "stack")


def masked_fill(b: Builder, h: Tensor) -> Tensor:
    bsz, s, _ = h.shape
    mask = b.input("mask", ArgSpec((bsz, s), "bool", "mask"))
    return _assign(b, h, f"jnp.where({mask}[..., None], {h.name}, jnp.zeros_like({h.name}))", "where-mask")


def leaky_gate(b: Builder, h: Tensor) -> Tensor:
    return _assign(b, h, f"jnp.where({h.name} > 0, {h.name}, 0.2 * {h.name})", "where")


def conv1d(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    width = b.pick([1, 2, 3, 4])
    w = b.param("conv", (width, d, d))
    return _residual(b, h, f"B.causal_conv1d({h.name}, {w})", "conv1d-causal")


def rnn(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    r = b.pick([3, 8, 16])
    p = b.group("rnn", {"w_x": (d, r), "w_h": ArgSpec((r, r), b.dtype, scale=0.3)})
    w = b.param("w", (r, d))
    return _residual(b, h, f"B.rnn({h.name}, {p}) @ {w}", "rnn-scan")
