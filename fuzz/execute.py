"""Run one fuzz case in this process: the reference under jax.jit, the plan, plan.jit(), the
comparison, and the outcome.

Needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 set before jax is imported
(the campaign's workers and tests/conftest.py do that).

Classification (fuzz/outcome.py): the generated program failing under jax.jit is `invalid` (not a
shardsat defect); a ShardsatError from saturate_and_extract is `error`; any other exception
anywhere (planning, plan.jit(), compiling, running) is `crash`; outputs that differ beyond the
tolerance of the program's float dtype, host callbacks that ran a different number of times, or
a plan cheaper than the lower bound its report gives, are `mismatch`; XLA reporting "Involuntary full rematerialization" while compiling the plan is
`remat`; a plan that replicated equations by fallback is `fallback`; otherwise `ok`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

import shardsat
from fuzz.outcome import Outcome
from fuzz.programs import FuzzCase, make_program

REMAT_MARKER = "Involuntary full rematerialization"

# max|sharded - unsharded| / max|unsharded| per output leaf, by the lowest float precision the
# program computes in: float32 sums split over devices add in another order (~1e-6 relative,
# more after a few layers); bf16/f16 programs round every intermediate.
RTOL = {"float32": 2e-4, "float16": 1e-2, "bfloat16": 5e-2}
ATOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}


def _location(exc: BaseException) -> str:
    """The innermost shardsat frame of the traceback (file:function), or where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f"{os.sep}shardsat{os.sep}" in f.filename and f"{os.sep}fuzz{os.sep}" not in f.filename]
    frame = ours[-1] if ours else (frames[-1] if frames else None)
    if frame is None:
        return "?"
    path = frame.filename
    cut = path.rfind(f"{os.sep}shardsat{os.sep}")
    short = path[cut + 1:] if cut >= 0 else os.path.basename(path)
    return f"{short}:{frame.name}"


def _reason(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}"


@contextlib.contextmanager
def capture_fd2(echo: bool = False) -> Iterator[list[str]]:
    """Capture what C++ code (XLA) writes to file descriptor 2; the text is appended to the
    yielded list on exit (and written back to stderr when `echo`)."""
    sys.stderr.flush()
    saved = os.dup(2)
    out: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            out.append(text)
            if echo and text:
                sys.stderr.write(text)


def _place(args: tuple[Any, ...], specs: Any, mesh: Any) -> tuple[Any, ...]:
    return tuple(jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), a, sp)
                 for a, sp in zip(args, specs, strict=True))


def _replicated(specs: Any) -> Any:
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda s: P(), specs, is_leaf=lambda s: isinstance(s, P))


def _mesh_ctx(case: FuzzCase, mesh: Any) -> Any:
    return jax.set_mesh(mesh) if case.options.set_mesh else contextlib.nullcontext()


def _run(fn: Callable[..., Any], args: tuple[Any, ...], events: list[Any]) -> tuple[Any, int]:
    """Call, wait for the results and every host callback; return (outputs, callbacks run)."""
    events.clear()
    out = fn(*args)
    jax.block_until_ready(out)
    jax.effects_barrier()
    return out, len(events)


def _reference(case: FuzzCase, mesh: Any, out: Outcome) -> tuple[tuple[Any, ...], Any, int] | None:
    """jax.jit(fn) on the placed arguments: (args, outputs, callbacks run), or None (invalid).
    If jax rejects the sharded placement of Explicit-axes arguments (sharding in types), the
    arguments are committed replicated instead."""
    specs = case.placement
    replicated = _replicated(specs)
    attempts: list[Any] = [specs] if specs == replicated else [specs, replicated]
    if case.options.placement == "none":
        attempts = [None]
    for i, sp in enumerate(attempts):
        args = case.example_args()
        try:
            args = args if sp is None else _place(args, sp, mesh)
            with capture_fd2() as err, _mesh_ctx(case, mesh):
                want, n = _run(jax.jit(case.fn), args, case.events)
        except Exception as e:
            if i + 1 < len(attempts):
                out.notes.append(f"jax.jit rejected the sharded placement ({_reason(e)}); committed replicated")
                continue
            out.outcome, out.phase, out.reason = "invalid", "reference", f"jax.jit: {_reason(e)}"
            out.detail = traceback.format_exc()
            return None
        if i:
            case.placement = sp
        if REMAT_MARKER in "".join(err):
            out.notes.append("jax.jit itself (the reference) has an involuntary full rematerialization")
        return args, want, n
    return None


