"""Data-processing programs: the input pipeline and metrics code that sits around models.

Sorting, ranking, top-k, cumulative sums, histograms by scatter-add, segment reductions,
unique/nonzero with static sizes, searchsorted, padding, rolling and flipping, boolean masks and
integer outputs. Each op reads the program's inputs (x: (n, d) floats, ids: (n,) ints, mask: (n,)
bools) or an earlier op's float result and adds outputs. Discontinuous ops (argsort, top_k,
argmax) read raw inputs, never sums: a sharded sum may round differently, which would flip them.
"""

from __future__ import annotations

from collections.abc import Callable

from fuzz.builder import ArgSpec, Builder

# (name, emitter): an emitter writes lines and returns {output name: variable}.
DataOp = Callable[[Builder, dict[str, str], tuple[int, int, int]], dict[str, str]]


def _v(b: Builder, stem: str, expr: str) -> str:
    name = b.fresh(stem)
    b.line(f"{name} = {expr}")
    return name


def sort_rank(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    order = _v(b, "order", f"jnp.argsort({e['x']}[:, 0])")
    b.tag("argsort")
    ranked = _v(b, "ranked", f"{e['x']}[{order}]")
    return {"order": order, "ranked": ranked, "sorted": _v(b, "sorted", f"jnp.sort({e['x']}, axis=0)")}


def topk(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    d = size[1]
    if d == 0:
        return {}
    k = b.randint(1, d)
    vals, idx = b.fresh("top"), b.fresh("top_idx")
    b.line(f"{vals}, {idx} = lax.top_k({e['x']}, {k})")
    b.tag("top-k")
    return {"top_values": vals, "top_index": idx}


def cumulative(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    kind = b.pick(["cumsum", "cummax", "cumprod"])
    if kind == "cumsum":
        expr = f"jnp.cumsum({e['cur']}, axis=0)"
    elif kind == "cummax":
        expr = f"lax.cummax({e['cur']}, axis=0)"
    else:
        expr = f"jnp.cumprod(1.0 + 0.01 * jnp.tanh({e['cur']}), axis=0)"
    b.tag(kind)
    e["cur"] = _v(b, "acc", expr)
    return {kind: e["cur"]}


def histogram(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    k = size[2]
    if b.chance(0.5):
        b.tag("scatter-add-histogram")
        return {"histogram": _v(b, "hist", f"jnp.zeros(({k},), jnp.int32).at[{e['ids']}].add(1)")}
    b.tag("bincount")
    return {"bincount": _v(b, "hist", f"jnp.bincount({e['ids']}, length={k})")}


def segments(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    k = size[2]
    kind = b.pick(["segment_sum", "segment_max", "segment_min"])
    b.tag(kind)
    return {kind: _v(b, "seg", f"jax.ops.{kind}({e['cur']}, {e['ids']}, num_segments={k})")}


def scatter_update(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    """Row updates by index: .at[ids].set / .max / .add on a table of k rows."""
    _, d, k = size
    kind = b.pick(["set", "max", "add", "min"])
    b.tag(f"scatter-{kind}")
    table = _v(b, "table", f"jnp.zeros(({k}, {d}), {e['x']}.dtype).at[{e['ids']}].{kind}({e['cur']})")
    return {f"table_{kind}": table}


def unique_nonzero(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    n, _, k = size
    b.tag("unique-nonzero-static-size")
    uniq = _v(b, "uniq", f"jnp.unique({e['ids']}, size={k}, fill_value=-1)")
    (nz,) = [_v(b, "nz", f"jnp.nonzero({e['mask']}, size={n}, fill_value=-1)[0]")]
    return {"unique": uniq, "nonzero": nz}


def search(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    edges = _v(b, "edges", f"jnp.sort({e['x']}[:, 0])")
    b.tag("searchsorted")
    return {"bucket": _v(b, "bucket", f"jnp.searchsorted({edges}, {e['x']}[:, -1])")}


def masks(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    masked = _v(b, "masked", f"jnp.where({e['mask']}[:, None], {e['cur']}, 0.0)")
    e["cur"] = masked
    b.tag("where-mask")
    return {"count": _v(b, "count", f"jnp.sum({e['mask']})"),
            "any_negative": _v(b, "flag", f"jnp.any({e['x']} < -3.0)"),
            "masked_mean": _v(b, "mean", f"{masked}.sum(0) / jnp.maximum({e['mask']}.sum(), 1)")}


def reshape_ops(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    n, d, _ = size
    ops = [f"jnp.flip({e['cur']}, axis=0)", f"jnp.roll({e['cur']}, 1, axis=0)", f"{e['cur']}[::2]",
           f"{e['cur']}[1:]", f"{e['cur']}.T", f"jnp.concatenate([{e['cur']}, {e['cur']}[:, :1]], axis=1)",
           f"jnp.stack([{e['cur']}, -{e['cur']}], axis=-1).reshape({n}, {2 * d})",
           f"jnp.pad({e['cur']}, ((1, 2), (0, 0)), mode={b.pick(['constant', 'edge', 'wrap', 'reflect'] if n else ['constant'])!r})"]
    if d % 2 == 0 and d:
        ops.append(f"jnp.concatenate(jnp.split({e['cur']}, 2, axis=1)[::-1], axis=1)")
    expr = b.pick(ops)
    b.tag("slice-flip-roll-pad-concat")
    return {"reshaped": _v(b, "r", expr)}


def pairwise(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    n = size[0]
    if not b.fits(n, n):
        return {}
    b.tag("pairwise-einsum")
    dist = _v(b, "dist", f"jnp.sum(({e['cur']}[:, None, :] - {e['cur']}[None, :, :]) ** 2, axis=-1)")
    return {"nearest": _v(b, "nearest", f"jnp.argmin({dist} + jnp.eye({n}) * 1e9, axis=-1)") if n > 1 else dist}


def normalize(b: Builder, e: dict[str, str], size: tuple[int, int, int]) -> dict[str, str]:
    b.tag("normalize")
    e["cur"] = _v(b, "z", f"({e['cur']} - {e['cur']}.mean(0)) / ({e['cur']}.std(0) + 1e-3)")
    return {"normalized": e["cur"]}


DATA_OPS: list[tuple[DataOp, float]] = [
    (sort_rank, 1.0), (topk, 1.0), (cumulative, 1.0), (histogram, 1.0), (segments, 1.0),
    (scatter_update, 1.0), (unique_nonzero, 0.7), (search, 0.6), (masks, 1.0), (reshape_ops, 1.2),
    (pairwise, 0.6), (normalize, 0.8),
]


def data_program(b: Builder) -> dict[str, str]:
    """Lines of a data-processing function; returns its candidate outputs."""
    n = b.pick([0, 1, 3, 5, 7, 8, 13, 16, 64, 100])
    d = b.pick([1, 2, 3, 4, 8, 16])
    k = b.pick([1, 2, 3, 5, 8, 16])
    if not b.fits(n, n):
        n = 64
    e = {"x": b.input("x", ArgSpec((n, d), b.dtype)), "ids": b.input("ids", ArgSpec((n,), "int32", "ids", high=k)),
         "mask": b.input("mask", ArgSpec((n,), "bool", "mask"))}
    e["cur"] = e["x"]
    outs: dict[str, str] = {}
    ops = [op for op, _ in DATA_OPS]
    for _ in range(b.randint(2, 5)):
        op = b.pick(ops, [w for _, w in DATA_OPS])
        outs.update(op(b, e, (n, d, k)))
    return outs
