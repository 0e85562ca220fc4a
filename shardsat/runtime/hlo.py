"""Count the collectives in compiled HLO text, to check a plan against what XLA emits.

XLA:CPU lowers a reduce-scatter to an all-reduce whose result feeds a dynamic-slice; GPU and TPU
emit `reduce-scatter`. Both count as reduce-scatter here. Async pairs (`-start`/`-done`) count once.
"""

from __future__ import annotations

import re
from collections import Counter

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")


def count_collectives(hlo_text: str) -> Counter[str]:
    ops: dict[str, str] = {}
    users: dict[str, list[str]] = {}
    calls: dict[str, str] = {}
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
        name, _, op, rest = m.groups()
        name = f"{comp}/{name.lstrip('%')}"
        ops[name] = op
        comp_ops.setdefault(comp, set()).add(op)
        order.append(name)
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
        if base == "all-reduce" and _feeds_slice(name, ops, users, calls, comp_ops):
            counts["reduce-scatter"] += 1
        else:
            counts[base] += 1
    return counts


def _feeds_slice(name: str, ops: dict[str, str], users: dict[str, list[str]], calls: dict[str, str],
                 comp_ops: dict[str, set[str]]) -> bool:
    frontier = list(users.get(name, []))
    seen = set()
    while frontier:
        u = frontier.pop()
        if u in seen:
            continue
        seen.add(u)
        op = ops.get(u, "")
        if op == "dynamic-slice":
            return True
        if op == "fusion" and "dynamic-slice" in comp_ops.get(calls.get(u, ""), set()):
            return True
        if op in ("bitcast", "copy", "reshape", "get-tuple-element", "all-reduce-done"):
            frontier.extend(users.get(u, []))
    return False