def _float_tol(case: FuzzCase) -> str:
    for dt in ("bfloat16", "float16"):
        if f"dtype-{dt}" in case.tags:
            return dt
    return "bfloat16" if "mixed-precision-cast" in case.tags else "float32"


def compare(want: Any, got: Any, paths: list[str], tol: str) -> list[str]:
    """Differences between two output pytrees (empty: equal within tolerance)."""
    wl, wt = jax.tree.flatten(want)
    gl, gt = jax.tree.flatten(got)
    if wt != gt:
        return [f"structure: plan returns {gt}, jax.jit {wt}"]
    bad = []
    for i, (w, g) in enumerate(zip(wl, gl, strict=True)):
        path = paths[i] if i < len(paths) else f"leaf {i}"
        weak = (bool(getattr(g, "weak_type", False)), bool(getattr(w, "weak_type", False)))
        w, g = np.asarray(w), np.asarray(g)
        if weak[0] != weak[1]:  # dtype promotion downstream reads it
            bad.append(f"{path}: plan weak_type {weak[0]}, jax.jit {weak[1]}")
        elif w.shape != g.shape or w.dtype != g.dtype:
            bad.append(f"{path}: plan {g.dtype}{list(g.shape)}, jax.jit {w.dtype}{list(w.shape)}")
        elif w.size and (w.dtype == bool or np.issubdtype(w.dtype, np.integer)):
            n = int(np.sum(g != w))
            if n:
                bad.append(f"{path}: {n} of {w.size} elements differ")
        elif w.size:
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            same = (g64 == w64) | (np.isnan(g64) & np.isnan(w64))
            if same.all():
                continue
            finite = np.isfinite(w64)
            scale = float(np.max(np.abs(w64[finite]))) if finite.any() else 1.0
            diff = float(np.max(np.abs(np.where(same, 0.0, g64 - w64))))
            if not (diff <= ATOL[tol] or diff / (scale or 1.0) <= RTOL[tol]):
                bad.append(f"{path}: relative error {diff / (scale or 1.0):.3g} (max abs {diff:.3g}) > {RTOL[tol]:g}")
    return bad


def _plan(case: FuzzCase, mesh: Any, args: tuple[Any, ...], out: Outcome) -> Any:
    out.phase = "plan"
    t0 = time.perf_counter()
    try:
        with _mesh_ctx(case, mesh), warnings.catch_warnings():
            warnings.simplefilter("ignore", shardsat.MemoryLimitWarning)
            plan = shardsat.saturate_and_extract(case.fn, mesh, *args, **case.options.kwargs())
    except shardsat.ShardsatError as e:
        out.outcome, out.reason, out.location, out.detail = "error", _reason(e), _location(e), traceback.format_exc()
        return None
    except Exception as e:
        out.outcome, out.reason, out.location, out.detail = "crash", _reason(e), _location(e), traceback.format_exc()
        return None
    finally:
        out.plan_s = time.perf_counter() - t0
    out.fallbacks = list(plan.report.fallbacks)
    bound = plan.report.lower_bound_s
    if bound is not None and bound > plan.cost.total_s * (1 + 1e-9) + 1e-15:  # a bound no plan may beat, beaten
        out.outcome, out.reason = "mismatch", (f"lower bound {bound * 1e6:.4f} us above the plan's "
                                               f"{plan.cost.total_s * 1e6:.4f} us")
        return None
    return plan


