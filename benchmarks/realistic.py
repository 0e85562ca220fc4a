"""Ten realistic training steps: shardsat's free plan against a hand-written data-parallel
`jax.jit`, both compiled.

    .venv/bin/python benchmarks/realistic.py                                  # everything
    .venv/bin/python benchmarks/realistic.py --only llama --only moe --meshes 2,4 1,8

Programs: benchmarks/realistic_programs.py (llama, vit, moe, clip, mixed_precision, resnet_bn,
grad_accum, recsys, unet, ssm), H100 profile, on 8 simulated CPU devices; meshes (2,4)
data,model, (2,2,2) data,fsdp,model and (1,8) data,model (`--meshes` picks shapes, `--only`
programs, both repeatable). shardsat plans each step free (no pins) with the program's
state_argnums, so its plan.jit() donates the weights and optimizer state. The expert is data
parallelism as a user writes it: the same state arguments replicated and donated, every data
argument split along its batch dimension over every mesh axis, GSPMD partitioning the rest.

Per program and mesh it prints a markdown table row: planning seconds, shardsat's predicted
step (plan.cost.total_s), the compiled step estimate of each plan (benchmarks/compiled.py: XLA's
cost analysis and the HLO's collectives, one roofline for both, so read the ratio) and its
compiled per-device memory (memory_analysis(): arguments + outputs not aliased + temps), the
two ratios, and whether shardsat.testing.check_plan passes on the concrete arguments. A case
that raises prints its error in its row and the run goes on. Run from a worktree of an older
commit, it measures that commit's shardsat (this checkout's package is imported first).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardsat first

import jax
from compiled import compiled_mib, compiled_step
from jax.sharding import NamedSharding, PartitionSpec
from realistic_programs import PROGRAMS

import shardsat
import shardsat.testing

AXES = {2: ("data", "model"), 3: ("data", "fsdp", "model")}
HEADER = ("| program | mesh | planning s | shardsat predicted us | shardsat compiled us (collectives) "
          "| shardsat MiB | DP compiled us (collectives) | DP MiB | time shardsat/DP | memory shardsat/DP "
          "| check |")
COLUMNS = HEADER.count("|") - 1



def _structs(tree: Any) -> Any:
    """Shapes and dtypes only: planning and compiling need no values (and donate none)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _first_line(e: BaseException) -> str:
    """An exception's first line, safe inside a markdown cell."""
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:200].replace("|", "\\|")


class Expert:
    """Data parallelism as a user writes it: state replicated and donated, each data argument
    split along its batch dimension over every mesh axis."""

    def __init__(self, fn: Any, args: tuple[Any, ...], state: tuple[int, ...], data: dict[int, int],
                 mesh: Any) -> None:
        rep = NamedSharding(mesh, PartitionSpec())
        shardings = []
        for i, a in enumerate(args):
            if i in state:
                shardings.append(jax.tree.map(lambda _: rep, a))
            else:
                spec: list[Any] = [None] * len(a.shape)
                spec[data[i]] = mesh.axis_names
                shardings.append(NamedSharding(mesh, PartitionSpec(*spec)))
        self.mesh = mesh
        self._jit = jax.jit(fn, in_shardings=tuple(shardings), donate_argnums=state)

    def jit(self) -> Any:
        return self._jit


def _check(plan: Any, concrete: tuple[Any, ...]) -> str:
    """check_plan's verdict as a cell: a mismatch or a crash there keeps the row's measurements."""
    try:
        shardsat.testing.check_plan(plan, *concrete)
    except shardsat.testing.PlanMismatchError as e:
        lines = str(e).strip().splitlines()
        return "MISMATCH: " + (lines[1].strip() if len(lines) > 1 else lines[0])[:200].replace("|", "\\|")
    except Exception as e:
        return f"error {type(e).__name__}: {_first_line(e)}"
    return "ok"


def row(name: str, shape: tuple[int, ...]) -> str:
    """One program on one mesh: plan, compile both plans, compare, check."""
    fn, concrete, state, data = PROGRAMS[name]()
    args = _structs(concrete)
    mesh = jax.make_mesh(shape, AXES[len(shape)])
    start = time.perf_counter()
    plan = shardsat.saturate_and_extract(fn, mesh, *args, profile="h100", state_argnums=state)
    planning = time.perf_counter() - start
    mine = compiled_step(plan, args, plan.profile)
    expert = Expert(fn, args, state, data, mesh)
    theirs = compiled_step(expert, args, plan.profile)
    m_mine, m_theirs = compiled_mib(plan.jit().lower(*args).compile()), compiled_mib(expert.jit().lower(*args).compile())
    t_mine, t_theirs = mine.total_us, theirs.total_us
    return (f"| {name} | {'x'.join(map(str, shape))} | {planning:.1f} | {plan.cost.total_s * 1e6:.1f} "
            f"| {t_mine:.1f} ({mine.collectives}) | {m_mine:.1f} | {t_theirs:.1f} ({theirs.collectives}) "
            f"| {m_theirs:.1f} | {t_mine / t_theirs:.3f} | {m_mine / m_theirs:.3f} | {_check(plan, concrete)} |")


def _error_row(name: str, shape: tuple[int, ...], e: Exception, columns: int) -> str:
    """A case that raised: its error in the row, the other cells empty, so the table still renders."""
    cells = [name, "x".join(map(str, shape)), f"ERROR {type(e).__name__}: {_first_line(e)}"]
    return "| " + " | ".join(cells + [""] * (columns - len(cells))) + " |"


def _mesh_shape(text: str) -> tuple[int, ...]:
    shape = tuple(int(s) for s in text.split(","))
    if len(shape) not in AXES:
        raise argparse.ArgumentTypeError(f"a mesh of 2 or 3 axes, e.g. 2,4 or 2,2,2; got {text}")
    return shape


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(PROGRAMS), help="a program (repeatable)")
    ap.add_argument("--meshes", nargs="+", type=_mesh_shape, default=[(2, 4), (2, 2, 2), (1, 8)],
                    help="mesh shapes, e.g. 2,4 2,2,2 1,8")
    ns = ap.parse_args(argv)
    print_table(HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|", ns.only or list(PROGRAMS), ns.meshes,
                row, lambda name, shape, e: _error_row(name, shape, e, COLUMNS))
    return 0


def print_table(header: str, rule: str, names: list[str], meshes: list[tuple[int, ...]],
                row: Callable[[str, tuple[int, ...]], str],
                error_row: Callable[[str, tuple[int, ...], Exception], str]) -> None:
    """A markdown table, one program and mesh at a time (printed as it goes: the runs are long)."""
    print(header)
    print(rule)
    for name in names:
        for shape in meshes:
            try:
                line = row(name, shape)
            except Exception as e:  # one case's failure is a result too; the others still run
                line = error_row(name, shape, e)
            print(line, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
