"""A step-time estimate of a plan's *compiled* program, independent of shardsat's cost model.

XLA compiles the plan (`plan.jit().lower(*args).compile()`, on the 8 simulated CPU devices);
the estimate reads only what the compiler produced: its cost analysis (FLOPs and bytes accessed
per device) and the collectives in its HLO, each priced alpha-beta on the profile's link by its
own buffer size and replica-group size (ring algorithms: an all-reduce moves 2(n-1)/n of its
buffer, an all-gather or a reduce-scatter (n-1)/n of the larger side; XLA:CPU's form of a
reduce-scatter, an all-reduce feeding a slice, is priced as the all-reduce it runs). Compute and memory overlap (the slower of the
two), communication does not: the same roofline for every plan, so the ratio of two plans'
estimates is what to read, not the microseconds.

Loops: XLA's cost analysis counts a while loop's body once whatever its trip count (measured,
jax 0.10.2: a scan of 4 or 16 matmuls reports the FLOPs of one). A body with a known trip count
n (XLA's `known_trip_count`) has its collectives counted n times, and n - 1 more copies of its
own bytes and dot FLOPs added, read from the HLO text (each instruction's operands and result;
the dots inside its fusions): an approximation of what the analysis leaves out.
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


_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_WHILE = re.compile(r"body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)\"")
_NOT_WORK = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """Each computation's instructions: (name, result shape, op, the rest of the line)."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    body: list[tuple[str, str, str, str]] = []
    for line in hlo.splitlines():
        c = _COMP.match(line)
        if c and "=" not in line.split("(")[0]:
            body = comps.setdefault(c.group(1), [])
            continue
        m = _INSTR.match(line)
        if m:
            body.append(m.groups())  # type: ignore[arg-type]
    return comps


def loop_multipliers(hlo: str) -> dict[str, int]:
    """Computation -> how many times it runs per step, for while bodies of known trip count
    (nested loops multiply); every other computation runs once."""
    comps = _computations(hlo)
    mult: dict[str, int] = {}
    order = list(comps)
    for _ in range(4):  # nested loops: a few passes reach the fixpoint
        for comp in order:
            for _, _, op, rest in comps[comp]:
                w = _WHILE.search(rest) if op == "while" else None
                if w:
                    mult[w.group(1)] = mult.get(comp, 1) * int(w.group(2))
    return mult


def _dot_flops(shape: str, rest: str, shapes: dict[str, str]) -> float:
    """2 x result elements x contracted size of one dot."""
    lhs = re.match(r"%?([\w.\-]+)", rest)
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    if not lhs or not dims or lhs.group(1) not in shapes:
        return 0.0
    lhs_dims = [int(d) for d in _ARRAY.findall(shapes[lhs.group(1)])[0][1].split(",") if d]
    k = int(np.prod([lhs_dims[int(i)] for i in dims.group(1).split(",") if i])) if dims.group(1) else 1
    out = sum(int(np.prod([int(d) for d in dd.split(",") if d])) if dd else 1 for _, dd in _ARRAY.findall(shape))
    return 2.0 * out * k


def _own_work(comps: dict[str, list[tuple[str, str, str, str]]], comp: str) -> tuple[float, float]:
    """(dot FLOPs, bytes) of one computation's instructions, the dots inside its fusions
    included, its nested loops' bodies not."""
    shapes = {name: shape for name, shape, _, _ in comps[comp]}
    flops = nbytes = 0.0
    for _, shape, op, rest in comps[comp]:
        if op in _NOT_WORK or op == "while":
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        nbytes += _shape_bytes(shape) + sum(_shape_bytes(shapes.get(o, "")) for o in operands)
        if op == "dot":
            flops += _dot_flops(shape, rest, shapes)
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        if called and called.group(1) in comps:
            inner = {n: sh for n, sh, _, _ in comps[called.group(1)]}
            flops += sum(_dot_flops(sh, r, inner) for _, sh, o, r in comps[called.group(1)] if o == "dot")
    return flops, nbytes


def loop_extra(hlo: str) -> tuple[float, float]:
    """(FLOPs, bytes) XLA's cost analysis leaves out of loops: n - 1 more runs of each body."""
    comps = _computations(hlo)
    flops = nbytes = 0.0
    for comp, n in loop_multipliers(hlo).items():
        if comp in comps and n > 1:
            f, b = _own_work(comps, comp)
            flops, nbytes = flops + (n - 1) * f, nbytes + (n - 1) * b
    return flops, nbytes


def collective_traffic(hlo: str, devices: int) -> list[tuple[str, int, int]]:
    """(kind, bytes on the wire per device, group size) of every collective in the HLO text,
    once per run (a loop body's as many times as the loop runs)."""
    out = []
    mult = loop_multipliers(hlo)
    comp = ""
    for line in hlo.splitlines():
        c = _COMP.match(line)
        if c and "=" not in line.split("(")[0]:
            comp = c.group(1)
            continue
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
        out += [(kind, int(wire), n)] * mult.get(comp, 1)
    return out


def compiled_step(plan: Any, args: tuple[Any, ...], profile: DeviceProfile) -> CompiledStep:
    """The roofline estimate of the compiled plan's step on `profile`'s devices."""
    compiled = plan.jit().lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    extra_flops, extra_bytes = loop_extra(hlo)
    flops = float(cost.get("flops", 0.0)) + extra_flops
    accessed = float(cost.get("bytes accessed", 0.0)) + extra_bytes
    traffic = collective_traffic(hlo, plan.mesh.devices.size)
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