def _noise_check(case: FuzzCase, plan: Any, mesh: Any, got: Any, want: Any, tol: str) -> tuple[bool, bool]:
    """jax.jit's own sharded run (GSPMD, the plan's in/out shardings): (plan matches it, it
    differs from the unsharded run too). A program whose outputs move that much under any
    sharding (a sum rounding differently flips an argmax) is numerically sensitive."""
    try:
        args = case.example_args()
        args = tuple(jax.tree.map(jax.device_put, args, tuple(plan.in_shardings)))
        with _mesh_ctx(case, mesh):
            gspmd = jax.jit(case.fn, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)(*args)
        jax.block_until_ready(gspmd)
    except Exception:
        return False, False
    return not compare(gspmd, got, case.out_paths, tol), bool(compare(want, gspmd, case.out_paths, tol))


def _leaf_diffs(want: Any, got: Any) -> list[float]:
    """Per output leaf, the largest absolute difference (inf where integers or shapes differ)."""
    out = []
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        w, g = np.asarray(w), np.asarray(g)
        if w.shape != g.shape or not w.size:
            out.append(0.0 if w.shape == g.shape else float("inf"))
        elif np.issubdtype(w.dtype, np.inexact):
            w64, g64 = w.astype(np.float64), g.astype(np.float64)
            same = (w64 == g64) | (np.isnan(w64) & np.isnan(g64))
            out.append(float(np.max(np.abs(np.where(same, 0.0, g64 - w64)))))
        else:
            out.append(0.0 if np.array_equal(w, g) else float("inf"))
    return out


def _within_conditioning(case: FuzzCase, mesh: Any, want: Any, got: Any, tol: str) -> bool:
    """Whether the plan's outputs differ from jax.jit's no more than jax.jit's own outputs move
    when every floating input changes by a few units in the last place (a relative 4 eps, random
    signs): a program whose outputs amplify rounding that much (huge activations summed in
    another order, a flipped argmax or tie) has no better answer to compare with. Twice the
    reference's movement is allowed, leaf by leaf; an integer output must stay equal unless the
    perturbation changes it too."""
    rng = np.random.default_rng(case.seed)

    def nudge(x: Any) -> Any:
        dt = getattr(x, "dtype", None)
        if dt is None or not jax.dtypes.issubdtype(dt, np.floating) or not x.size:
            return x
        sign = jax.numpy.asarray(rng.choice([-1.0, 1.0], size=x.shape), dt)
        return x * (1 + 4 * jax.numpy.finfo(dt).eps * sign)  # keeps a committed argument's sharding

    try:  # fresh arguments placed as the reference's were: the plan's run donated its state
        args = case.example_args()
        args = args if case.options.placement == "none" else _place(args, case.placement, mesh)
        with _mesh_ctx(case, mesh):
            moved, _ = _run(jax.jit(case.fn), tuple(jax.tree.map(nudge, args)), case.events)
    except Exception:
        return False
    plan_diff, ref_move = _leaf_diffs(want, got), _leaf_diffs(want, moved)
    return all(d <= 2 * m or not compare([w], [g], [""], tol)
               for d, m, w, g in zip(plan_diff, ref_move, jax.tree.leaves(want), jax.tree.leaves(got), strict=True))


