"""Structural blocks (control flow, loops over layers, checkpoint, vmap) and the block registry.

Structural blocks wrap other blocks drawn from the registry in a nested function: a lax.cond or
lax.switch branch, a while/fori loop body, a lax.scan over stacked layers, a Python loop over a
list of layers, a jax.checkpoint'ed or jax.vmap'ed function. Nesting is bounded (MAX_NESTING) so
programs stay small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fuzz import layers as L
from fuzz.builder import ArgSpec, Builder, Tensor
from fuzz.layers import BlockKind

MAX_NESTING = 2


def emit_block(b: Builder, h: Tensor, kinds: Sequence[BlockKind] | None = None) -> Tensor:
    """One block drawn from `kinds` (default: every sequence block) that fits the context."""
    pool = [k for k in (kinds or SEQ_BLOCKS)
            if (k.differentiable or not b.training) and (k.nestable or b.nested == 0)
            and (k.name not in STRUCTURAL or b.nested < MAX_NESTING)]
    kind = b.pick(pool, [k.weight for k in pool])
    return kind.emit(b, h)


def _body_fn(b: Builder, h: Tensor, stem: str, n: int, kinds: Sequence[BlockKind] | None = None,
             params: str = "") -> str:
    """A nested `def stem(h[, params]):` applying n blocks; returns the function's name."""
    fn = b.fresh(stem)
    b.line(f"def {fn}({h.name}{', ' + params if params else ''}):")
    with b.block():
        inner = h
        for _ in range(n):
            inner = emit_block(b, inner, kinds)
        b.line(f"return {inner.name}")
    return fn


def _out(b: Builder, h: Tensor, expr: str, tag: str) -> Tensor:
    b.tag(tag)
    out = b.fresh("h")
    b.line(f"{out} = {expr}")
    return Tensor(out, h.shape, h.dtype)


# ---- branches -------------------------------------------------------------------------------


def _predicate(b: Builder, h: Tensor) -> str:
    if b.chance(0.5):
        return f"{h.name}.mean() > 0"
    b.tag("cond-on-flag-argument")
    return b.input("train", ArgSpec((), "bool", "flag"))


def cond_gated(b: Builder, h: Tensor) -> Tensor:
    d = h.shape[-1]
    p = b.group("mlp", {"up": {"w": (d, d), "b": (d,)}, "down": {"w": (d, d), "b": (d,)}})
    return _out(b, h, f"B.gated_mlp({h.name}, {p}, {_predicate(b, h)})", "cond")


def cond_branches(b: Builder, h: Tensor) -> Tensor:
    pred = _predicate(b, h)
    yes = _body_fn(b, h, "when_true", b.randint(1, 2))
    no = _body_fn(b, h, "when_false", b.randint(0, 1))
    return _out(b, h, f"lax.cond({pred}, {yes}, {no}, {h.name})", "cond")


def switch_branches(b: Builder, h: Tensor) -> Tensor:
    index = b.input("mode", ArgSpec((), "int32", "count", high=b.randint(0, 3)))
    if b.chance(0.4):
        d = h.shape[-1]
        p = b.group("dense", {"w": (d, d), "b": (d,)})
        return _out(b, h, f"B.switch_activation({h.name}, {p}, {index})", "switch")
    fns = [_body_fn(b, h, "branch", b.randint(0, 1)) for _ in range(b.randint(2, 3))]
    return _out(b, h, f"lax.switch(jnp.clip({index}, 0, {len(fns) - 1}), [{', '.join(fns)}], {h.name})", "switch")


# ---- loops ----------------------------------------------------------------------------------


def while_renorm(b: Builder, h: Tensor) -> Tensor:
    return _out(b, h, f"B.renormalize({h.name} * 4.0, max_norm={b.pick([0.5, 1.0, 2.0])})", "while-data-dependent")


