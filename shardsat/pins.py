"""User pins: in_shardings / out_shardings pytrees where None means "free" and a PartitionSpec
(or NamedSharding) is a hard constraint. A `P.UNCONSTRAINED` entry leaves that dimension free (a
`P.UNCONSTRAINED` leaf, the whole value): a pin is the set of layouts it allows. Conflicts are
collected and reported together, in the style of shard_map's errors."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .egraph.layout import Layout, SpaceTable, spec_to_layout
from .egraph.program import Literal, Program
from .errors import InvalidArgumentError

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


def _is_leaf(x: Any) -> bool:
    return x is None or x is UNCONSTRAINED or isinstance(x, PartitionSpec | NamedSharding)


def _flat_pins(pins: Any, tree: Any, label: str) -> list[Any]:
    """Broadcast a pytree prefix of pins to the flat leaves of `tree`."""
    if pins is None:
        return [None] * tree.num_leaves
    try:
        full = jax.tree_util.tree_map(
            lambda p, sub: jax.tree_util.tree_map(lambda _: p, sub),
            pins, jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves), is_leaf=_is_leaf,
        )
    except ValueError as e:
        what = "arguments" if label == "in_shardings" else "outputs"
        raise InvalidArgumentError(
            f"{label} does not match the structure of the {what} ({tree}): {e}. Consider a pytree prefix of "
            f"the {what} with PartitionSpec or None leaves."
        ) from e
    return [None if p is UNCONSTRAINED else p
            for p in jax.tree_util.tree_leaves(full, is_leaf=lambda x: x is None or _is_leaf(x))]


def pinned_layouts(spec: PartitionSpec, shape: tuple[int, ...], dtype: Any,
                   spaces: SpaceTable) -> tuple[frozenset[int] | None, str | None]:
    """The layout ids a spec allows (one, unless some entries are P.UNCONSTRAINED: those
    dimensions take any split the other dimensions leave axes for), or (None, why not)."""
    free = {d for d, e in enumerate(spec) if e is UNCONSTRAINED}
    fixed = PartitionSpec(*[None if d in free else e for d, e in enumerate(spec)])
    want, why = spec_to_layout(fixed, shape, spaces.mesh)
    if want is None:
        return None, why
    if 0 in shape:  # no elements: only the replicated layout exists (egraph/layout.py)
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


def _subtrees(td: Any, offset: int = 0) -> list[tuple[Any, int]]:
    out = [(td, offset)]
    for child in td.children():
        out += _subtrees(child, offset)
        offset += child.num_leaves
    return out


def resolve_ties(program: Program, state_argnums: Any, fn_name: str) -> list[tuple[int, int]]:
    """(flat arg position, flat output position) pairs of loop-carried state: each listed
    positional argument must come back as a subtree of the output with the same structure,
    shapes and dtypes. state_argnums="auto" ties every argument that does."""
    if state_argnums is None or state_argnums == ():
        return []
    auto = state_argnums == "auto"
    nums = range(len(program.arg_counts)) if auto else (
        (state_argnums,) if isinstance(state_argnums, int) else tuple(state_argnums))
    arg_trees = program.in_tree.children()
    starts = [sum(program.arg_counts[:i]) for i in range(len(program.arg_counts))]

    def sig_arg(pos: int) -> tuple[Any, Any]:
        v = program.values[program.args[pos]]
        return v.shape, str(v.dtype)

    def sig_out(k: int) -> tuple[Any, Any] | None:
        o = program.outputs[k]
        if isinstance(o, Literal):
            return None
        v = program.values[o]
        return v.shape, str(v.dtype)

    out_subtrees = _subtrees(program.out_tree)
    candidates: dict[int, list[int]] = {}  # argument -> offsets of output subtrees that match it
    for i in nums:
        if not isinstance(i, int) or not 0 <= i < len(arg_trees):
            raise InvalidArgumentError(
                f"state_argnums for `{fn_name}` names argument {i!r}; it takes {len(arg_trees)} positional arguments."
            )
        target = arg_trees[i]
        candidates[i] = [off for td, off in out_subtrees if td.num_leaves == target.num_leaves and td == target
                         and all(sig_out(off + k) == sig_arg(starts[i] + k) for k in range(td.num_leaves))]
    found = _disjoint(candidates, {i: arg_trees[i].num_leaves for i in candidates})
    ties: list[tuple[int, int]] = []
    problems = []
    for i in candidates:
        if i not in found:
            if not auto:
                why = "no output subtree has" if not candidates[i] else "every output subtree with"
                problems.append(f"  * argument {i}: {why} its structure {arg_trees[i]} with the same shapes and "
                                "dtypes" + ("" if not candidates[i] else " is taken by another argument"))
            continue
        ties.extend((starts[i] + k, found[i] + k) for k in range(arg_trees[i].num_leaves))
    if problems:
        raise InvalidArgumentError(
            f"state_argnums for `{fn_name}` cannot be tied to its outputs:\n" + "\n".join(problems)
            + "\nConsider returning the new state with the same pytree structure as the argument."
        )
    return ties


def _disjoint(candidates: dict[int, list[int]], sizes: dict[int, int]) -> dict[int, int]:
    """One output subtree per argument, no two overlapping, for as many arguments as possible
    (the biggest first). Taking the first match per argument tied a params tree to Adam's first
    moment, which has its structure, and left the optimizer state nothing to tie to."""
    order = sorted(candidates, key=lambda i: (-sizes[i], i))
    best: dict[int, int] = {}

    def search(k: int, used: set[int], chosen: dict[int, int]) -> bool:
        nonlocal best
        if len(chosen) + (len(order) - k) <= len(best):
            return False  # cannot beat what is found
        if k == len(order):
            best = dict(chosen)
            return len(best) == len(order)
        i = order[k]
        for off in candidates[i]:
            span = set(range(off, off + sizes[i]))
            if span & used:
                continue
            chosen[i] = off
            if search(k + 1, used | span, chosen):
                return True
            del chosen[i]
        return search(k + 1, used, chosen)

    search(0, set(), {})
    return best
