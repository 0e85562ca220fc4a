"""`jax.named_scope` names as hints about a program's layers.

Folding finds repeated layers by content alone (egraph/fold.py). Scope names say where the user
thinks the layers are: `layer0`, `layer1`, ... (and `transpose(jvp(layer3))` for a layer's
backward pass). They name the folded loops in `plan.explain()`, and where scoped layers were
planned unfolded they say which instances and, for layers that never folded, the first
equation in which two instances differ: the reason a deep model plans slowly.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable

from .program import Equation, Program

_DIGITS = re.compile(r"\d+")


def scope_pattern(scope: str) -> tuple[str, tuple[int, ...]] | None:
    """'transpose(jvp(layer12))' -> ('transpose(jvp(layer{i}))', (12,)); None without an index."""
    nums = _DIGITS.findall(scope)
    if not nums:
        return None
    return _DIGITS.sub("{i}", scope), tuple(int(n) for n in nums)


def _label(pattern: str, instances: Iterable[tuple[int, ...]]) -> str:
    inst = sorted(set(instances))
    if all(len(i) == 1 for i in inst):
        nums = [i[0] for i in inst]
        consecutive = len(nums) > 2 and nums == list(range(nums[0], nums[-1] + 1))
        span = f"{nums[0]}..{nums[-1]}" if consecutive else ", ".join(map(str, nums))
        return f"{pattern}, i = {span}"
    return f"{pattern} ({len(inst)} instances)"


def loop_scope(equations: Iterable[Equation]) -> str:
    """The scope pattern most of a folded loop's original equations were traced in, with the
    instances it covers; '' where they carry no indexed scope."""
    counts: Counter[str] = Counter()
    instances: dict[str, set[tuple[int, ...]]] = {}
    for e in equations:
        pat = scope_pattern(e.scope)
        if pat is not None:
            counts[pat[0]] += 1
            instances.setdefault(pat[0], set()).add(pat[1])
    if not counts:
        return ""
    top = max(counts, key=lambda p: (counts[p], p))
    return _label(top, instances[top])


def unfolded_scopes(original: Program, folded: Program, key: Callable[[Program, Equation], str]) -> list[str]:
    """Notes on scoped layers a fold left unfolded: which instances, and for a scope none of
    whose instances folded, the first equation in which its first two instances differ."""
    in_loop: dict[str, set[tuple[int, ...]]] = {}
    for reg in folded.scans:
        for eqs in reg.replay.values():
            for e in eqs:
                pat = scope_pattern(e.scope)
                if pat is not None:
                    in_loop.setdefault(pat[0], set()).add(pat[1])
    outside: dict[str, dict[tuple[int, ...], list[Equation]]] = {}
    for e in folded.equations:
        if e.region is None:
            pat = scope_pattern(e.scope)
            if pat is not None:
                outside.setdefault(pat[0], {}).setdefault(pat[1], []).append(e)
    notes = []
    for pattern in sorted(outside):
        inst = outside[pattern]
        if pattern in in_loop:
            rest = sorted(set(inst) - in_loop[pattern])
            if rest:
                notes.append(f"{_label(pattern, rest)}: planned unfolded, at the ends of a folded loop")
            continue
        if len(inst) < 2:
            continue
        a, b = (inst[i] for i in sorted(inst)[:2])
        first = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if key(original, x) != key(original, y)),
                     min(len(a), len(b)))
        if first < min(len(a), len(b)):
            why = f"they first differ at `{a[first].name}` ({a[first].source}) vs `{b[first].name}` ({b[first].source})"
        elif len(a) != len(b):
            why = f"they have {len(a)} and {len(b)} equations"
        else:
            why = "they read their operands differently (not one layer's output feeding the next)"
        notes.append(f"{_label(pattern, inst)}: not folded, {why}")
    return notes
