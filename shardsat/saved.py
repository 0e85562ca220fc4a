"""Saved plans: `shardsat.load_plan(path, fn, mesh, *example_args)` and `cache_dir=`.

A plan saved with `plan.save(path)` (or the CLI's --json) is rebuilt by tracing the function
again (cheap) and restoring the saved choices onto that trace: the rule tables are rebuilt, the
e-graph is not (no saturation, no extraction). The file's fingerprints are checked first, each
mismatch named: another mesh (axis names or sizes), other argument shapes or dtypes (by pytree
path), or another program (the first equation that differs, with its source line).

`cache_dir=` keys files by a digest of everything that shapes a plan: the program's
fingerprint, the mesh, the profile and every option.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
from egglog import Ruleset
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .checks import known_keywords, require_mesh
from .egraph.fingerprint import fingerprint
from .egraph.layout import MeshAxes, SpaceTable
from .egraph.rewrite import Rewrite
from .errors import InvalidArgumentError, SavedPlanMismatch, ShardsatError, ShardsatWarning, warn_user
from .extract.cost import CostModel
from .extract.plancost import cost_plan
from .extract.profile import DeviceProfile
from .limits import Limits
from .options import arity_problems, example_problems
from .pins import example_pins, resolve_pins
from .prepare import Prepared, prepare
from .rules.apply import build_tables
from .runtime.jsonout import FORMAT_VERSION, profile_digest
from .runtime.plan import Plan, Report
from .runtime.record import RECORD_VERSION, Origin, decisions, digest, report_from, restore
from .threads import PLANNING


@known_keywords
def load_plan(path: str | os.PathLike[str], fn: Callable[..., Any], mesh: Mesh, *example_args: Any,
              rules: Sequence[Ruleset | Rewrite] = ()) -> Plan:
    """The plan saved at `path` (plan.save, or the CLI's --json), for `fn(*example_args)` on `mesh`.

    The function is traced again and the saved choices restored onto the trace: no saturation
    and no extraction. Refused with a shardsat error naming the difference when the file was saved
    for another mesh (axis names or sizes), other argument shapes or dtypes, or another program.
    rules: the shardsat.Rewrite rules the plan was made with (they change the program planned).
    """
    require_mesh(mesh, "load_plan", "the mesh the plan was saved for")
    with PLANNING:
        return plan_from_data(read(path), fn, mesh, example_args, rules=rules, source=str(path))


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidArgumentError(f"Cannot read saved plan {str(path)!r}: {e.strerror or e}. Consider the path "
                                   "plan.save() or `python -m shardsat plan --json` wrote.") from e
    except ValueError as e:
        raise SavedPlanMismatch(f"Saved plan {str(path)!r} is not valid JSON ({e}). Consider saving it again.") from e
    if not isinstance(data, dict):
        raise SavedPlanMismatch(f"Saved plan {str(path)!r} holds a JSON {type(data).__name__}, not a plan. "
                                "Consider saving it again with plan.save(path).")
    return data


def plan_from_data(data: dict[str, Any], fn: Callable[..., Any], mesh: Mesh, example_args: tuple[Any, ...], *,
                   rules: Sequence[Ruleset | Rewrite] = (), source: str = "the saved plan",
                   prepared: Prepared | None = None) -> Plan:
    """A Plan from a saved plan's JSON data (see load_plan); `prepared`: the program already
    traced for these arguments (saturate_and_extract's cache), else it is traced here."""
    start = time.perf_counter()
    rec = _record(data, source)
    _check_mesh(data, mesh, source)
    if prepared is None:
        prepared = _prepare_checked(rec, fn, mesh, example_args, rules, source)
    _check_program(data, rec, prepared, rules, source)
    program = prepared.program
    spaces = SpaceTable(MeshAxes.from_mesh(mesh))
    tables = build_tables(program, spaces, "replicate")
    profile = DeviceProfile.from_dict(rec["profile"], source=f"the profile in {source}")
    got = restore(rec, program, spaces, tables)
    report = report_from(rec["report"], Report)
    costed = cost_plan(program, got.graph, spaces, tables, got.extraction, model=CostModel(profile, spaces, tables),
                       arg_pins=got.arg_pins, ties=got.ties)
    plan = Plan(fn=fn, program=program, mesh=mesh, spaces=spaces, tables=tables, graph=got.graph,
                costed=costed, profile=profile, report=report,
                arg_pins=got.arg_pins, ties=got.ties, state_argnums=got.state_argnums,
                origin=Origin(prepared.fingerprint, prepared.folded, prepared.rewrites,
                              data["fingerprint"].get("options")))
    if digest(decisions(plan)) != data["fingerprint"]["plan"]:
        raise SavedPlanMismatch(f"{source} did not restore to the plan it records (its choices' digest differs). "
                                "Consider planning again: the file may have been edited or written by another "
                                "version of shardsat.")
    _check_struct_pins(plan, example_args, source)
    report.loaded_from = source
    report.load_s = time.perf_counter() - start
    return plan


def _check_struct_pins(plan: Plan, example_args: tuple[Any, ...], source: str) -> None:
    """A ShapeDtypeStruct's NamedSharding pins its argument (pins.example_pins): a saved plan that
    places the argument otherwise is not the plan asked for (it was loaded silently with its own)."""
    pins = example_pins(example_args, None, plan.mesh)
    if pins is None:
        return
    arg_pins, _ = resolve_pins(plan.program, plan.spaces, pins, None, plan.program.name)
    chosen = plan.costed.assignment.arg_layouts
    for pos, lids in sorted(arg_pins.items()):
        lid = chosen[pos]
        if lid is not None and lid not in lids:
            path = plan.program.arg_paths[pos]
            raise SavedPlanMismatch(
                f"{source} places {path} as {plan.layouts[lid].spec(plan.axes)}, but its example argument is a "
                f"ShapeDtypeStruct pinned to {plan.layouts[min(lids)].spec(plan.axes)}. Consider planning again "
                "with this pin, or passing the struct without a sharding to take the saved plan's layout.")


def _record(data: dict[str, Any], source: str) -> dict[str, Any]:
    fmt = data.get("format")
    rec = data.get("record")
    if fmt != FORMAT_VERSION or not isinstance(rec, dict) or not isinstance(data.get("fingerprint"), dict):
        why = (f"format {fmt!r}, this shardsat reads format {FORMAT_VERSION}" if fmt != FORMAT_VERSION
               else "it has no record of the plan's choices (a plan made outside saturate_and_extract)")
        raise SavedPlanMismatch(f"{source} cannot be loaded: {why}. Consider planning again and saving the plan "
                                "with plan.save(path).")
    if rec.get("version") != RECORD_VERSION:
        raise SavedPlanMismatch(f"{source} holds a plan record of version {rec.get('version')!r} (shardsat "
                                f"{rec.get('shardsat')}); this shardsat reads version {RECORD_VERSION}. "
                                "Consider planning again.")
    return rec


def _check_mesh(data: dict[str, Any], mesh: Mesh, source: str) -> None:
    saved = data["fingerprint"]["mesh"]
    axes = MeshAxes.from_mesh(mesh)
    want = dict(zip(saved["axis_names"], saved["axis_sizes"], strict=True))
    have = dict(zip(axes.names, axes.sizes, strict=True))
    if list(want.items()) != list(have.items()):
        what = "axis names" if list(want) != list(have) else "axis sizes"
        raise SavedPlanMismatch(f"{source} was planned for mesh {want}, not this mesh {have} (the {what} differ). "
                                f"Consider a mesh of shape {tuple(want.values())} with axes {tuple(want)}, or "
                                "planning again for this mesh.")


def _prepare_checked(rec: dict[str, Any], fn: Callable[..., Any], mesh: Mesh, example_args: tuple[Any, ...],
                     rules: Sequence[Ruleset | Rewrite], source: str) -> Prepared:
    """The program traced for loading, the example arguments checked first: they bind to `fn`
    and are arrays; and where tracing fails inside the user's function and the arguments' leaves
    are not at the saved plan's paths (a pytree of another structure), that is the error."""
    problems = arity_problems(fn, example_args) + example_problems(example_args)
    if problems:
        raise InvalidArgumentError(f"load_plan({source!r}, ...) got example arguments it cannot trace:\n"
                                   + "\n".join(f"  * {p}" for p in problems))
    try:
        return prepare(fn, mesh, example_args, rules, bool(rec["folded"]))
    except ShardsatError:
        raise
    except Exception as e:
        saved = [item.rsplit(" ", 1)[0] for item in rec["arguments"]]
        given = ["args" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(example_args)[0]]
        if given == saved:
            raise
        lines = [f"  * {p}: planned, not given" for p in saved if p not in given]
        lines += [f"  * {p}: given, not planned" for p in given if p not in saved]
        raise SavedPlanMismatch(f"{source} was planned for example arguments of another structure (tracing `"
                                f"{getattr(fn, '__name__', fn)}` with these failed: {type(e).__name__}: {e}):\n"
                                + "\n".join(lines[:10] or ["  * the same leaves in another order"])
                                + "\nConsider the example arguments the plan was made for (the same pytrees), or "
                                "planning again for these.") from e


def _check_program(data: dict[str, Any], rec: dict[str, Any], prepared: Prepared,
                   rules: Sequence[Ruleset | Rewrite], source: str) -> None:
    """The traced program is the saved one: arguments first (named by path), then equations."""
    fp = prepared.fingerprint
    saved_args = list(rec["arguments"])
    if list(fp.arguments) != saved_args:
        raise SavedPlanMismatch(f"{source} was planned for other arguments:\n" + _argument_diff(saved_args, fp.arguments)
                                + "\nConsider example arguments of the planned shapes and dtypes, or planning again "
                                "for these.")
    if fp.digest != data["fingerprint"]["program"]:
        raise SavedPlanMismatch(f"{source} was planned for another program than `{prepared.program.name}` traces to: "
                                + _equation_diff(rec, prepared) + ". Consider planning again (saturate_and_extract "
                                "with cache_dir= does so when the program changes).")
    names = tuple(r.name for r in rules if isinstance(r, Rewrite))
    if names != tuple(rec["rewrites"]):
        raise SavedPlanMismatch(f"{source} was planned with rewrite rules {list(rec['rewrites'])}, not {list(names)}. "
                                "Consider load_plan(..., rules=...) with the rules it was planned with.")
    if prepared.folded != bool(rec["folded"]) or \
            fingerprint(prepared.program).digest != data["fingerprint"]["planned_program"]:
        raise SavedPlanMismatch(f"{source}: the program shardsat planned (after rewrites and folding) differs from "
                                "the one traced here. Consider planning again: the file was written by another "
                                "version of shardsat, or with other rules= or fold_loops=.")


def _argument_diff(saved: list[str], have: Sequence[str]) -> str:
    def split(items: Sequence[str]) -> dict[str, str]:
        return dict(item.rsplit(" ", 1) for item in items)

    want, got = split(saved), split(have)
    lines = [f"  * {p}: planned {want[p]}, given {got[p]}" for p in want if p in got and want[p] != got[p]]
    lines += [f"  * {p}: planned {want[p]}, not given" for p in want if p not in got]
    lines += [f"  * {p}: given {got[p]}, not planned" for p in got if p not in want]
    return "\n".join(lines[:10]) + (f"\n  ... {len(lines) - 10} more" if len(lines) > 10 else "")


def _equation_diff(rec: dict[str, Any], prepared: Prepared) -> str:
    width = 8
    text = rec["equations"]
    saved = [text[i:i + width] for i in range(0, len(text), width)]
    fp = prepared.fingerprint
    i = fp.first_difference(saved)
    if i is None:
        return f"its {len(saved)} equations match, but its structure (regions, outputs or constants) differs"
    count = f"{len(fp.equations)} equations here, {len(saved)} when saved"
    if i >= len(fp.equations):
        return f"it ends after equation {i} ({count})"
    return _first_equation(prepared, i) + f" ({count})"


def _first_equation(prepared: Prepared, i: int) -> str:
    """Equation i of the traced program (fingerprint order: before rewrites and folding)."""
    e = prepared.traced.equations[i]
    return f"the first equation that differs is #{i}, `{e.name}` at {e.source}"


# -- cache_dir --------------------------------------------------------------------------------------
def _pins_text(pins: Any) -> str:
    if pins is None:
        return "None"
    leaves = jax.tree_util.tree_flatten_with_path(
        pins, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec | NamedSharding))[0]
    return ";".join(f"{jax.tree_util.keystr(p)}={getattr(x, 'spec', x)}" for p, x in leaves)


def _rule_text(r: Any) -> str:
    """A rule as a cache key names it: a Rewrite by its name, an egglog ruleset by its own name
    (`ruleset(name=...)`, its `ident`: every ruleset was keyed "ruleset:Ruleset" before, so
    a plan made with one was loaded for another). Two rulesets of one name are one key."""
    if isinstance(r, Rewrite):
        return f"rewrite:{r.name}"
    return f"ruleset:{type(r).__name__}:{getattr(r, 'ident', None) or getattr(r, 'name', None) or repr(r)}"


def cache_key(program_digest: str, mesh: Mesh, profile: DeviceProfile, *, limits: Limits, fallback: str,
              rules: Sequence[Any], in_shardings: Any, out_shardings: Any, state_argnums: Any, memory_limit: Any,
              extraction: str, fold_loops: bool | None, priors: str | None = "auto") -> str:
    """A digest of everything a plan depends on (program, mesh, profile, options)."""
    axes = MeshAxes.from_mesh(mesh)
    parts = {
        "format": [FORMAT_VERSION, RECORD_VERSION], "program": program_digest,
        "mesh": [list(axes.names), list(axes.sizes)], "profile": profile_digest(profile), "limits": asdict(limits),
        "fallback": fallback, "rules": [_rule_text(r) for r in rules], "in": _pins_text(in_shardings),
        "out": _pins_text(out_shardings), "state": repr(state_argnums), "memory": repr(memory_limit),
        "extraction": extraction, "fold": repr(fold_loops),
    }
    if priors != "auto":  # keys of plans saved before the option stay the same
        parts["priors"] = repr(priors)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | os.PathLike[str], name: str, key: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:60] or "fn"
    return Path(cache_dir) / f"{safe}-{key[:24]}.json"


def load_cached(path: Path, fn: Callable[..., Any], mesh: Mesh, example_args: tuple[Any, ...], prepared: Prepared,
                rules: Sequence[Any]) -> Plan | None:
    """The plan saved at `path`, or None where there is none or it does not load (then a
    warning says why, and the caller plans again and overwrites it)."""
    if not path.is_file():
        return None
    try:
        return plan_from_data(read(path), fn, mesh, example_args, rules=rules, source=str(path), prepared=prepared)
    except (ShardsatError, KeyError, TypeError, ValueError, IndexError) as e:
        warn_user(f"shardsat: the cached plan {path} does not load ({type(e).__name__}: {e}); planning again.",
                  ShardsatWarning)
        return None


def save_cached(plan: Plan, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
