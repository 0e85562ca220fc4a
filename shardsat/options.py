"""Checks of saturate_and_extract's options, run before anything is traced.

Tracing a large model takes seconds, and an option that is wrong (a typo'd flag, a pin on another
mesh, a string where a PartitionSpec belongs) should not cost that, nor surface later as an
unrelated error. Every option is checked; the problems are reported together, one line each
naming the option (and the pytree path of a pin) with a fix, in the style of errors.py.
"""

from __future__ import annotations

import difflib
import inspect
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from egglog import Ruleset
from egglog.egraph import UnstableCombinedRuleset
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .checks import integer, is_bool, optional_bool_problem, real
from .egraph.rewrite import Rewrite
from .errors import InvalidArgumentError
from .extract.policy import METHODS
from .extract.profile import PRESETS, DeviceProfile, is_profile_path
from .limits import Limits

FALLBACKS = (None, "replicate", "error")
MULTIHOST = ("check", "share")
PRIORS = ("auto", "families", "builtin", None)  # or the path of a learned prior's weights
UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


def check_options(fn: Callable[..., Any], mesh: Mesh, example_args: tuple[Any, ...], *, profile: Any,
                  limits: Any, fallback: Any, rules: Any, in_shardings: Any, out_shardings: Any,
                  state_argnums: Any, memory_limit: Any, extraction: Any, progress: Any,
                  fold_loops: Any, cache_dir: Any = None, priors: Any = "auto") -> None:
    """Raise one InvalidArgumentError listing every malformed option (the mesh is checked first)."""
    problems: list[str] = []
    if not callable(fn):
        problems.append(f"fn must be callable (the function to plan), got {type(fn).__name__} {fn!r}.")
    else:
        problems += arity_problems(fn, example_args)
    problems += example_problems(example_args)
    problems += _profile_problems(profile, mesh)
    if limits is not None and not isinstance(limits, Limits):
        hint = f"shardsat.Limits(**{limits!r})" if isinstance(limits, dict) else "shardsat.Limits(seconds=30)"
        problems.append(f"limits must be a shardsat.Limits or None, got {type(limits).__name__} {limits!r}. "
                        f"Consider limits={hint}.")
    if fallback not in FALLBACKS:
        problems.append(f"fallback must be one of {FALLBACKS}, got {fallback!r}.")
    problems += rules_problems(rules)
    top = _top_in_problems(in_shardings, len(example_args))
    problems += top or pin_problems("in_shardings", in_shardings, mesh)
    problems += pin_problems("out_shardings", out_shardings, mesh)
    problems += state_argnums_problems(state_argnums, len(example_args))
    bad = memory_limit_problem(memory_limit)
    if bad:
        problems.append(bad)
    if extraction not in METHODS:
        problems.append(f"extraction must be 'auto', 'greedy' or 'exact', got {extraction!r}.")
    if priors not in PRIORS and not (isinstance(priors, str | os.PathLike) and os.path.isfile(priors)):
        missing = isinstance(priors, os.PathLike) or (isinstance(priors, str) and ("/" in priors or os.sep in priors
                                                                                 or priors.endswith(".npz")))
        problems.append(f"priors must be 'auto', 'families', 'builtin', the path of a prior's weights file or "
                        f"None, got {priors!r}" + (": no such file" if missing else "")
                        + ". Consider priors=None for every layout.")
    for label, flag in (("progress", progress), ("fold_loops", fold_loops)):
        bad = optional_bool_problem(label, flag)
        if bad:
            problems.append(bad + ".")
    if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
        problems.append(f"cache_dir must be a folder's path or None, got {type(cache_dir).__name__} {cache_dir!r}. "
                        "Consider cache_dir='plans/'.")
    elif cache_dir is not None and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        problems.append(f"cache_dir {os.fspath(cache_dir)!r} is a file, not a folder (plans are saved there, one "
                        "file each). Consider a folder's path, e.g. cache_dir='plans/'.")
    elif cache_dir is not None and (why := _unwritable(os.fspath(cache_dir))):
        problems.append(f"cache_dir {os.fspath(cache_dir)!r} cannot hold saved plans: {why}. Consider a folder "
                        "this process may write, e.g. cache_dir='plans/'.")
    if len(problems) == 1:
        raise InvalidArgumentError(f"saturate_and_extract: {problems[0]}")
    if problems:
        raise InvalidArgumentError(
            f"saturate_and_extract got {len(problems)} malformed options:\n"
            + "\n".join(f"  * {p}" for p in problems))


def arity_problems(fn: Callable[..., Any], example_args: tuple[Any, ...]) -> list[str]:
    """fn takes as many positional arguments as there are examples (a common slip: one tuple
    of them, saturate_and_extract(fn, mesh, (params, x)), instead of saturate_and_extract(fn, mesh,
    params, x))."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []  # a callable without a signature: tracing will tell
    try:
        sig.bind(*example_args)
    except TypeError as e:
        name = getattr(fn, "__name__", None) or type(fn).__name__
        hint = " (one tuple of them? pass them unpacked: saturate_and_extract(fn, mesh, *args))" \
            if len(example_args) == 1 and isinstance(example_args[0], tuple) else ""
        return [f"`{name}{sig}` cannot be called with the {len(example_args)} example argument(s) given{hint}: {e}. "
                "Consider one example argument (array, jax.ShapeDtypeStruct or pytree of them) per positional "
                "parameter, binding the others with functools.partial."]
    return []


def example_problems(example_args: tuple[Any, ...]) -> list[str]:
    """Leaves of the example arguments are arrays, jax.ShapeDtypeStructs or Python numbers, of a
    dtype jax arrays hold (strings and objects traced through an identity function unnoticed)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(example_args)[0]:
        where = "args" + jax.tree_util.keystr(path)
        if isinstance(leaf, bool | int | float | complex):
            continue
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            out.append(f"example argument {where} is {type(leaf).__name__} {leaf!r:.60}, not an array. Consider "
                       "arrays or jax.ShapeDtypeStruct leaves, binding static arguments with functools.partial.")
        elif not _array_dtype(leaf.dtype):
            out.append(f"example argument {where} has dtype {leaf.dtype}, which jax arrays do not hold. Consider a "
                       "numeric, boolean or PRNG key array.")
    return out


def _array_dtype(dtype: Any) -> bool:
    """A dtype jax arrays hold: numbers (bfloat16, int4 and float8 too), bool, PRNG keys."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
                    or jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
    except TypeError:
        return False


def _profile_problems(profile: Any, mesh: Mesh) -> list[str]:
    if isinstance(profile, os.PathLike) or (isinstance(profile, str) and is_profile_path(profile)):
        try:
            profile = DeviceProfile.load(profile)
        except InvalidArgumentError as e:
            return [str(e)]
    if isinstance(profile, DeviceProfile):
        return _profile_axes_problems(profile, mesh)
    if profile is None:
        return []
    presets = ", ".join(repr(p) for p in sorted(PRESETS))
    if isinstance(profile, str):
        if profile.lower().replace("-", "_") in PRESETS:
            return []
        return [f"Unknown device profile {profile!r}. Consider one of the presets {presets}, the path of a "
                "saved profile (.json), or a shardsat.DeviceProfile(flops_per_s=..., hbm_bytes_per_s=..., link_bytes_per_s=..., latency_s=...)."]
    return [f"profile must be a preset name ({presets}), a saved profile's path, a shardsat.DeviceProfile or None, got "
            f"{type(profile).__name__} {profile!r}."]


def _profile_axes_problems(profile: DeviceProfile, mesh: Mesh) -> list[str]:
    """A profile's per-axis rates (dicts) cover every mesh axis, by name or under '*'."""
    out = []
    for label, rate in (("link_bytes_per_s", profile.link_bytes_per_s), ("latency_s", profile.latency_s)):
        if isinstance(rate, Mapping) and "*" not in rate:
            missing = [str(n) for n in mesh.axis_names if n not in rate]
            if missing:
                out.append(f"profile's {label} has no entry for mesh axis {', '.join(map(repr, missing))} (it has "
                           f"{sorted(rate)}). Consider adding them, or a default under '*'.")
    return out


def profile_axes_unknown(profile: DeviceProfile, mesh: Mesh) -> str | None:
    """Per-axis rates under names the mesh lacks: a misspelt axis (`with_axes(dta=...)`) was
    ignored silently, the plan priced by the default. Not an error: one measured profile may
    serve several meshes."""
    names = [str(n) for n in mesh.axis_names]
    odd = sorted({str(k) for rate in (profile.link_bytes_per_s, profile.latency_s) if isinstance(rate, Mapping)
                  for k in rate if k != "*" and k not in names})
    if not odd:
        return None
    hints = [f"{k!r} -> {near[0]!r}" for k in odd if (near := difflib.get_close_matches(k, names, n=1))]
    return (f"The profile gives link rates or latencies for axes {', '.join(map(repr, odd))}, which mesh {tuple(names)} lacks: "
            "they are not used." + (f" Did you mean {', '.join(hints)}?" if hints else ""))


