"""Count the collectives in compiled HLO text, to check a plan against what XLA emits.

XLA:CPU lowers a reduce-scatter to an all-reduce whose result feeds a dynamic-slice; GPU and TPU
emit `reduce-scatter`. Both count as reduce-scatter here. Async pairs (`-start`/`-done`) count once.
Collectives XLA's combiners merged into one tuple-shaped op count once per element.
"""

from __future__ import annotations

import re
from collections import Counter

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")


def count_collectives(hlo_text: str) -> Counter[str]:
    ops: dict[str, str] = {}
    shapes: dict[str, str] = {}
    users: dict[str, list[str]] = {}
    calls: dict[str, str] = {}
    operand_count: dict[str, int] = {}
    comp_ops: dict[str, set[str]] = {}
    order: list[str] = []
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
        if base in ("all-reduce", "all-gather", "reduce-scatter") and shapes[name].startswith("("):
            # XLA's combiners merge collectives into one tuple-shaped op: count each element
            elems = [u for u in users.get(name, []) if ops.get(u) == "get-tuple-element"]
            if not elems:  # e.g. the ROOT: one element per operand
                counts[base] += max(1, operand_count[name])
                continue
            for u in elems:
                if base == "all-reduce" and _feeds_slice(u, ops, users, calls, comp_ops):
                    counts["reduce-scatter"] += 1
                else:
                    counts[base] += 1
            continue
        if base == "all-reduce" and _feeds_slice(name, ops, users, calls, comp_ops):
            counts["reduce-scatter"] += 1
        else:
            counts[base] += 1
    return counts


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