def while_counted(b: Builder, h: Tensor) -> Tensor:
    n = b.input("n_steps", ArgSpec((), "int32", "count", high=b.randint(0, 3)))
    fn = _body_fn(b, h, "step", 1, [k for k in SEQ_BLOCKS if k.name not in STRUCTURAL])
    carry = b.fresh("carry")
    b.line(f"{carry} = lax.while_loop(lambda c: c[0] < {n}, lambda c: (c[0] + 1, {fn}(c[1])), (0, {h.name}))")
    return _out(b, h, f"{carry}[1]", "while-dynamic-trip-count")


def fori_static(b: Builder, h: Tensor) -> Tensor:
    fn = _body_fn(b, h, "step", 1, [k for k in SEQ_BLOCKS if k.name not in STRUCTURAL])
    n = b.pick([0, 1, 2, 3])
    return _out(b, h, f"lax.fori_loop(0, {n}, lambda i, x: {fn}(x), {h.name})", "fori-static")


def fori_dynamic(b: Builder, h: Tensor) -> Tensor:
    n = b.input("n_steps", ArgSpec((), "int32", "count", high=b.randint(0, 3)))
    d = h.shape[-1]
    w = b.group("shared", {"w": ArgSpec((d, d), b.dtype, scale=0.3)})
    return _out(b, h, f"B.repeat_layer({h.name}, {w}, {n})", "fori-dynamic")


def _stack_kinds() -> list[BlockKind]:
    names = {"attention", "fused_attention", "mlp", "glu", "moe", "norm", "conv1d", "pad_smooth", "side_effect",
             "dropout", "cond_branches", "switch_moe", "stack_mix"}
    return [k for k in SEQ_BLOCKS if k.name in names]


def scan_layers(b: Builder, h: Tensor) -> Tensor:
    """lax.scan over stacked layer parameters (leading dim = layers); per-step outputs kept,
    dropped or absent; the body sometimes under jax.checkpoint."""
    n_layers = b.pick([1, 2, 3, 4, 6])
    tree: dict[str, Any] = {}
    fn = b.fresh("layer")
    b.line(f"def {fn}({h.name}, lp):")
    with b.block(), b.scope("lp", tree, (*b.scopes[-1].lead, n_layers)):
        inner = h
        for _ in range(b.randint(1, 2)):
            inner = emit_block(b, inner, _stack_kinds())
        ys = b.pick(["None", f"{inner.name}.mean()", f"{inner.name}[:, 0]"])
        b.line(f"return {inner.name}, {ys}")
    stack = b.fresh("stack")
    b.scopes[-1].tree[stack] = tree
    body = fn
    if b.chance(0.3):
        policy = b.pick(["", ", policy=jax.checkpoint_policies.dots_saveable",
                         ", policy=jax.checkpoint_policies.nothing_saveable"])
        body = f"jax.checkpoint({fn}{policy})"
        b.tag("checkpoint-scan-body")
    out, per_step = b.fresh("h"), b.fresh("per_layer")
    keep = ys != "None" and b.nested == 0 and b.chance(0.5)
    xs = f'{b.scopes[-1].root}["{stack}"]' + ("" if tree else f", length={n_layers}")
    b.line(f"{out}, {per_step if keep else '_'} = lax.scan({body}, {h.name}, {xs})")
    if keep:
        b.aux[per_step] = per_step
    b.tag("scan-layers" + ("" if keep or ys == "None" else "-dropped-outputs"))
    return Tensor(out, h.shape, h.dtype)


def unrolled_layers(b: Builder, h: Tensor) -> Tensor:
    """A Python loop over a list of identical layers (what fold_loops folds), named scopes."""
    n_layers = b.pick([2, 3, 4])
    tree: dict[str, Any] = {}
    layers = b.fresh("layers")
    i, cur = b.fresh("i"), b.fresh("h")
    b.line(f"{cur} = {h.name}")
    b.line(f"for {i}, lp in enumerate({b.scopes[-1].root}[\"{layers}\"]):")
    with b.block(), b.scope("lp", tree, b.scopes[-1].lead):
        b.line(f'with jax.named_scope(f"layer{{{i}}}"):')
        with b.block():
            inner = Tensor(cur, h.shape, h.dtype)
            for _ in range(b.randint(1, 2)):
                inner = emit_block(b, inner, _stack_kinds())
            b.line(f"{cur} = {inner.name}")
    b.scopes[-1].tree[layers] = [tree] * n_layers
    b.tag("unrolled-layers")
    return Tensor(cur, h.shape, h.dtype)


