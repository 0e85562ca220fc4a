"""Shared pieces of the expert-layout benchmark: meshes, PartitionSpec helpers, the case runner and
the markdown table.

A case is one workload on one mesh. It is planned once freely ("shardsat": nothing pinned) and once
per hand-written expert layout, whose argument layouts (parameters, optimizer state, batch) are
pinned through `in_shardings`; outputs stay free. Every plan comes from the same
`shardsat.saturate_and_extract` call under the same cost model (H100 profile), so an expert's
intermediates are the extractor's best completion given its pins. Recorded per plan: the predicted
step time (`plan.cost.total_s`), the collective counts and the planning wall time. Nothing is
allocated, compiled or run: all arguments are `jax.ShapeDtypeStruct`s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardsat

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    # for `models` (transformer.py); appended so that examples/mlp.py cannot shadow ./mlp.py
    sys.path.append(str(EXAMPLES))

F32 = jnp.float32
MeshShape = tuple[int, ...]
ALL_MESHES: tuple[MeshShape, ...] = ((8,), (2, 4), (4, 2), (2, 2, 2))
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
FAIL_TOLERANCE = 0.999  # an expert cheaper than 0.999x the free plan is a search failure


def S(*shape: int, dtype: Any = F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


# -- meshes ---------------------------------------------------------------------------------------


def make_mesh(shape: MeshShape) -> Mesh:
    names = {1: ("data",), 2: ("data", "model"), 3: ("data", "fsdp", "model"),
             4: ("data", "fsdp", "seq", "model")}[len(shape)]
    n = 1
    for s in shape:
        n *= s
    return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def mesh_label(mesh: Mesh) -> str:
    return "x".join(f"{n}{s}" for n, s in mesh.shape.items())


def parse_mesh(text: str) -> MeshShape:
    return tuple(int(s) for s in text.split(","))


@dataclass(frozen=True)
class Axes:
    """How the expert layouts use a mesh: `all` every axis, `tp` the tensor-parallel axis ("model",
    or the only axis of a 1-D mesh), `dp` the other axes of a mesh with "model" (empty on 1-D) and
    `dp_size` their device count."""

    all: tuple[str, ...]
    tp: str
    dp: tuple[str, ...]
    dp_size: int


def axes_of(mesh: Mesh) -> Axes:
    names = tuple(mesh.axis_names)
    if "model" not in mesh.shape:
        return Axes(all=names, tp=names[0], dp=(), dp_size=1)
    dp = tuple(a for a in names if a != "model")
    size = 1
    for a in dp:
        size *= mesh.shape[a]
    return Axes(all=names, tp="model", dp=dp, dp_size=size)


# -- PartitionSpec helpers ------------------------------------------------------------------------


def largest_divisible_dim(shape: tuple[int, ...], n: int, taken: tuple[int, ...] = ()) -> int | None:
    """The largest dimension (first on ties) that `n` divides, skipping `taken`."""
    for d in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        if d not in taken and shape[d] % n == 0:
            return d
    return None


def fsdp_spec(x: Any, axes: tuple[str, ...], n: int) -> P:
    """`axes` (together, `n` devices) on the largest dimension of `x` they divide; else replicated."""
    d = largest_divisible_dim(x.shape, n)
    if d is None:
        return P()
    return P(*[(axes if i == d else None) for i in range(d + 1)])


def add_fsdp(spec: P, x: Any, axes: tuple[str, ...], n: int) -> P:
    """`spec` with `axes` (`n` devices) added on the largest free dimension of `x` they divide."""
    if not x.shape:
        return spec
    taken = tuple(i for i, s in enumerate(spec) if s is not None)
    d = largest_divisible_dim(x.shape, n, taken)
    if d is None:
        return spec
    parts = list(spec) + [None] * (len(x.shape) - len(spec))
    parts[d] = axes if len(axes) > 1 else axes[0]
    return P(*parts)


def leaf_name(path: tuple[Any, ...]) -> str:
    """The last dict key on a pytree path ("" if none)."""
    for k in reversed(path):
        if isinstance(k, jax.tree_util.DictKey):
            return str(k.key)
    return ""


def tree_specs(params: Any, fn: Callable[[tuple[Any, ...], Any], P]) -> Any:
    """A spec tree like `params`: fn(path, leaf) for each leaf."""
    return jax.tree_util.tree_map_with_path(fn, params)


def replicated(params: Any) -> Any:
    return jax.tree_util.tree_map(lambda _: P(), params)


def opt_specs(opt_state: Any, param_specs: Any) -> Any:
    """Specs for an optax state: the `mu`/`nu` subtrees mirror `param_specs`, scalars replicated."""
    flat = {jax.tree_util.keystr(p): s for p, s in
            jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=lambda x: isinstance(x, P))[0]}

    def f(path: tuple[Any, ...], x: Any) -> P:
        if not x.shape:
            return P()
        for i, k in enumerate(path):
            if isinstance(k, jax.tree_util.GetAttrKey) and k.name in ("mu", "nu"):
                return flat[jax.tree_util.keystr(path[i + 1:])]
        raise KeyError(path)

    return jax.tree_util.tree_map_with_path(f, opt_state)


def adamw_step(loss_fn: Callable[[Any, Any], jax.Array]) -> tuple[Any, Callable[..., Any]]:
    """(optimizer, step) for AdamW on `loss_fn(params, batch)`; state = (params, opt_state)."""
    import optax

    opt = optax.adamw(1e-3, weight_decay=0.01)

    def step(state: tuple[Any, Any], batch: Any) -> tuple[tuple[Any, Any], jax.Array]:
        params, o = state
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        u, o = opt.update(g, o, params)
        return (optax.apply_updates(params, u), o), loss

    return opt, step


# -- cases ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """What is planned on one mesh: fn(*args), and per expert the `in_shardings` it pins."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    experts: dict[str, Any]
    state_argnums: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    meshes: tuple[MeshShape, ...]
    build: Callable[[Mesh], Problem]


