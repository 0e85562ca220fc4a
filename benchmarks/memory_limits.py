"""memory_limit swept from under the smallest plan to over the free plan: for each limit, the
plan returned (its estimate, XLA's compiled bytes per device and the predicted step time) or the
refusal. What to read: every plan compiles under its limit, a larger limit never fails where a
smaller one succeeds, and the step time falls as the limit rises.

    .venv/bin/python benchmarks/memory_limits.py [--mesh 8] [--limits 16]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardsat first
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import jax
from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

import shardsat

AXES = ("data", "model", "fsdp")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="8", help="mesh shape, e.g. 8 or 2x4")
    ap.add_argument("--limits", type=int, default=16, help="how many limits between the two ends")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore", shardsat.ShardsatWarning)
    cfg = GPTConfig(layers=2, d_model=128, heads=4, mlp=512, vocab=2048, seq=64, batch=16, embed="gather")
    opt, step = make_gpt_step(cfg, eps=1e-4)
    params = gpt_params(cfg, jax.random.key(0))
    state, batch = (params, opt.init(params)), gpt_batch(cfg, jax.random.key(1))
    shape = tuple(int(n) for n in a.mesh.split("x"))
    mesh = jax.make_mesh(shape, AXES[:len(shape)])
    kw = dict(state_argnums=(0,), profile="h100")
    free = shardsat.saturate_and_extract(step, mesh, state, batch, memory_limit=None, **kw)
    top = free.compiled_memory(state, batch)
    try:
        shardsat.saturate_and_extract(step, mesh, state, batch, memory_limit=1000, **kw)
        raise AssertionError("a 1000-byte limit was met")
    except shardsat.NoPlanError as e:
        low = e.memory.total  # type: ignore[attr-defined]
    print(f"GPT step {cfg.layers} layers d{cfg.d_model} on {a.mesh}: free plan estimated {free.cost.memory.total:,}, "
          f"compiled {top:,}, {free.cost.total_s * 1e6:.1f} us; smallest plan estimated {low:,}\n")
    print("| limit | outcome | estimate | compiled | predicted us |\n|---:|---|---:|---:|---:|")
    for i in range(a.limits + 1):
        limit = int(low * 0.9 + (top * 1.02 - low * 0.9) * i / a.limits)
        try:
            p = shardsat.saturate_and_extract(step, mesh, state, batch, memory_limit=limit, **kw)
            print(f"| {limit:,} | ok | {p.cost.memory.total:,} | {p.compiled_memory(state, batch):,} "
                  f"| {p.cost.total_s * 1e6:.1f} |", flush=True)
        except shardsat.NoPlanError as e:
            print(f"| {limit:,} | refused: {str(e)[:60]}... | | | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
