"""`plan.explain()`: every input, output and chosen intermediate layout as a PartitionSpec, every
collective with its size, predicted time and the consumer it serves."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..egraph.program import Literal
from ..egraph.scopes import loop_scope

if TYPE_CHECKING:
    from .plan import Plan

MAX_INTERMEDIATES = 400


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} us"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = ["  " + line.rstrip(), "  " + "  ".join("-" * w for w in widths)]
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return out


def explain(plan: Plan) -> str:
    prog, axes, cost = plan.program, plan.axes, plan.cost
    mesh = ", ".join(f"{n}={s}" for n, s in zip(axes.names, axes.sizes, strict=True))
    lines = [
        f"Plan for `{prog.name}` on mesh ({mesh}), profile {plan.profile.name}",
        f"predicted step {fmt_s(cost.total_s)} = compute {fmt_s(cost.compute_s)} + communication "
        f"{fmt_s(cost.communication_s)}; {len(cost.collectives)} collectives; arguments "
        f"{fmt_bytes(cost.argument_bytes)} per device",
        "",
        "Inputs",
    ]

    def shape(vid: int) -> str:
        v = prog.values[vid]
        return f"{v.dtype}[{','.join(map(str, v.shape))}]"

    alts = plan.extraction.why_not()

    def why(vid: int) -> str:
        grp = plan.graph.value_group.get(vid)
        alt = alts.get(grp) if grp is not None else None
        if alt is None:
            return ""
        return f"{plan.layouts[alt[0]].describe(axes)} {'+' if alt[1] >= 0 else ''}{fmt_s(alt[1])}"

    rows = []
    for pos, vid in enumerate(prog.args):
        lay = plan.layout_of(vid)
        spec = lay.describe(axes) if lay else "unused (replicated)"
        rows.append([prog.arg_paths[pos], shape(vid), spec, fmt_bytes(cost.argument_bytes_by_path[prog.arg_paths[pos]]),
                     why(vid)])
    lines += _table(["argument", "type", "layout", "per device", "next best (extra time)"], rows)
    lines += ["", "Outputs"]
    rows = []
    for k, (o, lid) in enumerate(zip(prog.outputs, plan.extraction.root_layouts, strict=True)):
        if isinstance(o, Literal):
            value = np.asarray(o.value).item()  # a plain number, not jax's TypedInt(8, dtype=int32)
            rows.append([prog.out_paths[k], f"{o.dtype}[] constant {value!r}", "P()"])
        else:
            rows.append([prog.out_paths[k], shape(o), plan.layouts[lid].describe(axes) if lid is not None else "?"])
    lines += _table(["output", "type", "layout"], rows)
    lines += ["", "Intermediates (computed layout; operand layouts)"]
    rows = []
    for r in plan.runs[:MAX_INTERMEDIATES]:
        eqn = prog.equations[r.eqn]
        outs = ", ".join(plan.layouts[lid].describe(axes) for _, lid in r.outputs)
        ins = ", ".join(plan.layouts[lid].describe(axes) for lid in r.operand_layouts)
        rows.append([eqn.name, eqn.source, ",".join(shape(eqn.outputs[k]) for k, _ in r.outputs) or "(effect)",
                     outs or "-", ins, why(eqn.outputs[r.outputs[0][0]]) if r.outputs else ""])
    lines += _table(["op", "source", "type", "result", "operands", "next best (extra time)"], rows)
    if len(plan.runs) > MAX_INTERMEDIATES:
        lines.append(f"  ... {len(plan.runs) - MAX_INTERMEDIATES} more equations")
    lines += ["", "Collectives"]
    if cost.collectives:
        rows = [[c.kind, ",".join(c.axes), fmt_bytes(c.bytes), fmt_s(c.seconds), c.value, f"{c.src} -> {c.dst}", c.reason]
                for c in cost.collectives]
        lines += _table(["kind", "axes", "buffer", "time", "tensor", "layouts", "why"], rows)
    else:
        lines.append("  none")
    lines += _loops(plan)
    updates = plan.weight_updates()
    if updates:
        lines += ["", "Weight update (loop-carried weights)"]
        lines += _table(["weight", "how it is updated"], [[p, how] for p, how in updates.items()])
    if plan.report.fallbacks:
        lines += ["", "Replicated by fallback (no sharding rule)"]
        lines += [f"  {f}" for f in plan.report.fallbacks]
    if plan.report.unkept:
        lines += ["", "Sharding constraints and pins not kept (no layout of the plan places the value so)"]
        lines += [f"  {u}" for u in plan.report.unkept]
    lines += ["", "Search", f"  {plan.report}"]
    return "\n".join(lines)


REGION_KINDS = {"scan": "lax.scan", "while": "while body", "while_cond": "while predicate", "branch": "cond branch"}


def _loops(plan: Plan) -> list[str]:
    """Scan bodies and folded loops (each planned once), named after their `jax.named_scope`s,
    and the notes folding left on scoped layers it did not fold."""
    prog = plan.program
    if not prog.scans and not prog.notes:
        return []
    rows = []
    for reg in prog.scans:
        body = [e for e in prog.equations if e.region == reg.index]
        if reg.folded:
            per = int(reg.params.get("per_body", 1))
            kind = "folded loop" + (f", {per} repeats per body" if per > 1 else "")
            scope = loop_scope(e for eqs in reg.replay.values() for e in eqs)
        else:
            kind = REGION_KINDS.get(reg.kind, reg.kind)
            scope = loop_scope(body)
        rows.append([str(reg.index), kind, str(reg.length), str(len(body)), scope or "-",
                     body[0].source if body else "-"])
    lines = ["", "Loops and branches (each body planned once, for all its iterations)"]
    if rows:
        lines += _table(["loop", "kind", "iterations", "body equations", "named scope", "first equation"], rows)
    lines += [f"  {n}" for n in prog.notes]
    return lines
