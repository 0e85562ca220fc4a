"""Random planning options of a fuzz case: the mesh (shape, axis names, Auto or Explicit axes),
how arguments are placed, pins, state_argnums, memory_limit, extraction, fold_loops, fallback,
priors.

Options are drawn from their own random stream (so changing how programs are drawn does not
change a seed's options, and the other way round) and only valid ones are drawn: pins whose axes
divide the pinned dims, state_argnums only for steps that return their state, memory limits
either loose (a replicated plan fits) or marked "tight" (where NoPlanError may be correct).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MESHES: dict[str, tuple[int, ...]] = {"8": (8,), "1x8": (1, 8), "2x4": (2, 4), "4x2": (4, 2), "2x2x2": (2, 2, 2)}
AXIS_NAMES = {
    1: [("data",), ("x",), ("batch",)],
    2: [("data", "model"), ("dp", "tp"), ("fsdp", "tensor"), ("x", "y")],
    3: [("data", "fsdp", "tensor"), ("x", "y", "z"), ("dp", "sp", "tp")],
}
PROFILES = (None, "h100", "cpu", "tpu_v5e", "h200")


@dataclass
class CaseOptions:
    """Everything but the program: how the case is planned and run."""

    mesh_name: str
    axis_names: tuple[str, ...]
    axis_types: tuple[str, ...]  # "auto" | "explicit", per axis
    placement: str = "none"  # "none" | "replicated" | "sharded": arguments committed to the mesh
    set_mesh: bool = False  # run both functions under `with jax.set_mesh(mesh)`
    profile: str | None = None
    pin_inputs: bool = False
    pin_outputs: bool = False
    state_argnums: Any = None
    memory: str = "default"  # "default" | "none" | "loose" | "tight"
    extraction: str | None = None
    fold_loops: bool | None = None
    fallback: str | None = None
    priors: str | None = "auto"  # "families" / "builtin" narrow every multi-axis case's layouts (egraph/narrow.py)
    # resolved once the program's shapes are known (make_program)
    in_shardings: Any = None
    out_shardings: Any = None
    memory_limit: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return MESHES[self.mesh_name]

    @property
    def explicit(self) -> bool:
        return "explicit" in self.axis_types

    def mesh(self) -> Any:
        return _mesh(self.shape, self.axis_names, self.axis_types)

    def mesh_label(self) -> str:
        kinds = {"auto": "A", "explicit": "E"}
        return self.mesh_name + "/" + "".join(kinds[t] for t in self.axis_types)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of saturate_and_extract (only those that differ from the defaults)."""
        kw: dict[str, Any] = {}
        if self.profile is not None:
            kw["profile"] = self.profile
        if self.fallback is not None:
            kw["fallback"] = self.fallback
        if self.in_shardings is not None:
            kw["in_shardings"] = self.in_shardings
        if self.out_shardings is not None:
            kw["out_shardings"] = self.out_shardings
        if self.state_argnums is not None:
            kw["state_argnums"] = self.state_argnums
        if self.memory != "default":
            kw["memory_limit"] = self.memory_limit
        if self.extraction is not None:
            kw["extraction"] = self.extraction
        if self.fold_loops is not None:
            kw["fold_loops"] = self.fold_loops
        if self.priors != "auto":
            kw["priors"] = self.priors
        return kw

    def summary(self) -> str:
        parts = [f"mesh={self.mesh_name}{self.axis_names}{'/'.join(self.axis_types)}"]
        if self.placement != "none":
            parts.append(f"args committed {self.placement}")
        if self.set_mesh:
            parts.append("under jax.set_mesh")
        kw = {k: v for k, v in self.kwargs().items() if k not in ("in_shardings", "out_shardings")}
        if self.memory in ("loose", "tight"):
            kw["memory_limit"] = f"{self.memory_limit} ({self.memory})"
        parts += [f"{k}={v}" for k, v in kw.items()]
        if self.pin_inputs:
            parts.append("in_shardings pinned")
        if self.pin_outputs:
            parts.append("out_shardings pinned")
        return ", ".join(parts)


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...], types: tuple[str, ...]) -> Any:
    import jax

    kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    return jax.make_mesh(shape, names, axis_types=tuple(kinds[t] for t in types))


def draw_options(rng: np.random.Generator, *, train: bool, has_opt_state: bool) -> CaseOptions:
    """Random options; pins and memory limits are resolved later, from the program's shapes."""
    def pick(options: list[Any] | tuple[Any, ...], p: list[float] | None = None) -> Any:
        return options[int(rng.choice(len(options), p=None if p is None else np.asarray(p) / sum(p)))]

    name = pick(list(MESHES))
    n_axes = len(MESHES[name])
    axis_names = pick(AXIS_NAMES[n_axes])
    mode = pick(["auto", "explicit", "mixed"], [0.5, 0.4, 0.1] if n_axes > 1 else [0.55, 0.45, 0.0])
    if mode == "mixed":
        types = tuple(pick(["auto", "explicit"]) for _ in range(n_axes))
        types = types if len(set(types)) > 1 else ("explicit",) + ("auto",) * (n_axes - 1)
    else:
        types = (mode,) * n_axes
    o = CaseOptions(name, axis_names, types)
    if "explicit" in types:
        o.placement = pick(["replicated", "sharded", "none"], [0.45, 0.45, 0.1])
        o.set_mesh = bool(rng.random() < 0.4)
    else:
        o.placement = pick(["none", "replicated", "sharded"], [0.7, 0.1, 0.2])
    o.profile = pick(PROFILES)
    o.pin_inputs = bool(rng.random() < 0.2)
    o.pin_outputs = bool(rng.random() < 0.15)
    if train:
        o.state_argnums = pick([None, "auto", (0,), (0, 1)] if has_opt_state else [None, "auto", (0,)])
    elif rng.random() < 0.05:
        o.state_argnums = "auto"
    o.memory = pick(["default", "none", "loose", "tight"], [0.6, 0.2, 0.16, 0.04])
    o.extraction = pick([None, "greedy", "exact", "auto"], [0.4, 0.3, 0.15, 0.15])
    o.fold_loops = pick([None, True, False], [0.6, 0.25, 0.15])
    o.fallback = pick([None, "replicate"], [0.5, 0.5])
    # drawn last: the options above stay what they were for every seed
    o.priors = pick(["auto", "families", "builtin", None], [0.6, 0.2, 0.15, 0.05]) if n_axes > 1 else "auto"
    if o.state_argnums is not None:
        o.pin_outputs = False  # an output pin on returned state could contradict its input pin
    return o


def random_spec(rng: np.random.Generator, shape: tuple[int, ...], mesh_shape: dict[str, int]) -> Any:
    """A PartitionSpec valid for `shape`: each dim replicated or split over unused axes (one, or
    two together) whose sizes divide it."""
    from jax.sharding import PartitionSpec as P

    free = list(mesh_shape)
    spec: list[Any] = []
    for d in shape:
        groups: list[tuple[str, ...]] = [(a,) for a in free if d % mesh_shape[a] == 0]
        groups += [(a, c) for i, a in enumerate(free) for c in free[i + 1:]
                   if d % (mesh_shape[a] * mesh_shape[c]) == 0]
        g = groups[int(rng.integers(len(groups)))] if groups and rng.random() < 0.6 else ()
        free = [a for a in free if a not in g]
        spec.append(None if not g else g[0] if len(g) == 1 else g)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize
