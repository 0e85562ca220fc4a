"""Loop-carried state: which outputs give back which state arguments (state_argnums)."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError
from .program import Literal, Program


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