@dataclass
class Result:
    plan: str
    wall_s: float
    total_us: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    def collectives(self) -> str:
        return "/".join(str(self.counts.get(k, 0)) for k in COLLECTIVES)


@dataclass
class Row:
    workload: str
    mesh: str
    free: Result
    experts: list[Result]

    def best(self) -> Result | None:
        ok = [r for r in self.experts if r.total_us is not None]
        return min(ok, key=lambda r: r.total_us or 0.0) if ok else None

    def failed(self) -> bool:
        b = self.best()
        return (b is not None and self.free.total_us is not None
                and b.total_us is not None and b.total_us < self.free.total_us * FAIL_TOLERANCE)

    def markdown(self) -> str:
        f, b = self.free, self.best()
        exs = ", ".join(f"{r.plan} {r.total_us:.1f} ({r.collectives()})" if r.total_us is not None
                        else f"{r.plan} ERR" for r in self.experts)
        if f.total_us is not None and b is not None and b.total_us is not None:
            ratio = f"{b.total_us / f.total_us:.3f}" + (" **FAIL**" if self.failed() else "")
            fs = f"{f.total_us:.1f} ({f.collectives()})"
        else:
            ratio = "-"
            fs = f"{f.total_us:.1f} ({f.collectives()})" if f.total_us is not None else f"ERR {f.error or '?'}"[:80]
        walls = f"{f.wall_s:.1f}; {max([r.wall_s for r in self.experts] or [0.0]):.1f}"
        return f"| {self.workload} | {self.mesh} | {fs} | {exs} | {ratio} | {walls} |"


TABLE_HEADER = ("| workload | mesh | shardsat us (AR/RS/AG/A2A) | experts us | best/shardsat "
                "| plan s (free; max expert) |\n|---|---|---|---|---|---|")


def plan_one(name: str, mesh: Mesh, problem: Problem, pins: Any, profile: str) -> Result:
    t = time.perf_counter()
    try:
        plan = shardsat.saturate_and_extract(problem.fn, mesh, *problem.args, profile=profile,
                                             state_argnums=problem.state_argnums, in_shardings=pins)
    except Exception as e:  # a failing plan is a table entry, not the end of the run
        return Result(name, time.perf_counter() - t, error=f"{type(e).__name__}: {e}"[:500])
    wall = time.perf_counter() - t
    return Result(name, wall, total_us=plan.cost.total_s * 1e6, counts=dict(plan.cost.count()))


def run_case(workload: Workload, shape: MeshShape, profile: str = "h100") -> Row:
    mesh = make_mesh(shape)
    problem = workload.build(mesh)
    free = plan_one("shardsat", mesh, problem, None, profile)
    experts = [plan_one(name, mesh, problem, pins, profile) for name, pins in problem.experts.items()]
    return Row(workload.name, mesh_label(mesh), free, experts)
