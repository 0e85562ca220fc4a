"""A step-time estimate of a plan's *compiled* program, independent of shardsat's cost model.

XLA compiles the plan (`plan.jit().lower(*args).compile()`, on the 8 simulated CPU devices);
the estimate reads only what the compiler produced: its cost analysis (FLOPs and bytes accessed
per device) and the collectives in its HLO, each priced alpha-beta on the profile's link by its
own buffer size and replica-group size (ring algorithms: an all-reduce moves 2(n-1)/n of its
buffer, an all-gather or a reduce-scatter (n-1)/n of the larger side; XLA:CPU's form of a
reduce-scatter, an all-reduce feeding a slice, is priced as the all-reduce it runs). Compute and memory overlap (the slower of the
two), communication does not: the same roofline for every plan, so the ratio of two plans'
estimates is what to read, not the microseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardsat import DeviceProfile

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_COLL = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                   r"(?:-start)?\((.*)$")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")


@dataclass
class CompiledStep:
    flops: float
    bytes_accessed: float
    comm_bytes: float  # per device, over the links
    collectives: int
    compute_us: float
    comm_us: float

    @property
    def total_us(self) -> float:
        return self.compute_us + self.comm_us


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _BYTES.get(dtype, 4)
    return total


def _group_size(rest: str, devices: int) -> int:
    m = _IOTA.search(rest)
    if m:
        return int(m.group(1).split(",")[-1])
    m = _LIST.search(rest)
    if m:
        return max(1, len([d for d in m.group(1).split(",") if d]))
    return devices


def collective_traffic(hlo: str, devices: int) -> list[tuple[str, int, int]]:
    """(kind, bytes on the wire per device, group size) of every collective in the HLO text."""
    out = []
    for line in hlo.splitlines():
        m = _COLL.search(line)
        if not m or "-done" in line.split("=")[1].split("(")[0]:
            continue
        shape, kind, rest = m.groups()
        n = _group_size(rest, devices)
        if n <= 1:
            continue
        result = _shape_bytes(shape)
        operand = _shape_bytes(rest.split("),")[0]) or result
        if kind == "all-reduce":
            wire = 2 * (n - 1) / n * result
        elif kind in ("all-gather", "reduce-scatter"):
            wire = (n - 1) / n * max(result, operand)
        else:
            wire = (n - 1) / n * result
        out.append((kind, int(wire), n))
    return out


def compiled_step(plan: Any, args: tuple[Any, ...], profile: DeviceProfile) -> CompiledStep:
    """The roofline estimate of the compiled plan's step on `profile`'s devices."""
    compiled = plan.jit().lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost.get("flops", 0.0))
    accessed = float(cost.get("bytes accessed", 0.0))
    traffic = collective_traffic(compiled.as_text(), plan.mesh.devices.size)
    wire = sum(b for _, b, _ in traffic)
    compute = max(flops / profile.flops_per_s, accessed / profile.hbm_bytes_per_s)
    link, latency = _slowest(profile.link_bytes_per_s, min), _slowest(profile.latency_s, max)
    comm = sum(latency + b / link for _, b, _ in traffic)
    return CompiledStep(flops, accessed, wire, len(traffic), compute * 1e6, comm * 1e6)


def _slowest(rate: Any, pick: Any) -> float:
    """A per-axis rate's slowest axis (the HLO does not say which axis a group spans)."""
    return float(pick(rate.values())) if hasattr(rate, "values") else float(rate)


def unsharded_flops(fn: Any, args: tuple[Any, ...]) -> float:
    """FLOPs of the program compiled for one device (XLA's count)."""
    import jax

    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def compiled_mib(compiled: Any) -> float:
    """Per-device MiB of a compiled program as memory_analysis() gives it: arguments + outputs
    not aliased to a donated argument + temporaries."""
    ma = compiled.memory_analysis()
    return (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes) / 2**20
