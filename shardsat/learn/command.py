"""`python -m shardsat priors train|eval`: label the corpus, fit the prior, and measure it on
programs it was not trained on.

The training corpus is learn/corpus.py's cases (seed 0) on every mesh of MESHES, the profile
cycling through PROFILES; the held-out cases are other draws (seed 1: other sizes) of the same
families. The shipped weights (shardsat/data/prior.npz) are `priors train` with its defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..extract.policy import PRIOR_MASS
from ..extract.prior import PriorWeights, resolve
from ..extract.profile import DeviceProfile, get_profile
from . import labels
from .corpus import Case, corpus
from .train import Score, evaluate, train

# the meshes a prior narrows on (2+ axes; the full search labels a program in 1-20 s on 2x4 and
# 5-40 s on 2x2x2 here). Adding 2x2x2x2 (12 programs, 3-140 s each) and training 1000 steps
# made the planned GPT / llama steps worse on 6 of 8 rows of benchmarks/priors.py (RESULTS.md)
MESHES = ((2, 4), (2, 2, 2))
# XLA:CPU's threads split a matrix product by the host's device count: the same examples give
# the same weights (bit for bit) at the same count
DEVICES = 8
PROFILES = ("h100", "slow-links", "cpu")
TRAIN_CASES = 24
EVAL_CASES = 8
EVAL_WIDTH = 8  # layouts kept per value in the recall column (PRIOR_PAIRS over a few thousand values)


def add_parser(sub: Any) -> None:
    """The `priors` command and its `train` and `eval` subcommands."""
    p = sub.add_parser("priors", help="train or evaluate the learned prior over layouts",
                       description="Train the learned prior (priors='builtin' or a weights file) on a corpus of "
                       "programs planned by the full search, or measure one on held-out programs.")
    act = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    t = act.add_parser("train", help="label the corpus and fit the prior's weights")
    t.add_argument("--out", type=Path, required=True, metavar="OUT.npz", help="where to write the weights")
    t.add_argument("--cases", type=int, default=TRAIN_CASES, help=f"corpus programs (default {TRAIN_CASES})")
    t.add_argument("--examples", type=Path, metavar="FILE.npz",
                   help="labelled examples: read if the file exists, else labelled and written there")
    e = act.add_parser("eval", help="measure a prior on held-out programs")
    e.add_argument("--priors", default="builtin", metavar="builtin|FILE.npz", help="the weights (default builtin)")
    e.add_argument("--cases", type=int, default=EVAL_CASES, help=f"held-out programs (default {EVAL_CASES})")
    e.add_argument("--plans", action="store_true",
                   help="also plan each held-out program with the prior and with every layout (slower)")


def profile_named(name: str) -> DeviceProfile:
    """A corpus profile: a preset, or the H100's with links 18x slower (InfiniBand between nodes)."""
    if name == "slow-links":
        return get_profile("h100").with_axes(**{"*": 25e9})
    return get_profile(name)


def meshes() -> Iterator[tuple[tuple[int, ...], Any]]:
    import jax

    devices = jax.devices()
    for shape in MESHES:
        n = int(np.prod(shape))
        names = ("data", "fsdp", "seq", "model")[-len(shape):]
        yield shape, jax.make_mesh(shape, names, devices=devices[:n])


def label_all(cases: list[Case], seed: int, negatives: int | None,
              say: Callable[[str], None]) -> list[labels.Example]:
    """Every case on every mesh, the profile cycling (case i, mesh j: PROFILES[(i + j) % 3])."""
    out = []
    for j, (shape, mesh) in enumerate(meshes()):
        for i, case in enumerate(cases):
            prof = PROFILES[(i + j) % len(PROFILES)]
            try:
                ex = labels.label(case, mesh, profile_named(prof), seed=seed + i, negatives=negatives)
            except Exception as err:  # a program the full search cannot plan teaches nothing
                say(f"  skipped {case.name} on {shape}: {type(err).__name__}: {err}")
                continue
            if ex is not None:
                ex.profile = prof
                out.append(ex)
                say(f"  {case.name} on {'x'.join(map(str, shape))} ({prof}): {len(ex.offsets) - 1} values, "
                    f"{ex.plan_s:.1f} s")
    return out


