"""Count the collectives (and the arguments copied) in compiled HLO text, to check a plan
against what XLA emits.

XLA:CPU lowers a reduce-scatter to an all-reduce whose result feeds a dynamic-slice; GPU and TPU
emit `reduce-scatter`. Both count as reduce-scatter here. Async pairs (`-start`/`-done`) count once.
Collectives XLA's combiners merged into one tuple-shaped op count once per element; a flat
reduction of n pending sums that the lowering made (runtime/combine.py) counts n times.
"""

from __future__ import annotations

import re
from collections import Counter

from ..egraph.collectives import COLLECTIVES
from .combine import COMBINED_TAG

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
# HLO ops counted: each kind's `hlo_op` (shardsat/egraph/collectives.py), and collective-permute,
# which no plan makes but XLA may emit
_KINDS = (*(k.hlo_op for k in COLLECTIVES.values() if k.hlo_op), "collective-permute")
_TUPLED = frozenset(k.hlo_op for k in COLLECTIVES.values() if k.hlo_tuple)  # combined into tuples
# XLA:CPU's form: an all-reduce whose every use slices it counts as the kind it stands for
_SLICED = dict(("all-reduce", k.hlo_op) for k in COLLECTIVES.values() if k.cpu_via_all_reduce and k.hlo_op)


_COMBINED = re.compile(r'op_name="[^"]*/' + COMBINED_TAG + r'(\d+)/')
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")


def count_collectives(hlo_text: str) -> Counter[str]:
    ops: dict[str, str] = {}
    shapes: dict[str, str] = {}
    users: dict[str, list[str]] = {}
    calls: dict[str, str] = {}
    operand_count: dict[str, int] = {}
    comp_ops: dict[str, set[str]] = {}
    order: list[str] = []
    combined: dict[str, int] = {}  # flat reductions of several pending sums (runtime/combine.py)
    comp = ""
    for line in hlo_text.splitlines():
        c = _COMP.match(line)
        if c and "=" not in line.split("(")[0]:
            comp = c.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        name = f"{comp}/{name.lstrip('%')}"
        ops[name] = op
        parts = _COMBINED.search(rest)
        if parts:
            combined[name] = int(parts.group(1))
        shapes[name] = shape.strip()
        comp_ops.setdefault(comp, set()).add(op)
        order.append(name)
        operand_count[name] = rest.split(")")[0].count("%")
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        if called:
            calls[name] = called.group(1)
        for ref in re.findall(r"%([\w.\-]+)", rest):
            users.setdefault(f"{comp}/{ref}", []).append(name)
    counts: Counter[str] = Counter()
    for name in order:
        op = ops[name]
        base = op.removesuffix("-start")
        if op.endswith("-done"):
            continue
        if base not in _KINDS:
            continue
        if base in _TUPLED and shapes[name].startswith("("):
            # XLA's combiners merge collectives into one tuple-shaped op: count each element
            elems = [u for u in users.get(name, []) if ops.get(u) == "get-tuple-element"]
            if not elems:  # e.g. the ROOT: one element per operand
                counts[base] += max(1, operand_count[name])
                continue
            for u in elems:
                counts[_counted_as(base, u, ops, users, calls, comp_ops)] += combined.get(u, 1)
            continue
        counts[_counted_as(base, name, ops, users, calls, comp_ops)] += combined.get(name, 1)
    return counts


def _counted_as(base: str, name: str, ops: dict[str, str], users: dict[str, list[str]], calls: dict[str, str],
                comp_ops: dict[str, set[str]]) -> str:
    """The kind an op of HLO kind `base` counts as: an all-reduce that only feeds slices is
    XLA:CPU's form of a reduce-scatter."""
    sliced = _SLICED.get(base)
    if sliced is not None and _feeds_slice(name, ops, users, calls, comp_ops):
        return sliced
    return base


def _feeds_slice(name: str, ops: dict[str, str], users: dict[str, list[str]], calls: dict[str, str],
                 comp_ops: dict[str, set[str]]) -> bool:
    """True if every use of `name` (through bitcasts, copies and tuple elements) slices it: the
    all-reduce + dynamic-slice form of a reduce-scatter. An all-reduce whose full result is also
    used is an all-reduce."""
    frontier = list(users.get(name, []))
    seen = set()
    sliced = False
    while frontier:
        u = frontier.pop()
        if u in seen:
            continue
        seen.add(u)
        op = ops.get(u, "")
        if op == "dynamic-slice" or (op == "fusion" and "dynamic-slice" in comp_ops.get(calls.get(u, ""), set())):
            sliced = True
        elif op in ("bitcast", "copy", "reshape", "get-tuple-element", "all-reduce-done"):
            frontier.extend(users.get(u, []))
        else:
            return False
    return sliced


def copied_arguments(hlo_text: str) -> list[str]:
    """The paths (jax's `args[0][1]...`, as `MemoryEstimate.by_path`) of the arguments a compiled
    module's entry computation copies whole, sorted."""
    text = hlo_text.replace("\\'", "'")
    entry = text[text.find("\nENTRY"):]
    params = dict(re.findall(r'%([\w.-]+) = [^\n]* parameter\(\d+\)[^\n]*op_name="([^"]+)"', entry))
    return sorted({params[p] for p in re.findall(r" copy\(%([\w.-]+)\)", entry) if p in params})
