"""The campaign's markdown report (jax-free)."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from fuzz.outcome import OUTCOMES, PASSING, Outcome

FAILURES = ("mismatch", "crash", "error", "remat", "timeout")


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def _exc_type(reason: str) -> str:
    """The exception type of a reason line; for UnsupportedPrimitiveError also the primitive
    (and whether a rule exists but does not apply), which is what tells those classes apart."""
    head = reason.split(":", 1)[0]
    if not head.replace("_", "").replace(".", "").isalnum():
        return "-"
    if head == "UnsupportedPrimitiveError" and "primitive `" in reason:
        prim = reason.split("primitive `", 1)[1].split("`", 1)[0]
        return f"{head} `{prim}`" + (" (rule does not apply)" if "does not apply" in reason else "")
    return head


def _outcomes_table(outcomes: list[Outcome]) -> list[str]:
    counts = Counter(o.outcome for o in outcomes)
    n = max(len(outcomes), 1)
    lines = ["| outcome | count | share |", "|---|---:|---:|"]
    lines += [f"| {k} | {counts.get(k, 0)} | {100 * counts.get(k, 0) / n:.1f}% |" for k in OUTCOMES]
    valid = [o for o in outcomes if o.outcome != "invalid"]
    passing = sum(o.outcome in PASSING for o in valid)
    lines.append(f"| **valid programs planned and matched (ok + fallback)** | {passing} of {len(valid)} | "
                 f"{100 * passing / max(len(valid), 1):.1f}% |")
    return lines


def _timing(outcomes: list[Outcome]) -> list[str]:
    times = sorted((o.plan_s, o.seed) for o in outcomes if o.plan_s is not None)
    if not times:
        return ["No case reached planning."]
    med = statistics.median(t for t, _ in times)
    slow = sum(1 for o in outcomes if o.outcome == "timeout")
    return [f"Planning time over {len(times)} planned cases: median {med:.2f} s, max {times[-1][0]:.2f} s "
            f"(seed {times[-1][1]}); {sum(t > 10 for t, _ in times)} took over 10 s; {slow} timed out."]


def _fallbacks(outcomes: list[Outcome]) -> list[str]:
    by_prim: dict[str, set[int]] = defaultdict(set)
    for o in outcomes:
        for f in o.fallbacks:
            by_prim[f.split(" at ")[0]].add(o.seed)
    if not by_prim:
        return ["No fallbacks."]
    lines = ["| primitive | cases | seeds |", "|---|---:|---|"]
    for prim, seeds in sorted(by_prim.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"| `{prim}` | {len(seeds)} | {', '.join(map(str, sorted(seeds)[:8]))} |")
    return lines


def _classes(outcomes: list[Outcome]) -> list[str]:
    """Crashes and errors by (outcome, exception type, shardsat location); mismatches and
    remats by their kind."""
    groups: dict[tuple[str, str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        if o.outcome in ("crash", "error"):
            groups[(o.outcome, _exc_type(o.reason), o.location or "-")].append(o)
        elif o.outcome == "mismatch":
            kind = "host callbacks" if "host callbacks" in o.reason else "structure" if o.reason.startswith(
                "structure") else "numbers"
            groups[("mismatch", kind, "-")].append(o)
        elif o.outcome in ("remat", "timeout"):
            groups[(o.outcome, "-", o.phase or "-")].append(o)
    if not groups:
        return ["None."]
    lines = ["| outcome | count | exception / kind | shardsat location (or phase) | example reason | seeds |",
             "|---|---:|---|---|---|---|"]
    for (outcome, exc, loc), outs in sorted(groups.items(), key=lambda kv: (FAILURES.index(kv[0][0]), -len(kv[1]))):
        seeds = ", ".join(str(o.seed) for o in outs[:6]) + (" …" if len(outs) > 6 else "")
        lines.append(f"| {outcome} | {len(outs)} | {exc} | `{loc}` | {_cell(outs[0].reason, 140)} | {seeds} |")
    return lines


def _failures(outcomes: list[Outcome]) -> list[str]:
    bad = [o for o in outcomes if o.outcome in FAILURES]
    if not bad:
        return ["None."]
    lines = ["| outcome | seed | mesh | reason | reproducer |", "|---|---:|---|---|---|"]
    for o in sorted(bad, key=lambda o: (FAILURES.index(o.outcome), o.seed)):
        lines.append(f"| {o.outcome} | {o.seed} | {o.mesh} | {_cell(o.reason)} | `{o.reproducer()}` |")
    return lines


def _tags(outcomes: list[Outcome]) -> list[str]:
    """Failure rate per block kind: which building blocks the failures come with."""
    total: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for o in outcomes:
        if o.outcome == "invalid":
            continue
        total.update(o.tags)
        if o.outcome in FAILURES:
            failed.update(o.tags)
    rows = sorted((t for t in total if total[t] >= 3), key=lambda t: (-failed[t] / total[t], -total[t]))[:50]
    lines = ["| block (in 3 or more cases) | cases | failing | share |", "|---|---:|---:|---:|"]
    lines += [f"| {t} | {total[t]} | {failed[t]} | {100 * failed[t] / total[t]:.0f}% |" for t in rows]
    return lines


def _invalid(outcomes: list[Outcome]) -> list[str]:
    bad = [o for o in outcomes if o.outcome == "invalid"]
    if not bad:
        return ["None."]
    return [f"- seed {o.seed} ({o.mesh}): {_cell(o.reason, 200)}" for o in bad]


def _sensitive(outcomes: list[Outcome]) -> list[str]:
    """Passing cases whose outputs differed from jax.jit beyond the tolerance but within the
    program's own numerical noise (fuzz/execute.py): listed, not hidden."""
    hits = [o for o in outcomes if any(n.startswith(("ill-conditioned", "numerically sensitive")) for n in o.notes)]
    if not hits:
        return ["None."]
    return [f"- seed {o.seed} ({o.mesh}): {_cell('; '.join(o.notes), 240)}" for o in hits]


def render(outcomes: list[Outcome], *, wall: float, command: str, requested: int, workers: int, timeout: float,
           log_dir: str) -> str:
    meshes = Counter(o.mesh for o in outcomes)
    out = [
        "# shardsat fuzz campaign", "",
        f"`{command}`: {len(outcomes)} of {requested} programs ran in {wall:.0f} s on {workers} worker(s), "
        f"timeout {timeout:.0f} s per program from the start of planning. Worker logs (jax.debug.print output, XLA warnings): `{log_dir}`.",
        "", "Meshes (A: Auto axes, E: Explicit): " + ", ".join(f"{m} {c}" for m, c in sorted(meshes.items())), "",
        "## Outcomes", "", *_outcomes_table(outcomes), "", *_timing(outcomes), "",
        "## Fallbacks by primitive", "", *_fallbacks(outcomes), "",
        "## Failure classes", "", *_classes(outcomes), "",
        "## Failures", "", *_failures(outcomes), "",
        "## Accepted as numerically sensitive (passing, beyond the tolerance)", "", *_sensitive(outcomes), "",
        "## Invalid programs (jax itself rejects them: generator defects, not shardsat's)", "", *_invalid(outcomes), "",
        "## Failure rate by block kind", "", *_tags(outcomes), "",
    ]
    return "\n".join(out)