def rules_problems(rules: Any) -> list[str]:
    """rules= is a sequence of shardsat.Rewrite and egglog rulesets."""
    accepted = "shardsat.Rewrite(name, lhs, rhs, example_args) or egglog rulesets (egglog.ruleset(...))"
    if isinstance(rules, Rewrite | Ruleset | UnstableCombinedRuleset):
        return [f"rules must be a list, got a single {type(rules).__name__}. Consider rules=[rule]."]
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        return [f"rules must be a list of {accepted}, got {type(rules).__name__} {rules!r}."]
    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, Rewrite | Ruleset | UnstableCombinedRuleset):
            out.append(f"rules[{i}] is {type(r).__name__} {r!r}; rules= takes {accepted}.")
    return out


def _top_in_problems(in_shardings: Any, n_args: int) -> list[str]:
    """in_shardings is a tuple with one entry per positional argument (as jax.jit's)."""
    if in_shardings is None or (isinstance(in_shardings, tuple | list) and len(in_shardings) == n_args):
        return []
    if isinstance(in_shardings, tuple | list):
        return [f"in_shardings has {len(in_shardings)} entries but the function is planned with {n_args} "
                "positional arguments. Consider a tuple with one entry (a PartitionSpec, a pytree of them, or "
                "None) per argument."]
    if isinstance(in_shardings, str):
        fix = f"({_spec_fix(in_shardings)},)"
    elif isinstance(in_shardings, PartitionSpec | NamedSharding):
        fix = f"({in_shardings!r},)" + ("" if n_args == 1 else " plus one entry per further argument")
    else:
        fix = "(P('data'), None)"
    return [f"in_shardings must be a tuple with one entry per positional argument ({n_args}), got "
            f"{type(in_shardings).__name__} {in_shardings!r}. Consider in_shardings={fix}."]


def _spec_fix(text: str) -> str:
    """The PartitionSpec a string pin probably meant: 'data' -> P('data'), 'data,model' -> P('data', 'model')."""
    names = [t.strip() for t in text.replace(" ", ",").split(",") if t.strip()]
    return "P(" + ", ".join(repr(n) for n in names) + ")"


def pin_problems(label: str, pins: Any, mesh: Mesh) -> list[str]:
    """Leaves of a pin pytree are PartitionSpec, NamedSharding on the plan's mesh, None or
    P.UNCONSTRAINED (free); spec entries are axis names, tuples of them, None or P.UNCONSTRAINED."""
    if pins is None:
        return []
    leaves = jax.tree_util.tree_flatten_with_path(
        pins, is_leaf=lambda x: x is None or x is UNCONSTRAINED or isinstance(x, PartitionSpec | NamedSharding))[0]
    out: list[str] = []
    for path, leaf in leaves:
        where = label + jax.tree_util.keystr(path)
        if leaf is None or leaf is UNCONSTRAINED:
            continue
        if isinstance(leaf, str):
            out.append(f"{where} is the string {leaf!r}, which would be read as a spec of one mesh axis per "
                       f"character. Consider {_spec_fix(leaf)} (from jax.sharding import PartitionSpec as P).")
            continue
        if isinstance(leaf, NamedSharding):
            bad = _mesh_mismatch(leaf.mesh, mesh)
            if bad:
                out.append(f"{where} is a NamedSharding on {bad}. Consider the bare PartitionSpec "
                           f"{leaf.spec!r} (it is read on the plan's mesh) or NamedSharding(mesh, spec) with the "
                           "mesh passed to saturate_and_extract.")
                continue
            leaf = leaf.spec
        if not isinstance(leaf, PartitionSpec):
            out.append(f"{where} is {type(leaf).__name__} {leaf!r}; pins are PartitionSpec, NamedSharding or None "
                       "(free) leaves. Consider P('data') or None.")
            continue
        for d, entry in enumerate(leaf):
            names = entry if isinstance(entry, tuple) else (entry,)
            if entry is None or entry is UNCONSTRAINED or (names and all(isinstance(n, str) for n in names)):
                continue
            out.append(f"{where} = {leaf!r} has entry {entry!r} for dimension {d}; entries are mesh axis names, "
                       "tuples of them, None (replicated) or P.UNCONSTRAINED (free).")
    return out


def _mesh_mismatch(other: Any, mesh: Mesh) -> str | None:
    """How a pin's mesh differs from the plan's, or None if it is the same mesh (axis types aside)."""
    mine = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    theirs = dict(zip(other.axis_names, other.axis_sizes, strict=True))
    if tuple(mine.items()) != tuple(theirs.items()):
        return f"mesh {theirs}, not the plan's mesh {mine}"
    devices = getattr(other, "devices", None)
    if devices is not None and [d.id for d in devices.flat] != [d.id for d in mesh.devices.flat]:
        return (f"a mesh of other devices (ids {[d.id for d in devices.flat]}; the plan's mesh has "
                f"{[d.id for d in mesh.devices.flat]})")
    return None


