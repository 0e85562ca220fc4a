"""Plan quality against hand-written expert layouts: predicted step time of shardsat's free plan vs
the best expert, per workload and mesh (8 simulated host devices: 8, 2x4, 4x2, 2x2x2).

    .venv/bin/python benchmarks/experts/run.py                       # everything (~10 min on 2 cores)
    .venv/bin/python benchmarks/experts/run.py --only MLP            # workloads whose name has "MLP"
    .venv/bin/python benchmarks/experts/run.py --meshes 8 2,4        # only these meshes
    .venv/bin/python benchmarks/experts/run.py --meshes 2,2,2,2      # any mesh: every workload on it
    .venv/bin/python benchmarks/experts/run.py --out FILE.md         # also write the table to FILE.md

Each case is planned freely ("shardsat": nothing pinned) and once per expert layout pinned through
`in_shardings` (parameters, optimizer state, batch; outputs free), all by the same
`saturate_and_extract` under the same cost model (H100 profile): an expert's intermediates are the
extractor's best completion given its pins. Times in us are predicted step times
(`plan.cost.total_s`) with the all-reduce/reduce-scatter/all-gather/all-to-all counts; "plan s" is
planning wall time (free plan; slowest expert). best/shardsat >= 1 means no expert beats the free
plan; a row is marked FAIL where one is cheaper by more than 0.1%, and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

# host devices for the largest mesh asked for (8 at least), set before jax is imported
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                           + str(max([8, *(math.prod(int(x) for x in a.split(","))
                                           for a in sys.argv[1:] if re.fullmatch(r"\d+(,\d+)*", a))]))).strip()

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

import misc
import mlp
import transformer
from common import TABLE_HEADER, Row, Workload, parse_mesh, run_case


def all_workloads() -> list[Workload]:
    return mlp.workloads() + misc.workloads() + transformer.workloads()


def header(argv: list[str]) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", *argv])
    return f"{date}; {platform.machine()}, nproc={os.cpu_count()}; jax {jax.__version__}; command: `{command}`"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", metavar="SUBSTRING", help="only workloads whose name contains SUBSTRING (any case)")
    ap.add_argument("--meshes", nargs="+", metavar="SHAPE", type=parse_mesh,
                    help="these mesh shapes, e.g. 8 2,4 4,2 2,2,2 (every workload on each; 2,2,2,2 too)")
    ap.add_argument("--out", metavar="FILE", help="also write the markdown to FILE")
    ap.add_argument("--profile", default="h100", help="device profile preset (default: h100)")
    ns = ap.parse_args(argv)

    cases = [(w, shape) for w in all_workloads()
             if ns.only is None or ns.only.lower() in w.name.lower()
             for shape in (w.meshes if ns.meshes is None else ns.meshes)]
    if not cases:
        ap.error("no workload/mesh matches the filters")

    rows: list[Row] = []
    t0 = time.perf_counter()
    for i, (workload, shape) in enumerate(cases, 1):
        row = run_case(workload, shape, ns.profile)
        rows.append(row)
        print(f"[{i}/{len(cases)}] {time.perf_counter() - t0:.0f}s {row.markdown()}", file=sys.stderr, flush=True)
        for r in [row.free, *row.experts]:
            if r.error:
                print(f"    {r.plan}: {r.error}", file=sys.stderr, flush=True)

    text = "\n".join([header([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]), "",
                      TABLE_HEADER, *(r.markdown() for r in rows)]) + "\n"
    print(text, end="")
    if ns.out:
        Path(ns.out).write_text(text)
    return 1 if any(r.failed() for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
