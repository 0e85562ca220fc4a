"""The search invariant over transformer training steps: the free plan against every standard
layout family pinned and completed by shardsat (issue 17).

Per configuration x mesh: the free plan's predicted step (shardsat's cost model) and planning
time; the cheapest pinned family and how many families are cheaper than the free plan
(violations, must be 0; a lower bound above a pinned plan counts too); the free plan's ratio
to the compute floor (XLA's FLOPs of the unsharded step / devices / peak), its lower bound and
gap as its report gives them; and, with --compiled, the roofline estimate of both compiled
programs (benchmarks/compiled.py). The step is a hand-written pre-LN GPT (examples/models.py)
with AdamW, every argument a ShapeDtypeStruct, under the profile of the issue (100 TFLOP/s,
2 TB/s, 100 GB/s links, 5 us).

    .venv/bin/python benchmarks/invariant.py                 # the sweep (about an hour on 2 cores)
    .venv/bin/python benchmarks/invariant.py --quick         # two configurations, 2x4 only
    .venv/bin/python benchmarks/invariant.py --compiled      # also compile the free and best pinned plans
    .venv/bin/python benchmarks/invariant.py --free-only     # the free plans alone (~10 minutes)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
from compiled import compiled_step, unsharded_flops
from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

import shardsat
from shardsat.testing import standard_layouts

PROFILE = shardsat.DeviceProfile(name="issue-17", flops_per_s=100e12, hbm_bytes_per_s=2e12,
                                 link_bytes_per_s=100e9, latency_s=5e-6)
MESHES = {"8": ((8,), ("data",)), "1x8": ((1, 8), ("data", "model")), "2x4": ((2, 4), ("data", "model")), "4x2": ((4, 2), ("data", "model")),
          "2x2x2": ((2, 2, 2), ("data", "fsdp", "model"))}
# (name, config, state_argnums): the four, and others around them
CONFIGS = [
    ("d512 L2 v8192", GPTConfig(layers=2, d_model=512, heads=8, mlp=2048, vocab=8192, seq=256, batch=32), None),
    ("d512 L2 v8192 state", GPTConfig(layers=2, d_model=512, heads=8, mlp=2048, vocab=8192, seq=256, batch=32),
     (0,)),
    ("d512 L3 mlp1024 v12288", GPTConfig(layers=3, d_model=512, heads=8, mlp=1024, vocab=12288, seq=256, batch=32),
     None),
    ("d640 L4", GPTConfig(layers=4, d_model=640, heads=10, mlp=2560, vocab=8192, seq=256, batch=32), None),
    ("d448 L3", GPTConfig(layers=3, d_model=448, heads=7, mlp=1792, vocab=8192, seq=256, batch=32), None),
    ("d256 L1 v4096", GPTConfig(layers=1, d_model=256, heads=4, mlp=1024, vocab=4096, seq=128, batch=16), (0,)),
    ("d1024 L2", GPTConfig(layers=2, d_model=1024, heads=16, mlp=4096, vocab=8192, seq=256, batch=16), (0,)),
]


@dataclass
class Row:
    config: str
    mesh: str
    free_us: float
    plan_s: float
    best_family: str
    best_us: float
    violations: list[str]
    floor_ratio: float
    bound_us: float  # the free plan's lower bound (extract/splitbound.py); nan where none
    compiled: str = ""

    def markdown(self) -> str:
        viol = ", ".join(self.violations) if self.violations else "0"
        return (f"| {self.config} | {self.mesh} | {self.free_us:,.1f} | {self.plan_s:.1f} | {self.best_family} "
                f"{self.best_us:,.1f} | {self.best_us / self.free_us:.3f} | {viol} | {self.floor_ratio:.2f} | "
                f"{self.bound_us:,.1f} | {1 - self.bound_us / self.free_us:.1%} |{self.compiled}")


def run(name: str, cfg: GPTConfig, state: tuple[int, ...] | None, mesh_name: str, compiled: bool,
        pinned_too: bool = True) -> Row:
    mesh = jax.make_mesh(*MESHES[mesh_name])
    _, step = make_gpt_step(cfg)
    params = gpt_params(cfg, abstract=True)
    import optax

    opt_state = jax.eval_shape(optax.adamw(1e-3, weight_decay=0.01).init, params)
    args = ((params, opt_state), gpt_batch(cfg, abstract=True))
    t = time.perf_counter()
    free = shardsat.saturate_and_extract(step, mesh, *args, profile=PROFILE, state_argnums=state)
    plan_s = time.perf_counter() - t
    best, best_name, violations = None, "-", []
    families = standard_layouts(step, mesh, *args, state_argnums=state) if pinned_too else {}
    for fam, pins in families.items():
        pinned = shardsat.saturate_and_extract(step, mesh, *args, profile=PROFILE, state_argnums=state,
                                               in_shardings=pins)
        if best is None or pinned.cost.total_s < best.cost.total_s:
            best, best_name = pinned, fam
        if pinned.cost.total_s * (1 + 1e-6) < free.cost.total_s:
            violations.append(f"{fam} {pinned.cost.total_s * 1e6:,.1f}")
        if (free.report.lower_bound_s or 0.0) > pinned.cost.total_s * (1 + 1e-9):  # a bound above a plan
            violations.append(f"bound above {fam}")
    floor = unsharded_flops(step, args) / mesh.devices.size / PROFILE.flops_per_s
    bound = free.report.lower_bound_s
    row = Row(name, mesh_name, free.cost.total_s * 1e6, plan_s, best_name,
              best.cost.total_s * 1e6 if best else float("nan"), violations, free.cost.total_s / floor,
              bound * 1e6 if bound is not None else float("nan"))
    if compiled and best is not None:
        f, b = compiled_step(free, args, PROFILE), compiled_step(best, args, PROFILE)
        row.compiled = f" {f.total_us:,.1f} | {b.total_us:,.1f} | {b.total_us / f.total_us:.3f} |"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two configurations on 2x4")
    ap.add_argument("--compiled", action="store_true", help="compile the free and the best pinned plan")
    ap.add_argument("--mesh", action="append", choices=sorted(MESHES), help="meshes (default: all but 1x8)")
    ap.add_argument("--only", action="append", metavar="NAME", help="configurations with this name (repeatable)")
    ap.add_argument("--free-only", action="store_true",
                    help="the free plans alone (a search change leaves the pinned plans as they were: "
                         "a plan with every argument pinned has no families to try)")
    ns = ap.parse_args(argv)
    configs = CONFIGS[:2] if ns.quick else [c for c in CONFIGS if ns.only is None or c[0] in ns.only]
    meshes = ns.mesh or (["2x4"] if ns.quick else [m for m in MESHES if m != "1x8"])
    head = ("| config | mesh | free us | plan s | best pinned family us | best/free | violations "
            "| free / compute floor | lower bound us | gap |")
    rule = "|---|---|---:|---:|---|---:|---|---:|---:|---:|"
    if ns.compiled:
        head += " compiled free us | compiled best pinned us | compiled best/free |"
        rule += "---:|---:|---:|"
    print(head)
    print(rule, flush=True)
    bad = 0
    for name, cfg, state in configs:
        for m in meshes:
            row = run(name, cfg, state, m, ns.compiled and not ns.free_only, not ns.free_only)
            bad += len(row.violations)
            print(row.markdown(), flush=True)
    print(f"\n{bad} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
