"""User pins: in_shardings / out_shardings pytrees where None means "free" and a PartitionSpec
(or NamedSharding) is a hard constraint. A `P.UNCONSTRAINED` entry leaves that dimension free (a
`P.UNCONSTRAINED` leaf, the whole value): a pin is the set of layouts it allows. Conflicts are
collected and reported together, in the style of shard_map's errors."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .egraph.layout import Layout, SpaceTable, spec_to_layout
from .egraph.program import Literal, Program, is_extended
from .egraph.ties import resolve_ties as resolve_ties  # re-exported: it was defined here
from .errors import InvalidArgumentError

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


def _is_leaf(x: Any) -> bool:
    return x is None or x is UNCONSTRAINED or isinstance(x, PartitionSpec | NamedSharding)


def _flat_pins(pins: Any, tree: Any, label: str) -> list[Any]:
    """Broadcast a pytree prefix of pins to the flat leaves of `tree`."""
    if pins is None:
        return [None] * tree.num_leaves
    flat: list[Any] = []

    def expand(p: Any, sub: Any) -> None:
        # one pin per leaf under it: none for a None argument or output, which has no leaves
        # (mapping the pin over it and flattening with None as a leaf counted one, and every
        # later pin landed on the value after its own)
        flat.extend([None if p is UNCONSTRAINED else p] * len(jax.tree_util.tree_leaves(sub)))

    try:
        jax.tree_util.tree_map(expand, pins, jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves),
                               is_leaf=_is_leaf)
    except ValueError as e:
        what = "arguments" if label == "in_shardings" else "outputs"
        raise InvalidArgumentError(
            f"{label} does not match the structure of the {what} ({tree}): {e}. Consider a pytree prefix of "
            f"the {what} with PartitionSpec or None leaves."
        ) from e
    assert len(flat) == tree.num_leaves, (len(flat), tree.num_leaves)
    return flat


def pinned_layouts(spec: PartitionSpec, shape: tuple[int, ...], dtype: Any,
                   spaces: SpaceTable) -> tuple[frozenset[int] | None, str | None]:
    """The layout ids a spec allows (one, unless some entries are P.UNCONSTRAINED: those
    dimensions take any split the other dimensions leave axes for), or (None, why not)."""
    free = {d for d, e in enumerate(spec) if e is UNCONSTRAINED}
    fixed = PartitionSpec(*[None if d in free else e for d, e in enumerate(spec)])
    want, why = spec_to_layout(fixed, shape, spaces.mesh)
    if want is None:
        return None, why
    if 0 in shape or is_extended(dtype):  # only the replicated layout exists (egraph/layout.py)
        return frozenset({spaces.space(shape, dtype).layouts[0]}), None
    if not free:
        return frozenset({spaces.layouts.intern(want)}), None
    used = {a for d, axes in enumerate(want.dims) if d not in free for a in axes}

    def allowed(lay: Layout) -> bool:
        return not lay.partial and all(lay.dims[d] == want.dims[d] for d in range(len(shape)) if d not in free) \
            and not any(a in used for d in free for a in lay.dims[d])

    lays = frozenset(lid for lid in spaces.space(shape, dtype).layouts if allowed(spaces.layouts[lid]))
    return (lays, None) if lays else (None, "no layout of this value keeps the pinned dimensions")


def resolve_pins(
    program: Program,
    spaces: SpaceTable,
    in_shardings: Any,
    out_shardings: Any,
    fn_name: str,
) -> tuple[dict[int, frozenset[int]], dict[int, frozenset[int]]]:
    """(arg position -> layout ids it may take, output position -> layout ids), or one error
    listing every conflict. A full spec allows one layout."""
    axes = spaces.mesh
    problems: list[str] = []
    arg_pins: dict[int, frozenset[int]] = {}
    out_pins: dict[int, frozenset[int]] = {}
    if in_shardings is not None:
        if not isinstance(in_shardings, tuple | list) or len(in_shardings) != len(program.arg_counts):
            raise InvalidArgumentError(
                f"in_shardings for `{fn_name}` must be a tuple with one entry per positional argument "
                f"({len(program.arg_counts)}), got {in_shardings!r}."
            )
        in_shardings = tuple(in_shardings)
    flat_in = _flat_pins(in_shardings, program.in_tree, "in_shardings")
    for pos, pin in enumerate(flat_in):
        if pin is None:
            continue
        spec = pin.spec if isinstance(pin, NamedSharding) else pin
        v = program.values[program.args[pos]]
        lays, why = pinned_layouts(spec, v.shape, v.dtype, spaces)
        if lays is None:
            problems.append(f"  * {program.arg_paths[pos]}: shape {v.shape}, spec {spec}: {why}")
            continue
        arg_pins[pos] = lays
    flat_out = _flat_pins(out_shardings, program.out_tree, "out_shardings")
    for k, pin in enumerate(flat_out):
        if pin is None:
            continue
        spec = pin.spec if isinstance(pin, NamedSharding) else pin
        o = program.outputs[k]
        shape = () if isinstance(o, Literal) else program.values[o].shape
        dtype = o.dtype if isinstance(o, Literal) else program.values[o].dtype
        lays, why = pinned_layouts(spec, shape, dtype, spaces)
        if lays is None:
            problems.append(f"  * {program.out_paths[k]}: shape {shape}, spec {spec}: {why}")
            continue
        out_pins[k] = lays
    if problems:
        mesh = ", ".join(f"{n}={s}" for n, s in zip(axes.names, axes.sizes, strict=True))
        raise InvalidArgumentError(
            f"Pinned shardings for `{fn_name}` cannot hold on mesh ({mesh}):\n" + "\n".join(problems)
            + "\nConsider specs whose axes divide the pinned dimensions, in mesh order, or None to leave "
            "an argument free."
        )
    return arg_pins, out_pins


def check_tied_pins(program: Program, spaces: SpaceTable, arg_pins: dict[int, frozenset[int]],
                    out_pins: dict[int, frozenset[int]], ties: list[tuple[int, int]], fn_name: str) -> None:
    """One error listing every state tie (state_argnums: an argument and the output it becomes
    keep one layout) whose argument and output are pinned to layouts with none in common: no
    plan exists, and the search would only say that some output has no layout."""
    def specs(lids: frozenset[int]) -> str:
        return " or ".join(sorted(str(spaces.layouts[lid].spec(spaces.mesh)) for lid in lids)[:3])

    problems = []
    for a, k in ties:
        if a in arg_pins and k in out_pins and not arg_pins[a] & out_pins[k]:
            problems.append(f"  * {program.arg_paths[a]} is pinned to {specs(arg_pins[a])} by in_shardings, and the "
                            f"output it becomes, {program.out_paths[k]}, to {specs(out_pins[k])} by out_shardings")
    if problems:
        raise InvalidArgumentError(
            f"Pinned shardings for `{fn_name}` conflict with its state_argnums (a state keeps one layout in and "
            "out):\n" + "\n".join(problems) + "\nConsider one spec for both, or pinning only one of them.")


def unkept_pins(program: Program, example_args: tuple[Any, ...], in_shardings: Any, out_shardings: Any
                ) -> list[str]:
    """The user's pins no plan keeps, each as "where: what; why": a split of a PRNG key array
    (plans keep key arrays replicated) and a memory kind other than device memory (plans place
    every array in device memory). They were dropped with a warning at most, and the report did
    not list them (it lists the with_sharding_constraint calls dropped)."""
    out: list[str] = []
    flat_in = _flat_pins(in_shardings, program.in_tree, "in_shardings")
    flat_out = _flat_pins(out_shardings, program.out_tree, "out_shardings")
    for path, vid, pin in [*zip(program.arg_paths, program.args, flat_in, strict=True),
                           *zip(program.out_paths, program.outputs, flat_out, strict=True)]:
        dtype = vid.dtype if isinstance(vid, Literal) else program.values[vid].dtype
        spec = pin.spec if isinstance(pin, NamedSharding) else pin
        if isinstance(spec, PartitionSpec) and is_extended(dtype) and any(
                e is not None and e is not UNCONSTRAINED for e in spec):
            out.append(f"{path}: spec {spec} on a PRNG key array: plans keep key arrays replicated, so it is passed "
                       "and returned whole (the keys are the same either way); not kept")
        out += _memory_kind(path, pin)
    leaves = jax.tree_util.tree_flatten_with_path(tuple(example_args))[0]
    for key, x in leaves:
        if isinstance(x, jax.ShapeDtypeStruct):
            out += _memory_kind(f"args{jax.tree_util.keystr(key)}", x.sharding)
    return out


def _memory_kind(path: str, sharding: Any) -> list[str]:
    kind = getattr(sharding, "memory_kind", None) if isinstance(sharding, NamedSharding) else None
    if kind is None or kind == "device":
        return []
    return [f"{path}: memory_kind={kind!r}: plans place every array in device memory (plan.in_shardings / "
            "out_shardings say so); not kept. Consider moving it with jax.device_put around the planned call"]


def example_pins(example_args: tuple[Any, ...], in_shardings: Any, mesh: Any) -> Any:
    """in_shardings with each free argument that is a `jax.ShapeDtypeStruct` carrying a
    NamedSharding pinned to that sharding's spec, as `jax.jit(f).lower(struct)` takes it (a
    struct has no data: its sharding can only be the user's intent). An array's placement pins
    nothing (it is often incidental: where the last step left it). Unchanged where no struct
    carries a NamedSharding, or where in_shardings is malformed (check_options names that)."""
    leaves, tree = jax.tree_util.tree_flatten(tuple(example_args))
    if not any(isinstance(x, jax.ShapeDtypeStruct) and isinstance(x.sharding, NamedSharding) for x in leaves):
        return in_shardings
    if in_shardings is not None and (not isinstance(in_shardings, tuple | list)
                                     or len(in_shardings) != len(example_args)):
        return in_shardings
    try:
        flat = _flat_pins(None if in_shardings is None else tuple(in_shardings), tree, "in_shardings")
    except InvalidArgumentError:
        return in_shardings
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tuple(example_args))[0]]
    pins = [pin if pin is not None else _struct_spec(x, mesh, f"args{path}")
            for pin, x, path in zip(flat, leaves, paths, strict=True)]
    return tuple(jax.tree_util.tree_unflatten(tree, pins))


def _struct_spec(x: Any, mesh: Any, path: str) -> PartitionSpec | None:
    """A struct's spec where its NamedSharding is on the plan's mesh (axis names and sizes)."""
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
    if not isinstance(sharding, NamedSharding):
        return None
    if dict(sharding.mesh.shape) != dict(mesh.shape) or tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
        raise InvalidArgumentError(
            f"saturate_and_extract: example argument {path} is a ShapeDtypeStruct with a sharding on mesh "
            f"{dict(sharding.mesh.shape)}, not the plan's mesh {dict(mesh.shape)}. Consider a sharding on the "
            "plan's mesh, or a struct with no sharding to let shardsat choose its layout.")
    return sharding.spec
