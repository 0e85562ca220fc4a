"""shardsat benchmarks: planning time and predicted step time against hand-written plans.

    .venv/bin/python benchmarks/run.py                 # full run, markdown on stdout
    .venv/bin/python benchmarks/run.py --quick         # fewer sizes, one repeat
    .venv/bin/python benchmarks/run.py --out FILE.md   # also write the markdown to FILE.md

Everything is planned from jax.ShapeDtypeStruct arguments: nothing is allocated, compiled or run.
Predicted times come from shardsat's cost model with the chosen device profile (default "h100").

Hand-written plans are planned by the same `saturate_and_extract` with their argument layouts pinned
through `in_shardings` (outputs left free): the same cost model prices them, and the same extractor
picks the best layouts for every intermediate value given those pins.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import datetime
import platform
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as W

import shardsat

MESH_SHAPES = ((1, 8), (2, 4))
AXES = ("data", "model")


# -- measurement --------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One planning call: the plan (or the error) and the best timings over the repeats."""

    plan: shardsat.Plan | None = None
    error: str | None = None
    wall_s: float = float("inf")
    report: Any = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.plan is not None

    @property
    def predicted_s(self) -> float | None:
        return None if self.plan is None else self.plan.cost.total_s


def plan_once(fn: Any, mesh: Any, args: tuple[Any, ...], profile: str, repeats: int = 1,
              in_shardings: Any = None) -> Outcome:
    """Plan `fn` `repeats` times; keep the last plan and the fastest time of each phase."""
    out = Outcome()
    best: dict[str, float] = {}
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        try:
            plan = shardsat.saturate_and_extract(fn, mesh, *args, profile=profile,
                                                 in_shardings=in_shardings)
        except Exception as e:  # a benchmark records failures instead of stopping
            out.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return out
        wall = time.perf_counter() - t0
        r = plan.report
        phases = {
            "saturate": r.saturation_s + r.rules_s,
            "extract": r.extraction_s,
            "total": r.total_s,
            "wall": wall,
        }
        for k, v in phases.items():
            best[k] = min(best.get(k, float("inf")), v)
        out.plan, out.report = plan, r
    out.timings = best
    out.wall_s = best["wall"]
    return out


def make_mesh(shape: tuple[int, ...]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, AXES)


def one_device_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])


# -- formatting ---------------------------------------------------------------------------------


def us(s: float | None) -> str:
    return "error" if s is None else f"{s * 1e6:,.1f}"


def secs(s: float) -> str:
    return f"{s:.3f}"


def collectives_summary(plan: shardsat.Plan) -> str:
    c: Counter[str] = plan.cost.count()
    if not c:
        return "none"
    return ", ".join(f"{n}x {k}" for k, n in sorted(c.items()))


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def environment(argv: list[str]) -> str:
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        nproc = str(os.cpu_count())
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return "\n".join([
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {cpu}, nproc={nproc}, {platform.system()} {platform.release()}",
        f"- python {platform.python_version()}, jax {jax.__version__}, jaxlib {version('jaxlib')}, "
        f"egglog {version('egglog')}, shardsat {shardsat.__version__}",
        f"- jax devices: {jax.device_count()} x {jax.devices()[0].platform} (simulated host devices)",
        f"- command: `{' '.join(shlex.quote(a) for a in ['.venv/bin/python', *argv])}`",
    ])


# -- sections -----------------------------------------------------------------------------------


def comparison(workloads: list[W.Workload], profile: str, repeats: int,
               anomalies: list[str]) -> str:
    header = ["workload", "mesh", "saturate s", "extract s", "total s", "e-nodes", "stop",
              "shardsat us", "shardsat collectives", "replicated us", "data parallel us",
              "Megatron us", "best expert / shardsat"]
    rows: list[list[str]] = []
    single = one_device_mesh()
    for wl in workloads:
        rep = plan_once(wl.fn, single, wl.args, profile)
        if not rep.ok:
            anomalies.append(f"{wl.name}, replicated (1-device mesh): {rep.error}")
        for shape in MESH_SHAPES:
            mesh = make_mesh(shape)
            mesh_name = "x".join(map(str, shape))
            ss = plan_once(wl.fn, mesh, wl.args, profile, repeats=repeats)
            experts: dict[str, Outcome] = {
                "replicated": rep,
                "data parallel": plan_once(wl.fn, mesh, wl.args, profile,
                                           in_shardings=W.data_parallel_pins(wl.args[0], mesh)),
                "Megatron": plan_once(wl.fn, mesh, wl.args, profile,
                                      in_shardings=wl.megatron(wl.args[0], mesh)),
            }
            for name, o in experts.items():
                if not o.ok and name != "replicated":
                    anomalies.append(f"{wl.name} on {mesh_name}, {name}: {o.error}")
            if not ss.ok:
                anomalies.append(f"{wl.name} on {mesh_name}, shardsat: {ss.error}")
                rows.append([wl.name, mesh_name, "error", "", "", "", "", "error", ss.error or "",
                             *(us(o.predicted_s) for o in experts.values()), ""])
                continue
            times = {n: o.predicted_s for n, o in experts.items() if o.predicted_s is not None}
            best_name = min(times, key=lambda n: times[n]) if times else None
            ratio = (times[best_name] / ss.predicted_s) if best_name and ss.predicted_s else None
            r = ss.report
            if ratio is not None and ratio < 1 - 1e-6:
                anomalies.append(
                    f"{wl.name} on {mesh_name}: shardsat predicted {us(ss.predicted_s)} us but "
                    f"{best_name} predicted {us(times[best_name])} us (ratio {ratio:.3f})")
            if r.stop_reason != shardsat.StopReason.SATURATED:
                anomalies.append(f"{wl.name} on {mesh_name}: search stopped by {r.stop_reason.value}")
            rows.append([
                wl.name, mesh_name,
                secs(ss.timings["saturate"]), secs(ss.timings["extract"]), secs(ss.timings["total"]),
                f"{r.e_nodes:,}", r.stop_reason.value,
                us(ss.predicted_s), collectives_summary(ss.plan),
                *(us(o.predicted_s) for o in experts.values()),
                "n/a" if ratio is None else f"{ratio:.2f} ({best_name})",
            ])
            print(f"  done: {wl.name} on {mesh_name} ({ss.wall_s:.2f}s)", file=sys.stderr, flush=True)
    return md_table(header, rows)