def state_argnums_problems(state_argnums: Any, n_args: int) -> list[str]:
    """None, "auto", an argument position or a sequence of distinct positions."""
    if state_argnums is None or state_argnums == "auto":
        return []
    fix = "Consider state_argnums=(0,) (the positions of the state arguments) or 'auto'."
    if isinstance(state_argnums, numbers.Integral) and not is_bool(state_argnums):
        nums = [state_argnums]
    elif isinstance(state_argnums, Sequence) and not isinstance(state_argnums, str):
        nums = list(state_argnums)
    else:
        return [f"state_argnums must be an argument position, a tuple of them, 'auto' or None, got "
                f"{type(state_argnums).__name__} {state_argnums!r}. {fix}"]
    bad = [n for n in nums if is_bool(n) or not isinstance(n, numbers.Integral) or not 0 <= n < n_args]
    if bad:
        return [f"state_argnums={state_argnums!r} names {', '.join(map(repr, bad))}, but the function is planned "
                f"with {n_args} positional argument(s) (positions 0..{n_args - 1}). {fix}"]
    if len(set(nums)) != len(nums):
        return [f"state_argnums={state_argnums!r} names an argument twice. {fix}"]
    return []


def multihost_problem(multihost: Any) -> str | None:
    if multihost in MULTIHOST:
        return None
    return (f"multihost must be one of {MULTIHOST}, got {multihost!r}. Consider multihost='share' to plan in "
            "process 0 only.")


def memory_limit_problem(memory_limit: Any) -> str | None:
    """None, "device" or a whole number of bytes >= 1 (1e9 is fine; True, 0.5 and NaN are not)."""
    if memory_limit is None or memory_limit == "device":
        return None
    if real(memory_limit) is not None and integer(memory_limit) is not None:
        return None
    return (f"memory_limit must be a whole number of bytes per device (>= 1), 'device' or None, got "
            f"{type(memory_limit).__name__} {memory_limit!r}. Consider memory_limit=16 * 2**30 (16 GiB).")


def signature_problems(primitive: Any, spec: Any, reduction_factors: Any, need_replication_factors: Any,
                       linear: Any, flops_per_element: Any) -> list[str]:
    """register_signature's arguments, before the spec is parsed (whose errors name the rule)."""
    from jax.experimental.custom_partitioning import custom_partitioning

    out = []
    if not (isinstance(primitive, str | custom_partitioning) or hasattr(primitive, "bind")):
        kind = f"function `{getattr(primitive, '__qualname__', '?')}`" if callable(primitive) else \
            f"{type(primitive).__name__} {primitive!r}"
        out.append(f"primitive must be a jax Primitive (jax.extend.core.Primitive), a primitive's name or a "
                   f"custom_partitioning function, got {kind}. Consider decorating the function with "
                   "jax.experimental.custom_partitioning and calling def_partition first.")
    if not isinstance(spec, str):
        out.append(f"spec must be a string such as 'b d, d -> b d', got {type(spec).__name__} {spec!r}.")
    for label, fs in (("reduction_factors", reduction_factors), ("need_replication_factors", need_replication_factors)):
        if isinstance(fs, str):
            out.append(f"{label} is the string {fs!r}, which would be read one factor per character. Consider "
                       f"{label}={tuple(fs.replace(',', ' ').split())!r}.")
        elif not isinstance(fs, Sequence | set | frozenset) or not all(isinstance(f, str) for f in fs):
            out.append(f"{label} must be a tuple of factor names, got {fs!r}. Consider {label}=('d',).")
    groups_ok = isinstance(linear, Sequence) and not isinstance(linear, str) and all(
        isinstance(g, Sequence) and not isinstance(g, str)
        and all(isinstance(i, numbers.Integral) and not is_bool(i) for i in g) for g in linear)
    if not groups_ok:
        out.append(f"linear must be a list of operand-position groups such as [(0,), (1,)], got {linear!r}.")
    if real(flops_per_element, positive=False) is None:
        out.append(f"flops_per_element must be a finite non-negative number (the cost model multiplies it by "
                   f"the result's elements), got {flops_per_element!r}. Consider flops_per_element=1.0.")
    return out


def _unwritable(folder: str) -> str | None:
    """Why plans cannot be saved in `folder` (made if missing, as saving would), or None: checked
    before planning, so that the search's minutes are not lost to a raw OSError at the end."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None if os.access(folder, os.W_OK | os.X_OK) else "the folder is not writable"