def run_train(ns: argparse.Namespace) -> int:
    say = _say()
    if ns.examples is not None and ns.examples.exists():
        examples = labels.load(ns.examples)
        say(f"read {len(examples)} examples from {ns.examples}")
    else:
        examples = label_all(corpus(ns.cases, seed=0), 0, labels.NEGATIVES, say)
        if ns.examples is not None:
            labels.save(examples, ns.examples)
    t = time.perf_counter()
    about = (f"{len(examples)} examples: corpus({ns.cases}, seed=0) x meshes {MESHES} x profiles {PROFILES}, "
             f"{sum(len(e.offsets) - 1 for e in examples)} values")
    weights = train(examples, about=about, on_step=lambda i, loss: say(f"  step {i}: loss {loss:.4f}"))
    weights.save(ns.out)
    say(f"trained in {time.perf_counter() - t:.1f} s; wrote {ns.out}")
    return 0


def run_eval(ns: argparse.Namespace) -> int:
    say = _say()
    weights = resolve(ns.priors)
    cases = corpus(ns.cases, seed=1)
    examples = label_all(cases, 1, None, lambda s: None)
    print(f"held-out: corpus({ns.cases}, seed=1), every layout of every value; kept: softmax mass "
          f"{PRIOR_MASS}, at most {EVAL_WIDTH} per value\n")
    print(_table(weights, examples))
    if ns.plans:
        print()
        print(_plans(ns.priors, cases, say))
    return 0


def _table(weights: PriorWeights, examples: list[labels.Example]) -> str:
    """Per family and mesh: values, top-1, recall of the kept layouts, kept / all layouts."""
    groups: dict[tuple[str, str], list[Score]] = {}
    for ex in examples:
        groups.setdefault((ex.family, ex.mesh), []).append(evaluate(weights, ex, PRIOR_MASS, EVAL_WIDTH))
    lines = ["| family | mesh | values | top-1 | recall (kept) | kept / layouts per value |",
             "|---|---|---:|---:|---:|---|"]
    for (fam, mesh), scores in sorted(groups.items()):
        n = sum(s.values for s in scores)
        avg = {k: sum(getattr(s, k) * s.values for s in scores) / n for k in ("top1", "recall", "kept", "layouts")}
        lines.append(f"| {fam} | {mesh} | {n} | {avg['top1']:.3f} | {avg['recall']:.3f} | "
                     f"{avg['kept']:.1f} / {avg['layouts']:.1f} |")
    return "\n".join(lines)


def _plans(priors: str, cases: list[Case], say: Callable[[str], None]) -> str:
    """Each held-out case on 2x2x2 planned with every layout, with the non-learned prior (the
    families, the control) and with the learned one."""
    from ..api import saturate_and_extract

    shape, mesh = next((s, m) for s, m in meshes() if s == (2, 2, 2))
    lines = [f"| case (mesh {'x'.join(map(str, shape))}, h100) | whole us, s | families us, s | prior us, s | "
             "families / whole | prior / whole |", "|---|---|---|---|---:|---:|"]
    for case in cases:
        row = []
        for p in (None, "families", priors):
            t = time.perf_counter()
            plan = saturate_and_extract(case.fn, mesh, *case.args, state_argnums=case.state_argnums,
                                        profile="h100", priors=p)
            row.append((plan.cost.total_s * 1e6, time.perf_counter() - t))
        cells = " | ".join(f"{us:,.1f}, {s:.1f}" for us, s in row)
        lines.append(f"| {case.name} | {cells} | {row[1][0] / row[0][0]:.3f} | {row[2][0] / row[0][0]:.3f} |")
        say(lines[-1])
    return "\n".join(lines)


def _say() -> Callable[[str], None]:
    return lambda text: print(text, file=sys.stderr, flush=True)


__all__ = ["DEVICES", "add_parser", "run_eval", "run_train"]
