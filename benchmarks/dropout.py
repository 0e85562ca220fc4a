"""Dropout training steps: shardsat's free plan against a hand-written data-parallel `jax.jit`,
both compiled.

    .venv/bin/python benchmarks/dropout.py

Programs: benchmarks/memory_probe.py's dropout steps (an MLP with SGD, and two transformer blocks
with dropout on the attention probabilities and both residual branches, AdamW), H100 profile, on
8 simulated CPU devices. Per program and mesh: shardsat's predicted step (its cost model), the
compiled step estimate (benchmarks/compiled.py: XLA's cost analysis and the HLO's collectives,
the same roofline for both plans) and the compiled per-device memory (memory_analysis():
arguments + outputs not aliased + temps); the same two for the data-parallel expert (the batch
split over every device, weights, optimizer state and the key replicated: GSPMD partitions the
rest, dropout's bits included). Run from a worktree of an older commit, it measures that
commit's shardsat (this checkout's package is imported first).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardsat first

import jax
from compiled import compiled_mib, compiled_step
from jax.sharding import NamedSharding, PartitionSpec
from memory_probe import PROGRAMS

import shardsat

MESHES = (((2, 4), ("data", "model")), ((2, 2, 2), ("data", "fsdp", "model")), ((1, 8), ("data", "model")))
# (program, how many leading arguments are weights and optimizer state)
CASES = (("dropout_mlp_train", 1), ("dropout_transformer_adam", 2))



class Expert:
    """Data parallelism as a user writes it: jax.jit with the batch split over every axis."""

    def __init__(self, fn: Any, args: tuple[Any, ...], state: int, mesh: Any) -> None:
        rep, batch = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(mesh.axis_names))
        shardings = [jax.tree.map(lambda _: rep, a) for a in args[:state]]
        shardings += [batch] * (len(args) - state - 1) + [rep]  # the key, last, replicated
        self.mesh, self._jit = mesh, jax.jit(fn, in_shardings=tuple(shardings))

    def jit(self) -> Any:
        return self._jit


def row(name: str, state: int, shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    fn, args = PROGRAMS[name]()
    mesh = jax.make_mesh(shape, names)
    plan = shardsat.saturate_and_extract(fn, mesh, *args, profile="h100")
    mine = compiled_step(plan, args, plan.profile)
    expert = Expert(fn, args, state, mesh)
    theirs = compiled_step(expert, args, plan.profile)
    m_mine, m_theirs = compiled_mib(plan.jit().lower(*args).compile()), compiled_mib(expert.jit().lower(*args).compile())
    t_mine, t_theirs = mine.compute_us + mine.comm_us, theirs.compute_us + theirs.comm_us
    return (f"| {name} | {'x'.join(map(str, shape))} | {plan.cost.total_s * 1e6:.1f} | {t_mine:.1f} ({mine.collectives}) "
            f"| {m_mine:.1f} | {t_theirs:.1f} ({theirs.collectives}) | {m_theirs:.1f} | {t_mine / t_theirs:.3f} "
            f"| {m_mine / m_theirs:.3f} |")


def main() -> int:
    print("| program | mesh | shardsat predicted us | shardsat compiled us (collectives) | shardsat MiB "
          "| DP jax.jit compiled us (collectives) | DP MiB | time shardsat/DP | memory shardsat/DP |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, state in CASES:
        for shape, names in MESHES:
            print(row(name, state, shape, names), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