def scaling(blocks: list[int], profile: str, repeats: int, anomalies: list[str]) -> tuple[str, float | None]:
    header = ["blocks", "equations", "e-classes", "e-nodes", "stop", "saturate s", "extract s",
              "total s", "wall s", "predicted us", "predicted us / block", "collectives"]
    rows: list[list[str]] = []
    mesh = make_mesh((2, 4))
    last_total: float | None = None
    for n in blocks:
        wl = W.mlp_tp(n)
        o = plan_once(wl.fn, mesh, wl.args, profile, repeats=repeats)
        if not o.ok:
            anomalies.append(f"scaling, {n} blocks: {o.error}")
            rows.append([str(n), "error", o.error or "", *[""] * 9])
            continue
        r = o.report
        if n == max(blocks):
            last_total = o.timings["total"]
        rows.append([
            str(n), str(r.equations), f"{r.e_classes:,}", f"{r.e_nodes:,}", r.stop_reason.value,
            secs(o.timings["saturate"]), secs(o.timings["extract"]), secs(o.timings["total"]),
            secs(o.wall_s), us(o.predicted_s), us(o.predicted_s / n),  # type: ignore[operator]
            collectives_summary(o.plan),
        ])
        print(f"  done: scaling {n} blocks ({o.wall_s:.2f}s)", file=sys.stderr, flush=True)
    return md_table(header, rows), last_total


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer sizes (shorter transformer, fewer scaling points) and one repeat")
    ap.add_argument("--out", metavar="FILE", help="also write the markdown to FILE")
    ap.add_argument("--profile", default="h100", help="device profile preset (default: h100)")
    ap.add_argument("--blocks", type=int, default=4, help="MLP chain length in the comparison table")
    ap.add_argument("--repeats", type=int, default=None,
                    help="plan each shardsat case this many times and report the fastest (default 3, --quick 1)")
    ns = ap.parse_args(argv)
    repeats = ns.repeats if ns.repeats is not None else (1 if ns.quick else 3)

    if ns.quick:
        workloads = [W.mlp_tp(ns.blocks), W.mlp_dp(ns.blocks), W.transformer(seq=128)]
        blocks = [1, 4, 24]
    else:
        workloads = [W.mlp_tp(ns.blocks), W.mlp_dp(ns.blocks), W.transformer()]
        blocks = [1, 2, 4, 8, 16, 24]

    # Warm-up: the first plan in a process pays one-off costs (egglog start-up, jax tracing caches).
    warm = W.mlp_tp(1)
    plan_once(warm.fn, make_mesh((2, 4)), warm.args, ns.profile)

    anomalies: list[str] = []
    t0 = time.perf_counter()
    table = comparison(workloads, ns.profile, repeats, anomalies)
    scale, total24 = scaling(blocks, ns.profile, repeats, anomalies)
    elapsed = time.perf_counter() - t0

    md = [
        "## Environment", "",
        environment([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        f"- profile: `{ns.profile}`; planning times are the fastest of {repeats} run(s) after one warm-up plan",
        f"- benchmark wall time: {elapsed:.1f} s", "",
        "## Predicted step time: shardsat vs hand-written plans", "",
        f"MLP chain: residual, `x = x + tanh(x @ W1_i) @ W2_i`, {ns.blocks} blocks, float32. "
        "Times in microseconds (us) are predicted per step by the cost model; seconds (s) are planning wall "
        "time on this machine. `saturate s` = rule loading + saturation, `total s` = trace + saturate + "
        "extract. The last column is min(hand-written) / shardsat (>= 1: shardsat is at least as good), "
        "with the best hand-written plan named.", "",
        table, "",
        "## Scaling: MLP chain, tensor-parallel regime (b8 d8192 h32768), mesh 2x4", "",
        scale, "",
    ]
    if total24 is not None:
        md += [f"Largest chain ({max(blocks)} blocks): planning total {total24:.3f} s "
               f"(requirement: under 10 s) -> {'PASS' if total24 < 10 else 'FAIL'}.", ""]
    md += ["## Anomalies", ""]
    md += [f"- {a}" for a in anomalies] if anomalies else ["none"]
    text = "\n".join(md) + "\n"
    print(text)
    if ns.out:
        Path(ns.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
