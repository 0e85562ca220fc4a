"""Where one plan's peak of temporaries is, in the estimate and in XLA's compiled program, side
by side: the buffers live at each one's peak, largest first.

    .venv/bin/python benchmarks/memory_peak.py --probe topk_moe_train --mesh 2,4
    .venv/bin/python benchmarks/memory_peak.py --workload "MLP4 train" --mesh 8 --plan DP+WUS

`--probe` names a program of benchmarks/memory_probe.py (planned freely), `--workload` one of
the expert benchmark's (benchmarks/memory.py's rows: `--plan` shardsat or an expert's name).
XLA's side is read from the compiled program's buffer assignment and live ranges (an XLA dump
into a temporary directory, kept with `--keep`): the values of the temp heap
(`preallocated-temp`) live at the instruction where the most of them are, and the heap's size,
which is more where its best-fit packing leaves holes.

Why: every fact of XLA:CPU in issue 14's notes was found by reading such a dump by hand; this
prints the two peaks at once, so a row of benchmarks/memory.py or memory_probe.py outside the
band shows at a glance what the estimate holds that XLA does not, and the other way round.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2**20


@dataclass
class XlaValue:
    name: str  # the instruction, with its tuple index: `all-to-all.10{1}`, `ynn_fusion{}`
    size: int
    start: int  # positions in the entry computation's schedule
    end: int
    shape: str
    offset: int = 0  # in the heap
    op_name: str = ""  # the jax operation XLA's metadata names


@dataclass
class XlaPeak:
    heap: int  # the temp heap's size (memory_analysis().temp_size_in_bytes, less thread-locals)
    live: int  # the most bytes of it in use at once
    at: int  # where: a position in the schedule
    instruction: str
    values: list[XlaValue] = field(default_factory=list)  # live there, largest first


def xla_peak(dump: Path) -> XlaPeak:
    """XLA's temp heap at its peak, from a dump of one compiled module (after optimizations)."""
    assignment = _one(dump, "after_optimizations-buffer-assignment.txt").read_text()
    ranges_text = _one(dump, "after_optimizations-live-range.txt").read_text()
    hlo = _one(dump, "after_optimizations.txt").read_text()
    schedule_text, _, ranges_part = ranges_text.partition("BufferLiveRange:")
    schedule = {int(i): n for i, n in re.findall(r"^\s+(\d+):(\S+)$", schedule_text, re.M)}
    ranges = {n: (int(s), int(e)) for n, s, e in re.findall(r"^\s+(\S+):(\d+)-(\d+)$", ranges_part, re.M)}
    ops = dict(re.findall(r'^\s+(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"', hlo, re.M))
    heap, values = 0, []
    for alloc in re.split(r"^allocation ", assignment, flags=re.M):
        head = alloc.split("\n", 1)[0]
        if "preallocated-temp" not in head:
            continue
        heap += int(re.search(r"size (\d+)", head)[1])  # type: ignore[index]
        for name, size, off, shape in re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)",
                                                 alloc):
            key = name if "{" in name else name + "{}"
            if key in ranges:
                values.append(XlaValue(key, int(size), *ranges[key], shape, int(off), ops.get(name.split("{")[0], "")))
    best, at = 0, 0
    for t in sorted({v.start for v in values}):
        live = _in_use([v for v in values if v.start <= t <= v.end])
        if live > best:
            best, at = live, t
    here = sorted((v for v in values if v.start <= at <= v.end), key=lambda v: -v.size)
    return XlaPeak(heap, best, at, schedule.get(at, "?"), here)


def _in_use(values: list[XlaValue]) -> int:
    """Bytes of the heap the values cover: an op writing into the operand dying where it runs
    shares its offset, and both are live at that instant."""
    total, top = 0, 0
    for lo, hi in sorted((v.offset, v.offset + v.size) for v in values):
        total += max(0, hi - max(lo, top))
        top = max(top, hi)
    return total


def _one(dump: Path, suffix: str) -> Path:
    """The dump's file whose name ends with `suffix` (one module is dumped: the planned one)."""
    found = sorted(p for p in dump.iterdir() if p.name.endswith(suffix))
    if not found:
        raise FileNotFoundError(f"no *{suffix} in {dump}")
    return found[-1]


