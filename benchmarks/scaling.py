"""Planning time and plan cost of a GPT-style training step as depth grows, written as an
unrolled Python loop (folded into a scan by shardsat) and with lax.scan over stacked layers.

    .venv/bin/python benchmarks/scaling.py                  # 1, 2, 4, 8, 24, 48, 96 layers
    .venv/bin/python benchmarks/scaling.py --layers 1 24    # some depths

fwd + grad + AdamW, d_model 1024, 16 heads, MLP 4096, vocab 4096, seq 512, batch 16, one-hot
embedding, on a 2x4 (data, model) mesh, H100 profile, state_argnums=(0,). Columns: wall seconds of
the whole saturate_and_extract call (tracing included), e-nodes, predicted step time, and the
marginal cost of one more layer (cost(L) - cost(1)) / (L - 1).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from models import GPTConfig, gpt_batch, gpt_params, make_gpt_scan_step, make_gpt_step

import shardsat


def plan_for(layers: int, kind: str) -> shardsat.Plan:
    cfg = GPTConfig(layers=layers, d_model=1024, heads=16, mlp=4096, vocab=4096, seq=512, batch=16, embed="onehot")
    params = gpt_params(cfg, abstract=True)
    if kind == "scan":
        opt, step = make_gpt_scan_step(cfg)
        params["layers"] = jax.tree_util.tree_map(
            lambda *xs: jax.ShapeDtypeStruct((layers, *xs[0].shape), xs[0].dtype), *params["layers"])
    else:
        opt, step = make_gpt_step(cfg)
    state = (params, jax.eval_shape(opt.init, params))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    return shardsat.saturate_and_extract(step, mesh, state, gpt_batch(cfg, abstract=True), profile="h100",
                                         state_argnums=(0,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[1, 2, 4, 8, 24, 48, 96])
    ap.add_argument("--kinds", nargs="*", default=["unrolled", "scan"])
    args = ap.parse_args()
    print("| form | layers | plan s | trace s | e-nodes | step ms | marginal ms/layer | folded scans |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in args.kinds:
        base = None
        for layers in args.layers:
            t = time.perf_counter()
            plan = plan_for(layers, kind)
            wall = time.perf_counter() - t
            cost = plan.cost.total_s * 1e3
            if layers == 1:
                base = cost
            marginal = f"{(cost - base) / (layers - 1):.3f}" if base is not None and layers > 1 else "-"
            print(f"| {kind} | {layers} | {wall:.1f} | {plan.report.trace_s:.1f} | {plan.report.e_nodes:,} | "
                  f"{cost:.2f} | {marginal} | {len(plan.program.scans)} |", flush=True)


if __name__ == "__main__":
    main()
