"""DeviceProfile.calibrate(mesh): the cost model's rates, measured on the mesh's own devices.

Every benchmark runs on all devices of the mesh at once (inside `shard_map`), as a plan does:
devices that share a host's memory or links are measured sharing them. Each runs its operation in
a loop inside one compiled program, at two loop lengths, and takes the difference: the time per
operation without the dispatch and synchronisation a call costs (which on a GPU would otherwise
pass for link latency). The fastest of a few runs is kept.

* matmul FLOP/s, float32 and bfloat16 (square matrices; the profile takes the faster: the cost
  model has one rate, and training runs in the fast dtype);
* HBM bandwidth: an elementwise update of a large buffer (read once, written once);
* per mesh axis (of more than one device): all-reduce, all-gather and reduce-scatter over several
  buffer sizes, fitted to the cost model's own alpha-beta form (extract/cost.py): seconds =
  latency + bytes moved / link bandwidth, with bytes moved as the cost model counts them (ring
  algorithms). One fit per axis gives the profile's link_bytes_per_s[axis] and latency_s[axis];
  the fit per collective kind is kept in `profile.measurements`.

On a mesh spanning several processes, every process measures and process 0's numbers are used by
all (processes that planned with different profiles could choose different plans).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..egraph.layout import auto_mesh
from ..extract.profile import DeviceProfile, get_profile
from .multihost import spans_processes

KINDS = ("all-reduce", "all-gather", "reduce-scatter")


@dataclass(frozen=True)
class Sizes:
    """How big and how often: per-device matmul side, copy bytes, collective buffer bytes."""

    matmul: int
    copy_bytes: int
    collective_bytes: tuple[int, ...]
    loop: int  # operations per timed run (and twice that)
    runs: int  # timed runs per program; the fastest counts


SIZES = {
    # accelerators: big enough to reach peak rates and to see the link's bandwidth past its latency
    "gpu": Sizes(4096, 1 << 30, (1 << 16, 1 << 20, 1 << 24, 1 << 27), 8, 5),
    "tpu": Sizes(4096, 1 << 30, (1 << 16, 1 << 20, 1 << 24, 1 << 27), 8, 5),
    # host devices share a few cores: small, or calibration takes minutes
    "cpu": Sizes(256, 1 << 24, (1 << 12, 1 << 15, 1 << 18, 1 << 20), 4, 3),
}
QUICK = Sizes(128, 1 << 20, (1 << 10, 1 << 16), 2, 2)


def calibrate(mesh: Mesh, *, quick: bool = False) -> DeviceProfile:
    """A DeviceProfile measured on `mesh` (see the module doc)."""
    platform = mesh.devices.flat[0].platform
    sizes = QUICK if quick else SIZES.get(platform, SIZES["gpu"])
    runtime = auto_mesh(mesh)
    t0 = time.perf_counter()
    flops = {str(np.dtype(d)): _matmul_rate(runtime, d, sizes) for d in (jnp.float32, jnp.bfloat16)}
    hbm = _copy_rate(runtime, sizes)
    fits: dict[str, dict[str, dict[str, float]]] = {}
    for axis, n in zip(runtime.axis_names, runtime.devices.shape, strict=True):
        if n > 1:
            fits[str(axis)] = _axis_fits(runtime, str(axis), int(n), sizes)
    numbers = _shared(np.asarray([*flops.values(), hbm] + [v for f in fits.values() for k in f.values()
                                                             for v in k.values()]), mesh)
    it = iter(numbers.tolist())
    flops = {k: next(it) for k in flops}
    hbm = next(it)
    fits = {a: {k: {m: next(it) for m in f[k]} for k in f} for a, f in fits.items()}
    return _profile(mesh, platform, flops, hbm, fits, time.perf_counter() - t0)


def _profile(mesh: Mesh, platform: str, flops: dict[str, float], hbm: float,
             fits: dict[str, dict[str, dict[str, float]]], seconds: float) -> DeviceProfile:
    preset = get_profile(None, platform)
    links = {a: f["all"]["link_bytes_per_s"] for a, f in fits.items()}
    lats = {a: f["all"]["latency_s"] for a, f in fits.items()}
    # axes of one device move nothing; '*' covers them (and meshes of one device)
    links["*"] = max(links.values(), default=hbm)
    lats["*"] = min(lats.values(), default=0.0)
    memory = _memory_bytes(mesh)
    return DeviceProfile(
        flops_per_s=max(flops.values()), hbm_bytes_per_s=hbm, link_bytes_per_s=links, latency_s=lats,
        name=f"calibrated-{platform}", combine_threshold_bytes=preset.combine_threshold_bytes,
        combine_max=preset.combine_max, memory_bytes=memory if memory is not None else preset.memory_bytes,
        measurements={"matmul_flops_per_s": flops, "hbm_bytes_per_s": hbm, "collectives": fits,
                      "device_kind": str(getattr(mesh.devices.flat[0], "device_kind", platform)),
                      "devices": int(mesh.devices.size), "seconds": seconds},
    )


def _memory_bytes(mesh: Mesh) -> float | None:
    """The allocator's limit on one device (GPUs and TPUs report it; CPUs do not)."""
    try:
        stats = mesh.devices.flat[0].memory_stats() or {}
    except Exception:  # pragma: no cover - backends without memory stats
        return None
    limit = stats.get("bytes_limit")
    return float(limit) if limit else None


