"""The cost model beside the compiled program: for each realistic training step, shardsat's
predicted compute and communication against XLA's (benchmarks/compiled.py), for the free plan
and for the plan with data-parallel arguments, and whether the model ranks the two plans as the
compiled estimates do.

    .venv/bin/python benchmarks/model_vs_compiled.py                      # every program, on 1x8
    .venv/bin/python benchmarks/model_vs_compiled.py --only vit --meshes 2,4 1,8

Why: benchmarks/realistic.py shows where shardsat's free plan compiles slower than jax.jit's data
parallelism; this shows which of the model's two terms was wrong about it. The data-parallel plan
pins the arguments as realistic.py's expert places them (state replicated, data split over every
axis; shardsat plans the intermediates), so both plans are priced by both the model and XLA.
Columns, microseconds: the model's compute and communication (plan.cost), the compiled estimate's
(XLA's cost analysis, roofline on the profile; the HLO's collectives, alpha-beta), the model's
compute over the compiled one; per program, the model's and the compiled margin of the free plan
over the data-parallel one (negative: the free plan is faster) and whether their signs agree.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardsat first

import jax
from compiled import compiled_step
from jax.sharding import PartitionSpec
from realistic import AXES, _error_row, _mesh_shape, _structs, print_table
from realistic_programs import PROGRAMS

import shardsat

HEADER = ("| program | mesh | plan | model compute | model comm | compiled compute | compiled comm "
          "| model/compiled compute | free - DP, model | free - DP, compiled | same order |")


def _dp_pins(args: tuple[Any, ...], state: tuple[int, ...], data: dict[int, int], axes: tuple[str, ...]) -> tuple[Any, ...]:
    """realistic.py's expert as pins: state replicated, each data argument split along its
    batch dimension over every axis."""
    pins: list[Any] = []
    for i, a in enumerate(args):
        if i in state:
            pins.append(jax.tree.map(lambda _: PartitionSpec(), a))
        else:
            spec: list[Any] = [None] * len(a.shape)
            spec[data[i]] = axes
            pins.append(PartitionSpec(*spec))
    return tuple(pins)


def rows(name: str, shape: tuple[int, ...]) -> list[str]:
    """The free and the data-parallel plan of one program on one mesh, model beside compiled."""
    fn, concrete, state, data = PROGRAMS[name]()
    args = _structs(concrete)
    mesh = jax.make_mesh(shape, AXES[len(shape)])
    label = "x".join(map(str, shape))
    got = {}
    for plan_name, pins in (("free", None), ("DP", _dp_pins(args, state, data, mesh.axis_names))):
        plan = shardsat.saturate_and_extract(fn, mesh, *args, profile="h100", state_argnums=state, in_shardings=pins)
        c = compiled_step(plan, args, plan.profile)
        got[plan_name] = (plan.cost.compute_s * 1e6, plan.cost.communication_s * 1e6, c.compute_us, c.comm_us)
    model_margin = sum(got["free"][:2]) - sum(got["DP"][:2])
    compiled_margin = sum(got["free"][2:]) - sum(got["DP"][2:])
    out = []
    for plan_name, (mc, mm, cc, cm) in got.items():
        tail = (f"{model_margin:+.1f} | {compiled_margin:+.1f} | {'yes' if (model_margin < 0) == (compiled_margin < 0) else '**no**'}"
                if plan_name == "free" else " | | ")
        out.append(f"| {name} | {label} | {plan_name} | {mc:.1f} | {mm:.1f} | {cc:.1f} | {cm:.1f} | {mc / cc:.3f} | {tail} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(PROGRAMS), help="a program (repeatable)")
    ap.add_argument("--meshes", nargs="+", type=_mesh_shape, default=[(1, 8)], help="mesh shapes, e.g. 2,4 1,8")
    ns = ap.parse_args(argv)
    warnings.simplefilter("ignore")  # fallback and memory warnings: the table is the output
    print_table(HEADER, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|", ns.only or list(PROGRAMS), ns.meshes,
                lambda name, shape: "\n".join(rows(name, shape)),
                lambda name, shape, e: _error_row(name, shape, e, HEADER.count("|") - 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
