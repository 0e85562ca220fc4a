"""Planning vs loading a saved plan: the 24-layer GPT training step of benchmarks/scaling.py.

    .venv/bin/python benchmarks/saved.py                # 24 layers, 3 loads
    .venv/bin/python benchmarks/saved.py --layers 4 --loads 1

Plans the step (saturate_and_extract, wall time of the whole call), saves the plan, then loads it
(`shardsat.load_plan`: trace, fold, rule tables, restore) and times that; the loaded plan must
predict the same cost and choose the same layouts. Also times a `cache_dir=` hit.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

import shardsat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--loads", type=int, default=3)
    args = ap.parse_args()
    cfg = GPTConfig(layers=args.layers, d_model=1024, heads=16, mlp=4096, vocab=4096, seq=512, batch=16, embed="onehot")
    params = gpt_params(cfg, abstract=True)
    opt, step = make_gpt_step(cfg)
    state = (params, jax.eval_shape(opt.init, params))
    batch = gpt_batch(cfg, abstract=True)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        plan = shardsat.saturate_and_extract(step, mesh, state, batch, profile="h100", state_argnums=(0,))
        plan_s = time.perf_counter() - t
        path = Path(tmp) / "gpt.json"
        t = time.perf_counter()
        plan.save(path)
        save_s = time.perf_counter() - t
        loads = []
        for _ in range(args.loads):
            t = time.perf_counter()
            loaded = shardsat.load_plan(path, step, mesh, state, batch)
            loads.append(time.perf_counter() - t)
        assert loaded.cost.total_s == plan.cost.total_s and loaded.in_shardings == plan.in_shardings
        shardsat.saturate_and_extract(step, mesh, state, batch, profile="h100", state_argnums=(0,), cache_dir=tmp)
        t = time.perf_counter()
        hit = shardsat.saturate_and_extract(step, mesh, state, batch, profile="h100", state_argnums=(0,),
                                            cache_dir=tmp)
        hit_s = time.perf_counter() - t
        assert hit.report.loaded_from is not None
        print(f"| layers | equations | e-nodes | plan s | save s | file MiB | load s (min of {args.loads}) "
              "| cache hit s | load / plan |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {args.layers} | {len(loaded.origin.fingerprint.equations):,} | {plan.report.e_nodes:,} | "
              f"{plan_s:.2f} | {save_s:.2f} | {path.stat().st_size / 2**20:.2f} | {min(loads):.2f} | {hit_s:.2f} | "
              f"{min(loads) / plan_s:.2f} |")


if __name__ == "__main__":
    main()