def _check_run(case: FuzzCase, plan: Any, mesh: Any, args: tuple[Any, ...], want: Any, n_ref: int,
               out: Outcome, echo: bool) -> None:
    out.phase = "run"
    try:
        with capture_fd2(echo) as err, _mesh_ctx(case, mesh):
            got, n_plan = _run(plan.jit(), args, case.events)
    except Exception as e:
        out.outcome, out.reason, out.location, out.detail = "crash", _reason(e), _location(e), traceback.format_exc()
        return
    out.remat = [ln.strip()[:300] for ln in "".join(err).splitlines() if REMAT_MARKER in ln]
    out.phase = "compare"
    tol = _float_tol(case)
    try:
        bad = compare(want, got, case.out_paths, tol)
    except Exception as e:  # the plan's outputs cannot be read back (inconsistent shards)
        out.outcome, out.reason, out.location = "crash", f"reading the plan's outputs: {_reason(e)}", "(plan outputs)"
        out.detail = traceback.format_exc()
        return
    if bad:
        matches_gspmd, unstable = _noise_check(case, plan, mesh, got, want, tol)
        if matches_gspmd and unstable:
            out.notes.append("numerically sensitive: differs from jax.jit as much as jax.jit's own sharded run")
            bad = []
        elif unstable:
            out.notes.append("jax.jit's own sharded run (GSPMD) also differs from the unsharded one")
    if bad and _within_conditioning(case, mesh, want, got, tol):
        out.notes.append("ill-conditioned: jax.jit's outputs move more under a rounding-size change of the "
                         "inputs (a few ulps) than the plan's differ from them")
        bad = []
    if n_plan != n_ref:
        bad.append(f"host callbacks ran {n_plan} times under the plan, {n_ref} under jax.jit")
    bad += _over_limit(case, plan, mesh, args)
    if bad:
        out.outcome, out.reason, out.detail = "mismatch", bad[0], "\n".join(bad)
    elif out.remat:
        out.outcome, out.reason = "remat", out.remat[0]
    else:
        out.outcome = "fallback" if out.fallbacks else "ok"
        if out.fallbacks:
            out.reason = "; ".join(sorted({f.split(" at ")[0] for f in out.fallbacks}))


def _over_limit(case: FuzzCase, plan: Any, mesh: Any, args: tuple[Any, ...]) -> list[str]:
    """A plan returned under an integer `memory_limit` promises that its compiled program fits
    it (issue 14): XLA's memory_analysis() is the judge, not shardsat's estimate."""
    limit = case.options.memory_limit
    if limit is None or case.options.memory not in ("loose", "tight"):
        return []
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "dtype") else x, args)
    with _mesh_ctx(case, mesh):  # shapes only: a run donated the state arguments
        compiled = plan.compiled_memory(*shapes)
    if compiled is None or compiled <= limit:
        return []
    est = f"{plan.cost.memory.total:,}" if plan.cost.memory is not None else "none"
    return [f"compiled memory {compiled:,} bytes per device over memory_limit={limit:,} (estimated {est})"]


def run_case(seed: int, phase: Callable[[str, Outcome], None] = lambda p, o: None, echo: bool = False,
             case: FuzzCase | None = None) -> Outcome:
    """Generate, plan, run and check the case of `seed`. Never raises for a case's failure.
    `phase(name, outcome so far)` is called as each phase starts (the campaign's timeouts say
    where a case was); `echo` writes what XLA printed while compiling the plan back to stderr."""
    t0 = time.perf_counter()
    out = Outcome(seed, "crash", phase="generate")
    phase("generate", out)
    try:
        case = case or make_program(seed)
    except Exception as e:
        out.outcome, out.reason, out.detail = "invalid", f"generator: {_reason(e)}", traceback.format_exc()
        return out
    out.mesh, out.options, out.family, out.tags = case.options.mesh_label(), case.options.summary(), case.family, list(case.tags)
    try:
        _check_case(case, out, phase, echo)
    except Exception as e:  # a defect of the fuzz harness itself: reported, never hidden
        out.outcome, out.reason, out.location = "crash", f"fuzz harness: {_reason(e)}", "fuzz (harness)"
        out.detail = traceback.format_exc()
    finally:
        out.total_s = time.perf_counter() - t0
    return out


def _check_case(case: FuzzCase, out: Outcome, phase: Callable[[str, Outcome], None], echo: bool) -> None:
    if case.invalid:
        out.outcome, out.reason = "invalid", case.invalid
        out.detail = case.namespace.get("invalid_traceback", "")
        return
    mesh = case.options.mesh()
    phase("reference", out)
    ref = _reference(case, mesh, out)
    if ref is None:
        return
    args, want, n_ref = ref
    phase("plan", out)
    plan = _plan(case, mesh, args, out)
    if plan is None:
        return
    phase("run", out)
    _check_run(case, plan, mesh, args, want, n_ref, out, echo)