def model_peak(plan: Any) -> tuple[int, str, list[tuple[int, str]]]:
    """The estimate's peak of temporaries: (bytes, where, [(bytes, what)]) for the tagged
    buffers live there (a collective's pieces as one), from a MemoryModel built as planning
    builds it. An argument in its own layout is a copy of it (copy insertion, a loop state)."""
    from shardsat.extract.memory import MemoryModel

    mm = MemoryModel(plan.program, plan.graph, plan.spaces, ties=tuple(plan.ties), pins=plan.arg_pins,
                     tables=plan.tables)
    peak = mm.peak(plan.extraction)
    tl = mm.timeline
    rows = []
    for (k, lid), size in peak.live:
        t = tl.made_at.get(k)
        e = tl.seq[t] if t is not None else None
        v = tl.program.values[tl.rep[k]] if k in tl.rep else None
        spec = plan.spaces.layouts[lid].spec(plan.axes)
        moved = k in tl.rep and plan.produced.get(tl.rep[k], lid) != lid  # a collective's result
        what = (f"{e.primitive if e is not None else 'argument'} {v.dtype}{list(v.shape)} {spec}"
                + (" (resharded) " if moved else " (a copy) " if e is None else " ")
                + (f"made at {t} ({e.source})" if e is not None else "") if v is not None else f"key {k} layout {lid}")
        rows.append((size, what))
    at = tl.seq[peak.time] if peak.time < len(tl.seq) else None
    where = f"position {peak.time} of {len(tl.seq)}" + (f", {at.primitive} at {at.source}" if at is not None else "")
    return peak.bytes, where, rows


def build(ns: argparse.Namespace) -> Any:
    """The memory.Case to plan."""
    import jax
    import memory
    import memory_probe

    shape = tuple(int(s) for s in ns.mesh.split(","))
    if ns.probe:
        mesh = jax.make_mesh(shape, ("data", "model") if len(shape) == 2 else ("data", "fsdp", "model")[-len(shape):])
        fn, args = memory_probe.PROGRAMS[ns.probe]()
        return memory.Case(ns.probe, shape, "shardsat", fn, args, None, None, mesh)
    cases = [c for c in memory.expert_cases(ns.workload, [shape]) if c.plan == ns.plan]
    if not cases:
        raise SystemExit(f"no expert-benchmark case {ns.workload!r} on {shape} with plan {ns.plan!r}")
    return cases[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--probe", help="a program of benchmarks/memory_probe.py")
    which.add_argument("--workload", help="an expert-benchmark workload (name substring)")
    ap.add_argument("--plan", default="shardsat", help="with --workload: shardsat or an expert's name")
    ap.add_argument("--mesh", required=True, help="mesh shape, e.g. 2,4")
    ap.add_argument("--profile", default=None, help="device profile preset (default: as memory.py / memory_probe.py)")
    ap.add_argument("--top", type=int, default=25, help="buffers to list per side")
    ap.add_argument("--keep", action="store_true", help="keep the XLA dump and print its directory")
    ns = ap.parse_args(argv)

    import shardsat

    case = build(ns)
    profile = ns.profile or ("h100" if ns.workload else None)
    plan = shardsat.saturate_and_extract(case.fn, case.mesh, *case.args, profile=profile,
                                         state_argnums=case.state_argnums, in_shardings=case.pins, memory_limit=None)
    dump = Path(tempfile.mkdtemp(prefix="shardsat-xla-dump-"))
    try:
        compiled = plan.jit().lower(*case.args).compile(compiler_options={
            "xla_dump_to": str(dump), "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "^$"})
        ma = compiled.memory_analysis()
        xla = xla_peak(dump)
    finally:
        if ns.keep:
            print(f"XLA dump: {dump}")
        else:
            shutil.rmtree(dump, ignore_errors=True)
    m = plan.cost.memory
    est, where, rows = model_peak(plan)
    print(f"{case.workload} on {ns.mesh}, plan {case.plan}: total predicted / compiled "
          f"{m.total / MIB:.2f} / {plan.compiled_memory(*case.args) / MIB:.2f} MiB")
    print(f"\nestimate: temps {m.activations_peak / MIB:.3f} MiB; its peak {est / MIB:.3f} MiB at {where}")
    for size, what in rows[:ns.top]:
        print(f"  {size / MIB:8.3f} MiB  {what}")
    # what no value names: collectives' transients, transposed copies, pieces, and the holes the
    # best-fit packing leaves (buffers.packed_heap), which the list above cannot show
    print(f"  {(est - sum(size for size, _ in rows)) / MIB:8.3f} MiB  unnamed: transients, copies, packing holes")
    print(f"\nXLA:CPU: temps {ma.temp_size_in_bytes / MIB:.3f} MiB; heap {xla.heap / MIB:.3f} MiB, of which "
          f"at most {xla.live / MIB:.3f} in use at once, at {xla.at} ({xla.instruction})")
    for v in xla.values[:ns.top]:
        print(f"  {v.size / MIB:8.3f} MiB  {v.name:32s} {v.start}-{v.end}  {v.shape}  {v.op_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
