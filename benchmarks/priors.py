"""Planning on meshes of three and four axes, with and without a prior over layouts (issue 13).

    .venv/bin/python benchmarks/priors.py                          # every workload and mesh (~25 min)
    .venv/bin/python benchmarks/priors.py --only gpt --meshes 2,2,2,2
    .venv/bin/python benchmarks/priors.py --whole                  # also priors=None on 4-axis meshes
    .venv/bin/python benchmarks/priors.py --learned                # also priors="builtin"

Workloads: GPT and llama training steps (d_model 512, 8 heads, 4 layers, vocabulary 8192, sequence
256, batch 32, AdamW; all arguments ShapeDtypeStructs; H100 profile), on 64 simulated CPU devices
(meshes of fewer use the first ones). Per workload and mesh:
- "default": `priors="auto"`, what a user gets: the whole e-graph, or narrowed where the program
  has more (value, layout) pairs than `policy.NARROW_PAIRS`;
- "families": `priors="families"`, always narrowed by the non-learned prior (the standard
  families propagated, extract/propagate.py);
- "whole": `priors=None`, every layout (on 4-axis meshes only with --whole: it passes the node
  limit there);
- with --learned, "learned": `priors="builtin"`, narrowed by the learned prior (extract/prior.py;
  none of these workloads is in its training corpus, shardsat/learn/corpus.py), and its ratio to
  the whole e-graph's plan (to the families' on 4-axis meshes);
- every hand-written expert of benchmarks/experts/transformer.py pinned (default priors); the
  table gives the best.
Columns: planning wall time, e-nodes, (value, layout) pairs left out, predicted step time
(`plan.cost.total_s`), and the ratios the issue asks for. Nothing is compiled or run.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()

import argparse
import datetime
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent / "experts"))

from common import S, adamw_step, make_mesh
from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step
from transformer import experts, llama_loss, llama_params

import shardsat

LAYERS, D, HEADS, VOCAB, SEQ, BATCH = 4, 512, 8, 8192, 256, 32
MESHES = ((2, 2, 2), (2, 2, 2, 2), (4, 4, 4), (2, 2, 2, 4))


def build(model: str) -> tuple[Any, tuple[Any, ...], Any, Any]:
    """(step, args, params, opt_state) of one workload."""
    if model == "gpt":
        cfg = GPTConfig(layers=LAYERS, d_model=D, heads=HEADS, mlp=4 * D, vocab=VOCAB, seq=SEQ, batch=BATCH)
        opt, step = make_gpt_step(cfg)
        params, batch = gpt_params(cfg, abstract=True), gpt_batch(cfg, abstract=True)
    else:
        opt, step = adamw_step(llama_loss)
        params = llama_params(LAYERS, D, HEADS, 3 * D, VOCAB)
        batch = {"tokens": S(BATCH, SEQ, dtype="int32"), "targets": S(BATCH, SEQ, dtype="int32")}
    opt_state = jax.eval_shape(opt.init, params)
    return step, ((params, opt_state), batch), params, opt_state


@dataclass
class Run:
    wall_s: float
    us: float | None = None
    nodes: int = 0
    narrowed: int = 0
    error: str | None = None

    def cell(self) -> str:
        if self.us is None:
            return f"ERR {self.error}"[:60]
        return f"{self.us:,.0f} us, {self.wall_s:.1f} s, {self.nodes / 1e3:,.0f}k nodes, {self.narrowed / 1e3:,.0f}k out"


def plan(step: Any, mesh: Any, args: tuple[Any, ...], priors: str | None, pins: Any = None) -> Run:
    t = time.perf_counter()
    try:
        p = shardsat.saturate_and_extract(step, mesh, *args, state_argnums=(0,), profile="h100", priors=priors,
                                          in_shardings=pins)
    except Exception as e:  # a failing plan is a table entry
        return Run(time.perf_counter() - t, error=f"{type(e).__name__}: {e}")
    return Run(time.perf_counter() - t, p.cost.total_s * 1e6, p.report.e_nodes, p.report.narrowed)


def ratio(a: Run, b: Run | None) -> str:
    return "-" if b is None or a.us is None or b.us is None else f"{a.us / b.us:.3f}"


def row(model: str, shape: tuple[int, ...], whole: bool, learned: bool) -> str:
    mesh = make_mesh(shape)
    step, args, params, opt_state = build(model)
    default = plan(step, mesh, args, "auto")
    fam = default if default.narrowed else plan(step, mesh, args, "families")
    full = None
    if len(shape) < 4 or whole:
        full = default if not default.narrowed else plan(step, mesh, args, None)
    pinned = {name: plan(step, mesh, args, "auto", pins) for name, pins in experts(mesh, params, opt_state).items()}
    ok = {n: r for n, r in pinned.items() if r.us is not None}
    best = min(ok, key=lambda n: ok[n].us or 0.0) if ok else None
    label = "x".join(map(str, shape))
    best_cell = f"{best} {ok[best].us:,.0f} us" if best else "-"
    cells = ""
    if learned:
        lr = plan(step, mesh, args, "builtin")
        cells = f" {lr.cell()} | {ratio(lr, full or fam)} |"
    return (f"| {model} | {label} | {default.cell()} | {fam.cell()} | {full.cell() if full else 'not run'} "
            f"| {ratio(fam, full)} |{cells} {best_cell} | {ratio(default, ok[best] if best else None)} |")


def header(learned: bool) -> str:
    cols = ["workload", "mesh", "default (priors='auto')", "families", "whole (priors=None)", "families/whole"]
    if learned:
        cols += ["learned (priors='builtin')", "learned/whole (4 axes: /families)"]
    cols += ["best expert", "default/best expert"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("gpt", "llama"), help="one workload")
    ap.add_argument("--meshes", nargs="+", metavar="SHAPE", help="e.g. 2,2,2,2 4,4,4")
    ap.add_argument("--whole", action="store_true", help="also priors=None on 4-axis meshes")
    ap.add_argument("--learned", action="store_true", help="also priors='builtin' (the learned prior)")
    ns = ap.parse_args(argv)
    meshes = [tuple(int(x) for x in m.split(",")) for m in ns.meshes] if ns.meshes else list(MESHES)
    cmd = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/priors.py", *(argv or sys.argv[1:])])
    print(f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, jax {jax.__version__}: `{cmd}`\n")
    print(header(ns.learned), flush=True)
    for model in ([ns.only] if ns.only else ["gpt", "llama"]):
        for shape in meshes:
            print(row(model, shape, ns.whole, ns.learned), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