# ---- transformations ------------------------------------------------------------------------


def checkpoint(b: Builder, h: Tensor) -> Tensor:
    fn = _body_fn(b, h, "block", b.randint(1, 2))
    policy = b.pick(["", ", policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable", ", prevent_cse=False"])
    return _out(b, h, f"jax.checkpoint({fn}{policy})({h.name})", "checkpoint")


def vmap_block(b: Builder, h: Tensor) -> Tensor:
    """jax.vmap of a per-example function (seq, d) -> (seq, d) over the batch."""
    example = Tensor(h.name, h.shape[1:], h.dtype)
    fn = _body_fn(b, example, "per_example", b.randint(1, 2), RANK_FREE)
    return _out(b, h, f"jax.vmap({fn})({h.name})", "vmap")


SEQ_BLOCKS: list[BlockKind] = [
    BlockKind("attention", L.attention, 3.0),
    BlockKind("fused_attention", L.fused_attention, 1.0),
    BlockKind("vmap_attention", L.vmap_attention, 0.7),
    BlockKind("mlp", L.mlp, 3.0),
    BlockKind("glu", L.glu, 2.0),
    BlockKind("moe", L.moe, 1.5),
    BlockKind("moe_gathered", L.moe_gathered, 0.8),
    BlockKind("switch_moe", L.switch_moe, 0.8),
    BlockKind("norm", L.norm, 1.5),
    BlockKind("dropout", L.dropout, 1.0),
    BlockKind("noise", L.noise, 0.5),
    BlockKind("side_effect", L.side_effect, 1.0),
    BlockKind("mixed_precision", L.mixed_precision, 0.5),
    BlockKind("pad_smooth", L.pad_smooth, 1.2),
    BlockKind("running_mean", L.running_mean, 0.8),
    BlockKind("sort_tokens", L.sort_tokens, 0.7),
    BlockKind("top_features", L.top_features, 0.6),
    BlockKind("reshape_heads", L.reshape_heads, 0.7),
    BlockKind("swap_halves", L.swap_halves, 0.6),
    BlockKind("stack_mix", L.stack_mix, 0.5),
    BlockKind("masked_fill", L.masked_fill, 0.5, nestable=False),
    BlockKind("leaky_gate", L.leaky_gate, 0.5),
    BlockKind("conv1d", L.conv1d, 0.8),
    BlockKind("rnn", L.rnn, 0.6),
    BlockKind("cond_gated", cond_gated, 0.8),
    BlockKind("cond_branches", cond_branches, 1.0),
    BlockKind("switch_branches", switch_branches, 0.8),
    BlockKind("while_renorm", while_renorm, 0.8, differentiable=False),
    BlockKind("while_counted", while_counted, 0.8, differentiable=False),
    BlockKind("fori_static", fori_static, 0.6),
    BlockKind("fori_dynamic", fori_dynamic, 0.7, differentiable=False),
    BlockKind("scan_layers", scan_layers, 1.5),
    BlockKind("unrolled_layers", unrolled_layers, 1.0),
    BlockKind("checkpoint", checkpoint, 0.6),
    BlockKind("vmap_block", vmap_block, 0.6),
]

STRUCTURAL = {"cond_branches", "switch_branches", "while_counted", "fori_static", "scan_layers", "unrolled_layers",
              "checkpoint", "vmap_block"}

# Blocks that work on any rank (per-example functions under vmap see (seq, d)).
RANK_FREE = [k for k in SEQ_BLOCKS if k.name in {"mlp", "glu", "mixed_precision", "top_features", "swap_halves",
                                                 "stack_mix", "leaky_gate", "side_effect"}]
RANK_FREE += [BlockKind("norm", L.norm, 1.0)]  # batch norm of one example normalises over its seq
