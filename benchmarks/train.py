"""GPT training step (fwd + grad + AdamW): plain data parallelism vs data parallelism with the
cross-replica weight-update sharding of Xu et al. 2020 vs shardsat's plan.

    .venv/bin/python benchmarks/train.py              # 2 and 12 layers on a 1x8 data mesh
    .venv/bin/python benchmarks/train.py --layers 2   # one size

Each column is one `saturate_and_extract` call with `state_argnums=(0,)` (loop-carried state):
- DP: parameters and optimizer state pinned replicated, tokens split over `data`;
- DP + weight-update sharding: parameters replicated, optimizer state split over `data` on each
  leaf's largest dimension (the update runs on 1/N of each weight; gradients are
  reduce-scattered, new weights all-gathered), tokens split over `data`;
- shardsat: nothing pinned.
Intermediates are always the extractor's best completion under the same cost model (H100 profile).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import sys
import time
from pathlib import Path

import jax
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

import shardsat


def sharded_spec(shape: tuple[int, ...], n: int) -> P:
    if not shape:
        return P()
    big = max(range(len(shape)), key=lambda d: (shape[d], -d))
    if shape[big] % n:
        return P()
    return P(*[("data" if d == big else None) for d in range(big + 1)])


def run(layers: int) -> list[str]:
    cfg = GPTConfig(layers=layers, d_model=512, heads=8, mlp=2048, vocab=4096, seq=128, batch=8, embed="onehot")
    opt, step = make_gpt_step(cfg)
    params = gpt_params(cfg, abstract=True)
    state = (params, jax.eval_shape(opt.init, params))
    batch = gpt_batch(cfg, abstract=True)
    mesh = jax.make_mesh((8,), ("data",))
    rep_params = jax.tree_util.tree_map(lambda _: P(), params)
    rep_opt = jax.tree_util.tree_map(lambda _: P(), state[1])
    shard_opt = jax.tree_util.tree_map(lambda x: sharded_spec(x.shape, 8), state[1])
    tokens = {"tokens": P("data"), "targets": P("data")}
    plans = {}
    for name, pins in (("DP", ((rep_params, rep_opt), tokens)),
                       ("DP + WUS", ((rep_params, shard_opt), tokens)),
                       ("shardsat", None)):
        t = time.perf_counter()
        plans[name] = shardsat.saturate_and_extract(step, mesh, state, batch, profile="h100", state_argnums=(0,),
                                                    in_shardings=pins)
        plans[name].wall = time.perf_counter() - t
    rows = []
    base = plans["DP"].cost.total_s
    for name, plan in plans.items():
        c, m = plan.cost, plan.cost.memory
        kinds = c.count()
        rows.append(
            f"| {layers} | {name} | {c.total_s * 1e6:,.0f} | {base / c.total_s:.2f} | {c.compute_s * 1e6:,.0f} | "
            f"{c.communication_s * 1e6:,.0f} | {m.parameters / 2**20:.1f} | {m.optimizer_state / 2**20:.1f} | "
            f"{m.activations_peak / 2**20:.1f} | {m.total / 2**20:.1f} | {c.update_flops / 1e6:.1f} | "
            f"{kinds.get('all-reduce', 0)}/{kinds.get('reduce-scatter', 0)}/{kinds.get('all-gather', 0)} | "
            f"{plan.wall:.1f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[2, 12])
    args = ap.parse_args()
    print("| layers | plan | step us | speed-up vs DP | compute us | comm us | params MiB | opt state MiB | "
          "peak act MiB | total MiB | update MFLOP | AR/RS/AG | plan s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for layers in args.layers:
        for row in run(layers):
            print(row, flush=True)


if __name__ == "__main__":
    main()
