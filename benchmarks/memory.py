"""Predicted vs compiled memory per device: shardsat's estimate (`plan.cost.memory`) against XLA's
`plan.jit().lower(*args).compile().memory_analysis()`, for every workload of the expert benchmark
(benchmarks/experts/: each mesh, the free plan and each pinned expert plan) and the workloads of
benchmarks/workloads.py (meshes 1x8 and 2x4: free, data-parallel and Megatron pins), on 8
simulated CPU devices.

    .venv/bin/python benchmarks/memory.py                        # everything (~30 min on 2 cores)
    .venv/bin/python benchmarks/memory.py --only MLP --meshes 8  # a subset
    .venv/bin/python benchmarks/memory.py --out FILE.md          # also write the table to FILE.md

Why: `memory_limit` means what it says only if the estimate is what XLA allocates. Compiled total
= argument + output - alias + temp (donated loop-carried state is written in place: aliased,
counted once); predicted total = arguments + outputs not written into a donated buffer + the peak
of temporaries. A row fails (exit status 1) where the ratio predicted/compiled is outside
[0.95, 1.10]: an estimate that is low accepts plans that do not fit.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import datetime
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE / "experts"), str(HERE)]  # this checkout's shardsat

import misc  # noqa: E402
import mlp  # noqa: E402
import transformer  # noqa: E402
import workloads as classic  # noqa: E402
from common import make_mesh, mesh_label, parse_mesh  # noqa: E402

import shardsat  # noqa: E402
from shardsat.runtime.hlo import copied_arguments  # noqa: E402

LOW, HIGH = 0.95, 1.10  # acceptance band of predicted / compiled total
MiB = 2**20


@dataclass(frozen=True)
class Case:
    """One plan to measure: fn(*args) on a mesh, with `pins` as in_shardings (None: free)."""

    workload: str
    shape: tuple[int, ...]
    plan: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    pins: Any
    state_argnums: tuple[int, ...] | None
    mesh: Any


@dataclass
class Row:
    case: Case
    predicted: tuple[int, int, int] | None = None  # argument, output, temp
    compiled: tuple[int, int, int, int] | None = None  # argument, output, alias, temp
    error: str | None = None
    wall_s: float = 0.0
    copies: tuple[list[str], list[str]] | None = None  # donated arguments copied: predicted, XLA's

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or self.compiled is None:
            return None
        a, o, al, t = self.compiled
        return sum(self.predicted) / max(a + o - al + t, 1)

    def failed(self) -> bool:
        r = self.ratio
        return r is None or not LOW <= r <= HIGH

    def markdown(self) -> str:
        c = self.case
        head = f"| {c.workload} | {mesh_label(c.mesh)} | {c.plan} |"
        if self.predicted is None or self.compiled is None:
            return f"{head} ERR {(self.error or '?')[:100]} | | | | | | | | **FAIL** |"
        pa, po, pt = self.predicted
        ca, co, cal, ct = self.compiled
        cells = [pa, ca, po, co - cal, pt, ct, pa + po + pt, ca + co - cal + ct]
        mark = " **FAIL**" if self.failed() else ""
        return f"{head} " + " | ".join(f"{x / MiB:,.1f}" for x in cells) + f" | {self.ratio:.3f}{mark} |"


TABLE_HEADER = ("| workload | mesh | plan | arg pred | arg XLA | out pred | out XLA (-alias) | temp pred | "
                "temp XLA | total pred | total XLA | pred/XLA |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|")


def expert_cases(only: str | None, meshes: list[tuple[int, ...]] | None) -> Iterator[Case]:
    for w in mlp.workloads() + misc.workloads() + transformer.workloads():
        if only is not None and only.lower() not in w.name.lower():
            continue
        for shape in w.meshes:
            if meshes is not None and shape not in meshes:
                continue
            mesh = make_mesh(shape)
            prob = w.build(mesh)
            for name, pins in [("shardsat", None), *prob.experts.items()]:
                yield Case(w.name, shape, name, prob.fn, prob.args, pins, prob.state_argnums, mesh)


def classic_cases(only: str | None, meshes: list[tuple[int, ...]] | None) -> Iterator[Case]:
    for w in (classic.mlp_tp(), classic.mlp_dp(), classic.transformer(seq=128)):
        if only is not None and only.lower() not in w.name.lower():
            continue
        for shape in ((1, 8), (2, 4)):
            if meshes is not None and shape not in meshes:
                continue
            mesh = jax.make_mesh(shape, ("data", "model"))
            plans = [("shardsat", None), ("data parallel", classic.data_parallel_pins(w.args[0], mesh)),
                     ("Megatron", w.megatron(w.args[0], mesh))]
            for name, pins in plans:
                yield Case(w.name, shape, name, w.fn, w.args, pins, None, mesh)


def measure(case: Case, profile: str) -> Row:
    t0 = time.perf_counter()
    row = Row(case)
    try:
        plan = shardsat.saturate_and_extract(case.fn, case.mesh, *case.args, profile=profile,
                                             state_argnums=case.state_argnums, in_shardings=case.pins,
                                             memory_limit=None)
        m = plan.cost.memory
        row.predicted = (m.arguments, m.outputs, m.activations_peak)
        compiled = plan.jit().lower(*case.args).compile()
        ma = compiled.memory_analysis()
        row.copies = (sorted(m.copied), copied_arguments(compiled.as_text()))
        row.compiled = (ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                        ma.temp_size_in_bytes)
    except Exception as e:  # a failing case is a table entry, not the end of the run
        row.error = f"{type(e).__name__}: {e}"
    row.wall_s = time.perf_counter() - t0
    return row


def copies_summary(rows: list[Row]) -> str:
    """How many plans copy the donated arguments XLA copies (copy insertion), and which differ:
    a copy missed is a weight-sized buffer the estimate may lack."""
    known = [r for r in rows if r.copies is not None]
    differ = [r for r in known if r.copies[0] != r.copies[1]]  # type: ignore[index]
    lines = [f"Donated arguments copied: {len(known) - len(differ)} of {len(known)} plans as XLA copies them."]
    for r in differ:
        got, want = r.copies  # type: ignore[misc]
        c = r.case
        lines.append(f"- {c.workload} {mesh_label(c.mesh)} {c.plan}: only predicted {sorted(set(got) - set(want))}, "
                     f"only XLA {sorted(set(want) - set(got))}")
    return "\n".join(lines)


def header(argv: list[str]) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", *argv])
    return (f"{date}; {platform.machine()} ({platform.processor() or 'cpu'}), nproc={os.cpu_count()}; "
            f"jax {jax.__version__}; {jax.device_count()} x {jax.devices()[0].platform}; command: `{command}`")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", metavar="SUBSTRING", help="only workloads whose name contains SUBSTRING (any case)")
    ap.add_argument("--meshes", nargs="+", metavar="SHAPE", type=parse_mesh,
                    help="only these mesh shapes, e.g. 8 2,4 4,2 2,2,2 1,8")
    ap.add_argument("--plans", nargs="+", metavar="NAME", help="only these plans (shardsat, DP, FSDP, ...)")
    ap.add_argument("--no-classic", action="store_true", help="skip the workloads of benchmarks/workloads.py")
    ap.add_argument("--out", metavar="FILE", help="also write the markdown to FILE")
    ap.add_argument("--profile", default="h100", help="device profile preset (default: h100)")
    ns = ap.parse_args(argv)

    cases = list(expert_cases(ns.only, ns.meshes))
    if not ns.no_classic:
        cases += list(classic_cases(ns.only, ns.meshes))
    if ns.plans:
        cases = [c for c in cases if c.plan in ns.plans]
    if not cases:
        ap.error("no workload/mesh/plan matches the filters")
    rows: list[Row] = []
    t0 = time.perf_counter()
    for i, case in enumerate(cases, 1):
        row = measure(case, ns.profile)
        rows.append(row)
        print(f"[{i}/{len(cases)}] {time.perf_counter() - t0:.0f}s ({row.wall_s:.1f}s) {row.markdown()}",
              file=sys.stderr, flush=True)
    ratios = [r.ratio for r in rows if r.ratio is not None]
    summary = (f"{len(rows)} plans; predicted/compiled total from {min(ratios):.3f} to {max(ratios):.3f}; "
               f"{sum(r.failed() for r in rows)} outside [{LOW}, {HIGH}]" if ratios else "no plan measured")
    text = "\n".join([header([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]), "",
                      TABLE_HEADER, *(r.markdown() for r in rows), "", summary, copies_summary(rows)]) + "\n"
    print(text, end="")
    if ns.out:
        Path(ns.out).write_text(text)
    return 1 if any(r.failed() for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
