"""Where planning time goes: each free plan of the experts benchmark (H100 profile), its wall
time split into the search's steps (extract/search.py), so that a change to one of them is
measured against the others, not only in total.

    .venv/bin/python benchmarks/planning_phases.py                   # every experts case
    .venv/bin/python benchmarks/planning_phases.py --only gpt --only llama
    .venv/bin/python benchmarks/planning_phases.py --layers          # + the unrolled 24/96-layer steps

Columns, seconds: prepare (tracing, rules, saturation: the report's own times), the free local
search (its starts, pressure restart and whole start), the exact integer program where it runs,
the layout families (search._family_starts: the full pinned completions, the pressure
completions and their releases, and the polishing of the best ones), the lower bound
(search._split: the split bound and its agreement rounds) where planning computes it, the rest,
and the total; then, not in the total, the first read of the plan's gap, which computes the
bound (extract/result.py's Bound). Each step is timed by wrapping its function: a step inside
another is counted in the outer one only (a family's pinned completion runs a local search of
its own, counted under families). Wall times: run it alone on the machine, and compare within
one run.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
for sub in ("examples", "benchmarks", "", "benchmarks/experts"):
    sys.path.insert(0, str(ROOT / sub))

import common  # noqa: E402
import misc  # noqa: E402
import mlp  # noqa: E402
import scaling  # noqa: E402
import transformer  # noqa: E402

import shardsat  # noqa: E402
from shardsat.extract import search  # noqa: E402

# (column, search function); the families' parts are columns of their own
STEPS = [("local search", "_local_search"), ("exact", "_exact"), ("families", "_family_starts"),
         ("bound", "_split")]
FAMILY_PARTS = [("pinned in full", "_pinned"), ("pressure completions", "_pressed_families")]


@contextmanager
def timed_steps() -> Iterator[dict[str, float]]:
    """Seconds per step while inside: a call is counted only where no timed step encloses it,
    except the families' parts, counted inside _family_starts too."""
    spent: dict[str, float] = {}
    stack: list[str] = []
    saved = {fn: getattr(search, fn) for _, fn in STEPS + FAMILY_PARTS}

    def wrap(col: str, real: Callable) -> Callable:
        @functools.wraps(real)
        def timed(*args, **kwargs):
            outer = not stack or (stack == ["_family_starts"] and col in dict(FAMILY_PARTS))
            stack.append(real.__name__)
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                stack.pop()
                if outer:
                    spent[col] = spent.get(col, 0.0) + time.perf_counter() - t
        return timed

    for col, fn in STEPS + FAMILY_PARTS:
        setattr(search, fn, wrap(col, saved[fn]))
    try:
        yield spent
    finally:
        for fn, real in saved.items():
            setattr(search, fn, real)


def _timed(plan: Callable[[], shardsat.Plan]) -> tuple[shardsat.Plan, float]:
    t = time.perf_counter()
    out = plan()
    return out, time.perf_counter() - t


def cases(only: list[str], layers: bool) -> list[tuple[str, Callable[[], tuple[shardsat.Plan, float]]]]:
    """(name, a function that plans it and says how long planning took; building the example
    arguments is not counted) for each experts case (and the deep steps) kept by `only`."""
    out: list[tuple[str, Callable[[], tuple[shardsat.Plan, float]]]] = []
    for w in mlp.workloads() + misc.workloads() + transformer.workloads():
        for shape in w.meshes:
            mesh = common.make_mesh(shape)
            name = f"{w.name} {common.mesh_label(mesh)}"
            if only and not any(o.lower() in name.lower() for o in only):
                continue

            def plan(w=w, mesh=mesh) -> tuple[shardsat.Plan, float]:
                pr = w.build(mesh)
                return _timed(lambda: shardsat.saturate_and_extract(pr.fn, mesh, *pr.args, profile="h100",
                                                                    state_argnums=pr.state_argnums))
            out.append((name, plan))
    if layers:
        out += [(f"unrolled GPT step, {n} layers", functools.partial(_timed, functools.partial(scaling.plan_for, n,
                                                                                               "unrolled")))
                for n in (24, 96)]
    return out


def _bound_read(plan: shardsat.Plan) -> float:
    """Seconds the first read of the plan's gap takes: the lower bound is computed then
    (extract/result.py's Bound), not while planning."""
    t = time.perf_counter()
    _ = plan.report.gap
    return time.perf_counter() - t


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    only = [argv[k + 1] for k, a in enumerate(argv) if a == "--only"]
    cols = (["prepare"] + [c for c, _ in STEPS[:3]] + [c for c, _ in FAMILY_PARTS]
            + ["bound", "rest", "total", "bound, when read"])
    print("| case | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    sums = dict.fromkeys(cols, 0.0)
    for name, plan in cases(only, "--layers" in argv):
        with timed_steps() as spent:
            done, total = plan()
        report = done.report
        row = {"prepare": report.trace_s + report.rules_s + report.saturation_s, **spent, "total": total}
        row["bound, when read"] = _bound_read(done)
        row["rest"] = total - row["prepare"] - sum(spent.get(c, 0.0) for c, _ in STEPS)
        for c in cols:
            sums[c] += row.get(c, 0.0)
        print(f"| {name} | " + " | ".join(f"{row.get(c, 0.0):.2f}" for c in cols) + " |", flush=True)
    print("| **total** | " + " | ".join(f"{sums[c]:.1f}" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
