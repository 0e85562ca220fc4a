"""Numerical checks of single rewrites: one local strategy of a signature, or one collective,
run on shards with shard_map and compared with the unsharded computation. Used by
shardsat.testing.check_rule and by the test suite on every built-in rule."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..egraph.layout import Layout, MeshAxes, auto_mesh
from ..rules.reshard import ReshardEdge
from .local import local_params
from .lower import apply_collective


@dataclass(frozen=True)
class Mismatch:
    error: float
    detail: str


def split_partial(x: np.ndarray, lay: Layout, axes: MeshAxes, rng: np.random.Generator) -> np.ndarray:
    """A pending sum of x over lay.partial: one random part per device slot, summing to x."""
    if not lay.partial:
        return x
    n = math.prod(axes.sizes[a] for a in lay.partial)
    parts = rng.standard_normal((n, *x.shape)).astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else \
        rng.integers(-3, 4, (n, *x.shape)).astype(x.dtype)
    parts[-1] = x - parts[:-1].sum(0)
    return parts


def widened(got: Any, want: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64 to compare, or complex128 where either is complex: numpy's cast to float
    drops imaginary parts, and a wrong one with them."""
    wide = np.complex128 if np.iscomplexobj(got) or np.iscomplexobj(want) else np.float64
    return np.asarray(got, wide), np.asarray(want, wide)


def compare(got: Any, want: Any) -> tuple[tuple[int, ...] | None, float]:
    """(the first entry where a NaN or an infinity is on one side only, or None; the largest
    difference elsewhere relative to the largest finite entry of `want`). NaNs on both sides
    match: an op computing log or sqrt of the random operands a check draws is NaN there
    whether it runs whole or on shards; `max|got - want|` read NaN for the whole array, and
    a NaN compared with `>` passed as no error at all."""
    got, want = widened(got, want)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    odd = ~same & ~(np.isfinite(got) & np.isfinite(want))
    if odd.any():
        return tuple(int(k) for k in np.argwhere(odd)[0]), math.inf
    finite = np.isfinite(want)
    scale = float(np.max(np.abs(want[finite]), initial=0.0)) or 1.0
    return None, float(np.max(np.abs(np.where(same, 0.0, got - want)), initial=0.0)) / scale


def _relerr(got: np.ndarray, want: np.ndarray) -> float:
    """Largest difference relative to the largest entry (inf where a NaN or an infinity is on
    one side only, see compare)."""
    return compare(got, want)[1]


def check_local(
    apply: Callable[..., Any],  # global arrays -> result(s); also run on shards
    operands: Sequence[np.ndarray],
    in_layouts: Sequence[Layout],
    out_layouts: Sequence[Layout],
    axes: MeshAxes,
    mesh: Mesh,
    rng: np.random.Generator,
    name: str = "op",
    params_for: Callable[[list[tuple[tuple[int, ...], tuple[int, ...]]], list[tuple[tuple[int, ...], tuple[int, ...]]]], dict[str, Any]] | None = None,
) -> Mismatch | None:
    """Run `apply` on shards in the given layouts (inside shard_map) and compare with the
    unsharded result. Pending sums go in as random parts that sum to the operand and come out
    summed over their stacked device dimension."""
    mesh = auto_mesh(mesh)
    want = apply(*[jnp.asarray(x) for x in operands])
    multi = isinstance(want, list | tuple)
    wants = list(want) if multi else [want]
    ins = [split_partial(np.asarray(x), lay, axes, rng) for x, lay in zip(operands, in_layouts, strict=True)]
    in_shapes = [(tuple(np.shape(x)), lay.shard_shape(tuple(np.shape(x)), axes)) for x, lay in
                 zip(operands, in_layouts, strict=True)]
    out_shapes = [(tuple(w.shape), lay.shard_shape(tuple(w.shape), axes)) for w, lay in zip(wants, out_layouts, strict=True)]

    def body(*local: Any) -> Any:
        xs = [x[0] if lay.partial else x for x, lay in zip(local, in_layouts, strict=True)]
        extra = params_for(in_shapes, out_shapes) if params_for else {}
        r = apply(*xs, **extra)
        rs = list(r) if multi else [r]
        return tuple(x[None] if lay.partial else x for x, lay in zip(rs, out_layouts, strict=True))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(lay.physical_spec(axes) for lay in in_layouts),
                              out_specs=tuple(lay.physical_spec(axes) for lay in out_layouts), check_vma=False))
    got = f(*[jnp.asarray(x) for x in ins])
    worst = 0.0
    for k, (gk, wk, lay) in enumerate(zip(got, wants, out_layouts, strict=True)):
        g = np.asarray(gk)
        if lay.partial:
            g = g.sum(0)
        if g.shape != tuple(wk.shape):
            return Mismatch(math.inf, f"{name}: result {k} has shape {g.shape}, expected {tuple(wk.shape)}")
        err = _relerr(g, np.asarray(wk))
        worst = max(worst, err)
    return Mismatch(worst, name) if worst > 0 else None


def check_collective(edge: ReshardEdge, x: np.ndarray, layouts: Sequence[Layout], axes: MeshAxes, mesh: Mesh,
                     rng: np.random.Generator) -> float:
    """Relative error of one resharding step as the runtime lowers it: the value must not change."""
    mesh = auto_mesh(mesh)
    src, dst = layouts[edge.src], layouts[edge.dst]
    cpu = mesh.devices.flat[0].platform == "cpu"

    def body(v: Any) -> Any:
        v = apply_collective(v[0] if src.partial else v, edge, axes, cpu)
        return v[None] if dst.partial else v

    stacked = split_partial(x, src, axes, rng)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=src.physical_spec(axes),
                              out_specs=dst.physical_spec(axes), check_vma=False))
    got = np.asarray(f(jnp.asarray(stacked)))
    if dst.partial:
        got = got.sum(0)
    return _relerr(got, x)


def localized(name: str, params: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    def fn(ins: list, outs: list) -> dict[str, Any]:
        return local_params(name, params, ins, outs)
    return fn
