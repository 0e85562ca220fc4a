"""A case's arguments and the options that depend on its shapes.

`build_args` draws the argument values from the seed (the same arrays on every call);
`resolve` checks the program with jax.eval_shape (a generator bug or a program jax rejects makes
the case invalid), then draws pins for the arguments and outputs, the PartitionSpecs arguments
are committed with, and the memory limit; `describe` prints the whole case as a reproducer.
"""

from __future__ import annotations

import pprint
import traceback
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fuzz.builder import ArgSpec
from fuzz.options import random_spec

if TYPE_CHECKING:
    from fuzz.programs import FuzzCase


def _is_spec(x: Any) -> bool:
    return isinstance(x, ArgSpec)


def _value(spec: ArgSpec, rng: np.random.Generator) -> Any:
    shape = spec.shape
    if spec.kind == "normal":
        return jnp.asarray(rng.standard_normal(shape) * spec.scale, dtype=spec.dtype)
    if spec.kind == "positive":
        return jnp.asarray(0.5 + 0.5 * np.abs(rng.standard_normal(shape)), dtype=spec.dtype)
    if spec.kind == "ids":
        return jnp.asarray(rng.integers(0, max(spec.high, 1), shape), dtype=jnp.int32)
    if spec.kind == "mask":
        m = rng.random(shape) < 0.7
        if m.ndim and m.shape[-1]:
            m[..., 0] = True
        return jnp.asarray(m)
    if spec.kind == "flag":
        return jnp.asarray(bool(rng.random() < 0.5))
    if spec.kind == "count":
        return jnp.asarray(spec.high, dtype=jnp.int32)
    if spec.kind == "key":
        return jax.random.key(int(rng.integers(1 << 30)))
    if spec.kind == "rawkey":
        return jax.random.PRNGKey(int(rng.integers(1 << 30)))
    raise ValueError(f"unknown argument kind {spec.kind}")


def build_args(case: FuzzCase) -> tuple[Any, ...]:
    rng = np.random.default_rng([case.seed, 3])
    args: list[Any] = []
    for name, spec in zip(case.arg_names, case.arg_specs, strict=True):
        if name == "opt_state":
            args.append(case.namespace["tx"].init(args[0]))
        else:
            args.append(jax.tree.map(lambda s: _value(s, rng), spec, is_leaf=_is_spec))
    return tuple(args)


def _pins(rng: np.random.Generator, tree: Any, mesh_shape: dict[str, int], p: float) -> Any:
    """A pytree like `tree` (of arrays or ShapeDtypeStructs) with PartitionSpec or None leaves."""
    def one(x: Any) -> Any:
        if rng.random() >= p:
            return None
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return P()
        return random_spec(rng, tuple(x.shape), mesh_shape)

    return jax.tree.map(one, tree)


def _placement(rng: np.random.Generator, case: FuzzCase, args: tuple[Any, ...], mesh_shape: dict[str, int]) -> Any:
    """PartitionSpecs the arguments are committed with: a pinned leaf's pin, else replicated or
    (placement "sharded") a random valid spec."""
    pins = case.options.in_shardings or (None,) * len(args)
    out = []
    for arg, pin in zip(args, pins, strict=True):
        leaves, tree = jax.tree.flatten(arg)
        pin_leaves = [None] * len(leaves) if pin is None else jax.tree.leaves(pin, is_leaf=lambda x: x is None)
        specs = []
        for x, pl in zip(leaves, pin_leaves, strict=True):
            if pl is not None:
                specs.append(pl)
            elif case.options.placement == "sharded" and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                specs.append(random_spec(rng, tuple(x.shape), mesh_shape))
            else:
                specs.append(P())
        out.append(jax.tree.unflatten(tree, specs))
    return tuple(out)


def _nbytes(x: Any) -> int:
    try:
        return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    except TypeError:  # PRNG key dtypes
        return 16


def _memory_limit(case: FuzzCase, args: tuple[Any, ...], out: Any) -> int:
    """Loose: every argument, output and top-level intermediate at once, twice, plus 1 MiB (a
    replicated plan fits); tight: the same without the MiB, split over the devices (plans have
    to shard; where sizes do not divide, none may fit and NoPlanError can be right)."""
    arg_bytes = sum(_nbytes(x) for x in jax.tree.leaves(args))
    jaxpr = jax.make_jaxpr(case.fn)(*args)
    inter = sum(_nbytes(v.aval) for e in jaxpr.eqns for v in e.outvars if hasattr(v.aval, "shape"))
    total = 2 * (arg_bytes + inter + sum(_nbytes(x) for x in jax.tree.leaves(out)))
    if case.options.memory == "tight":
        return max(total // 8, 1024)
    return total + (1 << 20)


def resolve(case: FuzzCase, rng: np.random.Generator) -> None:
    """Check the program's shapes, then draw shape-dependent options. Sets `case.invalid` if
    jax rejects the program (the generator is meant never to produce one)."""
    o = case.options
    mesh_shape = dict(zip(o.axis_names, o.shape, strict=True))
    try:
        args = build_args(case)
        out = jax.eval_shape(case.fn, *args)
    except Exception as e:
        case.invalid = f"eval_shape: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        case.namespace["invalid_traceback"] = traceback.format_exc()
        return
    case.out_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out)[0]]
    if o.pin_inputs:
        o.in_shardings = tuple(_pins(rng, a, mesh_shape, 0.4) for a in args)
    if o.pin_outputs and jax.tree.leaves(out):
        o.out_shardings = _pins(rng, out, mesh_shape, 0.5)
    case.placement = _placement(rng, case, args, mesh_shape)
    if o.memory == "none":
        o.memory_limit = None
    elif o.memory in ("loose", "tight"):
        o.memory_limit = _memory_limit(case, args, out)


def _spec_text(name: str, spec: Any) -> str:
    if spec is None:
        return f"# {name}: tx.init(params)"
    text = pprint.pformat(jax.tree.map(lambda s: s.describe(), spec, is_leaf=_is_spec), width=100, compact=True)
    return "# " + f"{name} = {text}".replace("\n", "\n#   ")


def describe(case: FuzzCase) -> str:
    """The case as text: options, argument shapes, the program source and the planning call."""
    o = case.options
    kw = ", ".join(f"{k}={v!r}" for k, v in o.kwargs().items())
    types = ", ".join(f"jax.sharding.AxisType.{t.capitalize()}" for t in o.axis_types)
    lines = [
        f"# fuzz case {case.seed}: {case.family}{' training step' if case.train else ''}",
        f"# blocks: {', '.join(case.tags)}",
        f"# options: {o.summary()}",
        *(_spec_text(n, s) for n, s in zip(case.arg_names, case.arg_specs, strict=True)),
    ]
    if case.placement is not None and o.placement != "none":
        lines.append(f"# arguments committed with: {case.placement!r}")
    lines += [
        case.source,
        f"mesh = jax.make_mesh({o.shape}, {o.axis_names}, axis_types=({types},))",
        f"# args = fuzz.programs.make_program({case.seed}).example_args()",
        f"plan = shardsat.saturate_and_extract(program, mesh, *args{', ' + kw if kw else ''})",
    ]
    return "\n".join(lines)
