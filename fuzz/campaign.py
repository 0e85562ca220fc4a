"""The fuzz campaign: `python -m fuzz --programs N --seed S --workers K --timeout T --budget B`.

Each program is generated, planned, run and checked (fuzz/execute.py) in a long-lived worker
process: a worker sets XLA_FLAGS for 8 simulated CPU devices before it imports jax, and is
killed and replaced when a case runs past the timeout or the process dies (a hard crash in C++).
This process never imports jax. The result is a markdown report: outcome counts, fallbacks by
primitive, planning times, crash/error classes grouped by (exception type, shardsat location),
and one line per failure with its reproducer, `python -m fuzz --only SEED`, which runs that one
case in this process and prints its source and full traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from fuzz.outcome import PASSING, Outcome
from fuzz.report import render

DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
START_TIMEOUT_S = 300.0  # importing jax, shardsat and egglog on a loaded machine
# Generating a program and running it under jax.jit (the reference) may take this many timeouts
# before planning starts; past that the case is invalid (too heavy), not a shardsat timeout.
REFERENCE_FACTOR = 3


def set_device_env() -> None:
    """8 simulated CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("jax was imported before the fuzz worker set XLA_FLAGS for 8 devices")
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}".strip()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")


def _worker(conn: Connection, log_path: str) -> None:
    """Worker main loop: receives seeds, sends ("phase", ...) while a case runs and ("result",
    outcome dict) at its end. Its stdout (jax.debug.print) and stderr go to `log_path`."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    set_device_env()
    from fuzz.execute import run_case

    conn.send(("ready", None))
    while True:
        seed = conn.recv()
        if seed is None:
            return

        def phase(name: str, out: Outcome) -> None:
            conn.send(("phase", {"phase": name, "mesh": out.mesh, "options": out.options, "family": out.family,
                                 "tags": out.tags}))

        print(f"=== seed {seed}", flush=True)
        conn.send(("result", asdict(run_case(seed, phase=phase))))


@dataclass
class Worker:
    proc: Any
    conn: Connection
    started: float
    ready: bool = False
    seed: int | None = None
    case_started: float = 0.0
    deadline: float = 0.0
    info: dict[str, Any] | None = None


class Pool:
    """Long-lived workers; a worker past the timeout or dead is replaced."""

    def __init__(self, n: int, timeout: float, log_dir: str) -> None:
        self.ctx = mp.get_context("spawn")
        self.timeout = timeout
        self.log_dir = log_dir
        self.workers = [self._start() for _ in range(n)]

    def _start(self) -> Worker:
        parent, child = self.ctx.Pipe()
        log = os.path.join(self.log_dir, f"worker-{time.monotonic_ns()}.log")
        proc = self.ctx.Process(target=_worker, args=(child, log), daemon=True)
        proc.start()
        child.close()
        return Worker(proc, parent, time.monotonic())

    def replace(self, w: Worker) -> None:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(5)
        w.conn.close()
        self.workers[self.workers.index(w)] = self._start()

    def close(self) -> None:
        for w in self.workers:
            if w.proc.is_alive():
                with contextlib.suppress(OSError):
                    w.conn.send(None)
                w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()

    def lost(self, w: Worker, outcome: str, reason: str) -> Outcome | None:
        """The outcome of the case `w` was running when it timed out or died; replaces it."""
        out = None
        if w.seed is not None:
            info = w.info or {}
            out = Outcome(w.seed, outcome, info.get("mesh", ""), info.get("options", ""), info.get("family", ""),
                          reason=reason, phase=info.get("phase", ""), tags=info.get("tags", []),
                          total_s=time.monotonic() - w.case_started)
        self.replace(w)
        return out


def _receive(pool: Pool, w: Worker) -> Outcome | None:
    """Handle one message from `w`; the outcome of a finished (or died) case, if any."""
    try:
        kind, payload = w.conn.recv()
    except (EOFError, OSError):
        code = w.proc.exitcode if not w.proc.is_alive() else None
        return pool.lost(w, "crash", f"worker process died (exit code {code}) in phase "
                         f"{(w.info or {}).get('phase', '?')}; see the worker log")
    if kind == "ready":
        w.ready = True
    elif kind == "phase":
        w.info = payload
        if payload["phase"] == "plan":  # the timeout is for planning, compiling and running the plan
            w.deadline = time.monotonic() + pool.timeout
    elif kind == "result":
        w.seed, w.info = None, None
        return Outcome(**payload)
    return None


def _overdue(pool: Pool, now: float) -> list[Outcome]:
    outs = []
    for w in list(pool.workers):
        if w.seed is not None and now > w.deadline:
            phase = (w.info or {}).get("phase", "?")
            if phase in ("plan", "run"):
                out = pool.lost(w, "timeout", f"no result {pool.timeout:.0f} s after planning started (phase: {phase})")
            else:  # generating the program or running it under jax.jit: the program is too heavy
                out = pool.lost(w, "invalid", f"the program itself ran past {REFERENCE_FACTOR * pool.timeout:.0f} s "
                                f"(phase: {phase}) before planning started")
            if out is not None:
                outs.append(out)
        elif not w.ready and now - w.started > START_TIMEOUT_S:
            pool.replace(w)
    return outs


def run_campaign(seeds: list[int], workers: int, timeout: float, budget: float | None,
                 progress: Any = None) -> tuple[list[Outcome], float, str]:
    """Run `seeds` on `workers` processes; returns (outcomes in seed order, wall seconds, log dir)."""
    log_dir = tempfile.mkdtemp(prefix="shardsat-fuzz-")
    t0 = time.monotonic()
    pending = deque(seeds)
    results: list[Outcome] = []
    pool = Pool(max(1, workers), timeout, log_dir)
    try:
        while pending or any(w.seed is not None for w in pool.workers):
            if budget is not None and time.monotonic() - t0 > budget:
                pending.clear()
            for w in pool.workers:
                if w.ready and w.seed is None and pending:
                    w.seed, w.case_started, w.info = pending.popleft(), time.monotonic(), None
                    w.deadline = w.case_started + REFERENCE_FACTOR * pool.timeout
                    w.conn.send(w.seed)
            done: list[Outcome | None] = []
            for conn in wait([w.conn for w in pool.workers], timeout=1.0):
                w = next(x for x in pool.workers if x.conn is conn)
                done.append(_receive(pool, w))
            done += _overdue(pool, time.monotonic())
            for out in done:
                if out is not None:
                    results.append(out)
                    if progress:
                        progress(out, len(results), len(seeds))
    finally:
        pool.close()
    return sorted(results, key=lambda o: o.seed), time.monotonic() - t0, log_dir


def _progress(out: Outcome, i: int, n: int) -> None:
    plan = f"{out.plan_s:.1f}s" if out.plan_s is not None else "-"
    tail = f"  {out.reason[:110]}" if out.outcome not in ("ok",) and out.reason else ""
    print(f"[{i}/{n}] seed {out.seed:>6} {out.outcome:<8} {out.mesh:<8} plan {plan:>6} total {out.total_s:5.1f}s{tail}",
          file=sys.stderr, flush=True)


def run_only(seed: int) -> int:
    """Run one case in this process, printing its source, options and full traceback."""
    set_device_env()
    from fuzz.execute import run_case
    from fuzz.programs import make_program

    case = make_program(seed)
    print(case.describe(), flush=True)
    out = run_case(seed, case=case, echo=True)
    print(f"\n# outcome: {out.outcome}" + (f" ({out.location})" if out.location else ""))
    for label, value in (("reason", out.reason), ("notes", "; ".join(out.notes)),
                         ("fallbacks", "; ".join(out.fallbacks)), ("remat", "\n".join(out.remat))):
        if value:
            print(f"# {label}: {value}")
    plan = f"{out.plan_s:.2f}" if out.plan_s is not None else "-"
    print(f"# planning {plan} s, total {out.total_s:.2f} s")
    if out.detail:
        print(out.detail)
    return 0 if out.outcome in PASSING else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=1000, help="how many programs (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds from the start of planning to the checked result (default 60)")
    ap.add_argument("--budget", type=float, default=None, help="stop starting programs after this many seconds")
    ap.add_argument("--only", type=int, default=None, metavar="SEED", help="run one program here: the reproducer")
    ap.add_argument("--out", default=None, help="also write the markdown report to this file")
    ap.add_argument("--jsonl", default=None, help="also write every outcome as a JSON line to this file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.only is not None:
        return run_only(args.only)
    seeds = list(range(args.seed, args.seed + args.programs))
    outcomes, wall, log_dir = run_campaign(seeds, args.workers, args.timeout, args.budget, _progress)
    command = "python -m fuzz " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(outcomes, wall=wall, command=command.strip(), requested=len(seeds), workers=args.workers,
                  timeout=args.timeout, log_dir=log_dir)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for o in outcomes:
                f.write(json.dumps(asdict(o)) + "\n")
    return 0