def _shared(values: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Process 0's numbers in every process of a multi-process mesh."""
    if not spans_processes(mesh):
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(values.astype(np.float32)), dtype=np.float64)


# -- timing -----------------------------------------------------------------------------------------
def _per_op(program: Callable[[int], Any], sizes: Sizes) -> float:
    """Seconds per operation: `program(loop)` and `program(2 * loop)` (one compiled program, the
    loop count an argument) timed, fastest of `runs` after a warm-up, and differenced. Noise
    that makes the difference vanish falls back to the longer run's time per operation."""
    best = []
    for loop in (sizes.loop, 2 * sizes.loop):
        jax.block_until_ready(program(loop))
        times = []
        for _ in range(sizes.runs):
            t = time.perf_counter()
            jax.block_until_ready(program(loop))
            times.append(time.perf_counter() - t)
        best.append(min(times))
    diff = (best[1] - best[0]) / sizes.loop
    return diff if diff > 0.05 * best[1] / (2 * sizes.loop) else best[1] / (2 * sizes.loop)


def _local_program(mesh: Mesh, shape: tuple[int, ...], dtype: Any, body: Callable[[Any], Any]) -> Callable[[int], Any]:
    """A compiled program that runs `body` a given number of times on a buffer of `shape` on
    every device; its result is one scalar per device (nothing large goes back)."""
    spec = P(tuple(str(a) for a in mesh.axis_names))
    n = mesh.devices.size

    def local(x: Any, loop: Any) -> Any:
        x = lax.fori_loop(0, loop, lambda i, x: body(x), x)
        return x.reshape(-1)[:1].astype(jnp.float32)

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False)
    make = jax.jit(lambda: jnp.full((n * shape[0], *shape[1:]), 1.0, dtype), out_shardings=NamedSharding(mesh, spec))
    x = make()
    run = jax.jit(mapped)
    counts = {}

    def program(loop: int) -> Any:
        if loop not in counts:
            counts[loop] = jax.device_put(np.int32(loop), NamedSharding(mesh, P()))
        return run(x, counts[loop])

    return program


def _matmul_rate(mesh: Mesh, dtype: Any, sizes: Sizes) -> float:
    n = sizes.matmul
    b = jnp.full((n, n), 1.0 / n, dtype)  # keeps values at 1: no denormals, no overflow
    seconds = _per_op(_local_program(mesh, (n, n), dtype, lambda x: x @ b), sizes)
    return 2.0 * n**3 / seconds


def _copy_rate(mesh: Mesh, sizes: Sizes) -> float:
    elems = sizes.copy_bytes // 4
    seconds = _per_op(_local_program(mesh, (elems,), jnp.float32, lambda x: x * 0.5 + 1.0), sizes)
    return 2.0 * sizes.copy_bytes / seconds  # read once, written once


def _collective_body(kind: str, axis: str, n: int, elems: int) -> Callable[[Any], Any]:
    """One collective on a per-device buffer of `elems` float32, returning a buffer of the same
    size that depends on its result (so the loop cannot skip or merge them)."""
    if kind == "all-reduce":
        return lambda x: lax.psum(x, axis) * (1.0 / n)
    if kind == "all-gather":
        return lambda x: lax.all_gather(x, axis, tiled=True)[elems // 2: elems // 2 + elems] * 0.5 + 0.5
    return lambda x: jnp.tile(lax.psum_scatter(x, axis, tiled=True), n) * (1.0 / n)


def moved_bytes(kind: str, n: int, buffer_bytes: float) -> float:
    """Bytes each device sends, as the cost model counts them (extract/cost.py), for a
    per-device input buffer of `buffer_bytes`."""
    frac = (n - 1) / n
    if kind == "all-gather":
        return frac * n * buffer_bytes  # the cost model charges the gathered (destination) buffer
    if kind == "all-reduce":
        return 2 * frac * buffer_bytes
    return frac * buffer_bytes


def _axis_fits(mesh: Mesh, axis: str, n: int, sizes: Sizes) -> dict[str, dict[str, float]]:
    """Per collective kind and all kinds together: the alpha-beta fit on this axis."""
    points: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for kind in KINDS:
        for nbytes in sizes.collective_bytes:
            elems = max(n, nbytes // 4 // n * n)  # reduce-scatter splits it n ways
            body = _collective_body(kind, axis, n, elems)
            seconds = _per_op(_local_program(mesh, (elems,), jnp.float32, body), sizes)
            points[kind].append((moved_bytes(kind, n, 4.0 * elems), seconds))
    out = {k: fit(p) for k, p in points.items()}
    out["all"] = fit([pt for p in points.values() for pt in p])
    return out


def fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least-squares seconds = latency + bytes / bandwidth over (bytes, seconds) points. A
    negative latency (noise) is taken as 0 with the bandwidth refitted through the origin; a
    slope that is not positive falls back to the largest point's bytes per second."""
    x = np.asarray([p[0] for p in points], dtype=np.float64)
    y = np.asarray([p[1] for p in points], dtype=np.float64)
    slope, intercept = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (y.mean() / x.mean(), 0.0)
    if intercept < 0:
        slope, intercept = float((x @ y) / (x @ x)), 0.0
    if not slope > 0 or not math.isfinite(slope):
        k = int(np.argmax(x))
        slope = y[k] / x[k]
    return {"link_bytes_per_s": float(1.0 / slope), "latency_s": float(intercept)}
