"""A plan as one self-contained HTML page (inline CSS and SVG, no scripts or external assets), so
it can be attached to a review or opened from an air-gapped machine.

Every input is drawn as a device grid: the mesh laid out as rows (every mesh axis but the last)
and columns (the last axis), and inside each device the whole tensor as an outline with the block
that device holds filled in. Blocks are coloured by which shard they are, so replicas share a
colour. Tensors of rank > 2 show their two largest dimensions. The cost breakdown (compute,
communication, collectives by kind) and the memory estimate are inline SVG bar charts.
"""

from __future__ import annotations

import html
import itertools
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..egraph.collectives import COLLECTIVES
from ..egraph.layout import MeshAxes
from .explain import fmt_bytes, fmt_s
from .jsonout import TensorInfo, input_tensors, output_tensors

if TYPE_CHECKING:
    from .plan import Plan

COMPUTE_COLOUR = "#4e79a7"
COMM_COLOUR = "#e15759"
KIND_COLOURS = {kind.name: kind.colour for kind in COLLECTIVES.values()}  # by Collective.kind
MEMORY_COLOURS = ["#4e79a7", "#59a14f", "#edc948", "#b07aa1", "#f28e2b", "#76b7b2"]

_COMPONENT = re.compile(r"\[(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\]]*)\]|\.[A-Za-z_]\w*")
_LAYER_KEY = re.compile(r"[_.\-]\d+['\"]?\]?$")

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222;
       margin: 24px auto; max-width: 1180px; padding: 0 16px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
.summary { color: #444; margin: 0 0 8px; }
.legend { color: #555; font-size: 13px; max-width: 900px; }
details { margin: 10px 0; border: 1px solid #e3e3e3; border-radius: 6px; padding: 6px 10px; }
summary { cursor: pointer; font-weight: 600; }
summary .mono { font-weight: 600; } summary .dim { font-weight: 400; color: #666; }
.cards { display: flex; flex-wrap: wrap; align-items: flex-start; gap: 12px; margin-top: 8px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 10px; background: #fafafa; }
.card .name { font-weight: 600; } .card .meta { color: #444; font-size: 12.5px; margin: 2px 0 6px; }
.card .note { color: #777; font-size: 11.5px; margin-top: 4px; }
table { border-collapse: collapse; font-size: 12.5px; margin: 6px 0; }
th, td { border-bottom: 1px solid #eee; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; white-space: nowrap; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
footer { color: #888; font-size: 12px; margin-top: 32px; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


# -- grouping ----------------------------------------------------------------------------------------
def path_components(path: str) -> tuple[str, list[str]]:
    """"args[0]['layers'][1]['w']" -> ("args", ["[0]", "['layers']", "[1]", "['w']"])."""
    m = _COMPONENT.search(path)
    if m is None:
        return path, []
    return path[: m.start()], _COMPONENT.findall(path, m.start())


def group_key(path: str) -> str:
    """The layer-ish prefix of a pytree path: up to the last list index or numbered key
    ('Dense_0', 'block-3') above the leaf, else the positional argument."""
    head, comps = path_components(path)
    if len(comps) <= 1:
        return path
    cut = 1
    for i, c in enumerate(comps[:-1]):
        if re.fullmatch(r"\[\d+\]", c) or _LAYER_KEY.search(c):
            cut = i + 1
    return head + "".join(comps[:cut])


def group_tensors(tensors: Sequence[TensorInfo]) -> list[tuple[str, list[TensorInfo]]]:
    groups: dict[str, list[TensorInfo]] = {}
    for t in tensors:
        groups.setdefault(group_key(t.path), []).append(t)
    return list(groups.items())


# -- device grids ------------------------------------------------------------------------------------
def shown_dims(shape: Sequence[int]) -> tuple[int | None, int | None]:
    """(row dim, column dim) to draw: the two largest dimensions in their own order."""
    if not shape:
        return None, None
    if len(shape) == 1:
        return None, 0
    a, b = sorted(sorted(range(len(shape)), key=lambda d: (-shape[d], d))[:2])
    return a, b


def shard_colour(shard: int) -> str:
    """Distinct colours for shard ids (golden-angle hues), the same for every replica."""
    hue = (210 + shard * 137.508) % 360
    return f"hsl({hue:.0f},62%,{52 + 8 * (shard % 3) // 2:.0f}%)"


def device_blocks(t: TensorInfo, axes: MeshAxes, coord: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
    """For the device at mesh `coord`: (block index, block count) per tensor dimension, and the
    shard id (the blocks as one mixed-radix number: replicas get the same id)."""
    dims = t.layout.dims if t.layout is not None else ((),) * t.rank
    blocks, shard = [], 0
    for d in dims:
        idx, cnt = 0, 1
        for a in d:  # PartitionSpec order: the first axis is the major one
            idx = idx * axes.sizes[a] + coord[a]
            cnt *= axes.sizes[a]
        blocks.append((idx, cnt))
        shard = shard * cnt + idx
    return blocks, shard


def device_grid_svg(t: TensorInfo, axes: MeshAxes, device_ids: Sequence[int] | None = None) -> str:
    """The mesh as a grid of devices; in each, the tensor's outline and the block it holds."""
    sizes = axes.sizes
    n_rows = math.prod(sizes[:-1]) if len(sizes) > 1 else 1
    n_cols = sizes[-1]
    row_axes = list(range(len(sizes) - 1)) if len(sizes) > 1 else []
    r_dim, c_dim = shown_dims(t.shape)
    base = max(18, min(56, 380 // max(n_cols, 1)))
    if r_dim is not None and c_dim is not None:
        aspect = min(4.0, max(0.25, t.shape[r_dim] / max(t.shape[c_dim], 1)))
        bw, bh = (base / aspect, base) if aspect >= 1 else (base, base * aspect)
    elif c_dim is not None:
        bw, bh = base, max(6.0, base / 4)
    else:
        bw = bh = base / 2
    col_label_w = 5.4 * (len(axes.names[-1]) + 1 + len(str(n_cols - 1))) + 4
    cw, ch = max(bw + 10, col_label_w), bh + 10
    px, py = (cw - bw) / 2, 5.0  # the tensor's outline, centred in the device
    gap = 3
    row_labels = [", ".join(f"{axes.names[a]}={i}" for a, i in zip(row_axes, rc, strict=True))
                  for rc in itertools.product(*(range(sizes[a]) for a in row_axes))] or [""]
    left = 6 + 5.6 * max(len(s) for s in row_labels) if row_axes else 2
    top = 14
    width = left + n_cols * (cw + gap)
    height = top + n_rows * (ch + gap)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{_e(t.path)} on the device mesh">']
    for j in range(n_cols):
        x = left + j * (cw + gap) + cw / 2
        out.append(f'<text x="{x:.1f}" y="10" font-size="9" text-anchor="middle" fill="#666">'
                   f'{_e(axes.names[-1])}={j}</text>')
    for i, label in enumerate(row_labels if row_axes else []):
        y = top + i * (ch + gap) + ch / 2 + 3
        out.append(f'<text x="{left - 4:.1f}" y="{y:.1f}" font-size="9" text-anchor="end" fill="#666">{_e(label)}</text>')
    for flat, coord in enumerate(itertools.product(*(range(s) for s in sizes))):
        i, j = divmod(flat, n_cols)
        x, y = left + j * (cw + gap), top + i * (ch + gap)
        blocks, shard = device_blocks(t, axes, coord)
        where = ", ".join(f"{n}={c}" for n, c in zip(axes.names, coord, strict=True))
        dev = f"device {device_ids[flat]}" if device_ids is not None else "device"
        slices = ", ".join(f"{k * n // c}:{(k + 1) * n // c}" for (k, c), n in zip(blocks, t.shape, strict=True))
        out.append(f'<g transform="translate({x:.1f},{y:.1f})"><title>{_e(dev)} ({_e(where)}): '
                   f'[{_e(slices)}]</title>')
        out.append(f'<rect width="{cw:.1f}" height="{ch:.1f}" rx="3" fill="#fff" stroke="#bbb"/>')
        out.append(f'<rect x="{px:.1f}" y="{py:.1f}" width="{bw:.1f}" height="{bh:.1f}" fill="#eee" stroke="#999" '
                   'stroke-width="0.6"/>')
        fx0, fx1, fy0, fy1 = 0.0, 1.0, 0.0, 1.0
        if c_dim is not None:
            k, c = blocks[c_dim]
            fx0, fx1 = k / c, (k + 1) / c
        if r_dim is not None:
            k, c = blocks[r_dim]
            fy0, fy1 = k / c, (k + 1) / c
        out.append(f'<rect x="{px + fx0 * bw:.2f}" y="{py + fy0 * bh:.2f}" width="{(fx1 - fx0) * bw:.2f}" '
                   f'height="{(fy1 - fy0) * bh:.2f}" fill="{shard_colour(shard)}"/></g>')
    out.append("</svg>")
    return "".join(out)


def _dims_note(t: TensorInfo) -> str:
    r, c = shown_dims(t.shape)
    if t.rank == 0:
        return "scalar"
    if t.rank == 1:
        return f"dim 0 ({t.shape[0]}) across"
    note = f"rows: dim {r} ({t.shape[r]}), columns: dim {c} ({t.shape[c]})"  # type: ignore[index]
    if t.rank > 2:
        note += f"; the two largest of {t.rank} dims"
    return note


def tensor_card(t: TensorInfo, axes: MeshAxes, name: str, device_ids: Sequence[int] | None) -> str:
    per = fmt_bytes(t.bytes_per_device)
    total = fmt_bytes(t.bytes_total) if t.literal is None else ""
    meta = f"{t.type_str()} · <code>{_e(t.describe(axes))}</code> · {per}/device" + (f" (of {total})" if total else "")
    grid = device_grid_svg(t, axes, device_ids) if t.literal is None else ""
    return (f'<div class="card" title="{_e(t.path)}"><div class="name mono">{_e(name)}</div>'
            f'<div class="meta">{meta}</div>{grid}<div class="note">{_e(_dims_note(t))}</div></div>')


# -- charts ----------------------------------------------------------------------------------------
Bar = tuple[str, list[tuple[float, str, str]], str]  # label, segments (value, colour, tooltip), value text


def bar_chart_svg(rows: Sequence[Bar], title: str, width: int = 760) -> str:
    """Horizontal bars (segments stacked) on one scale, labels left and values right."""
    label_w, value_w, row_h = 210, 150, 24
    bar_w = width - label_w - value_w
    top = 22
    scale = max((sum(v for v, _, _ in segs) for _, segs, _ in rows), default=0.0) or 1.0
    height = top + row_h * len(rows) + 6
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}">',
           f'<text x="0" y="14" font-size="13" font-weight="600" fill="#333">{_e(title)}</text>']
    for i, (label, segs, value) in enumerate(rows):
        y = top + i * row_h
        out.append(f'<text x="{label_w - 8}" y="{y + 15}" font-size="12" text-anchor="end" fill="#333">{_e(label)}</text>')
        out.append(f'<rect x="{label_w}" y="{y + 3}" width="{bar_w}" height="{row_h - 8}" fill="#f4f4f4"/>')
        x = float(label_w)
        for v, colour, tip in segs:
            w = bar_w * v / scale
            if w > 0:
                out.append(f'<rect x="{x:.2f}" y="{y + 3}" width="{max(w, 1.0):.2f}" height="{row_h - 8}" '
                           f'fill="{colour}"><title>{_e(tip)}</title></rect>')
            x += w
        out.append(f'<text x="{label_w + bar_w + 8}" y="{y + 15}" font-size="12" fill="#333">{_e(value)}</text>')
    out.append("</svg>")
    return "".join(out)


def cost_chart(plan: Plan) -> str:
    cost = plan.cost
    rows: list[Bar] = [
        ("predicted step", [(cost.compute_s, COMPUTE_COLOUR, f"compute {fmt_s(cost.compute_s)}"),
                            (cost.communication_s, COMM_COLOUR, f"communication {fmt_s(cost.communication_s)}")],
         fmt_s(cost.total_s)),
        ("compute", [(cost.compute_s, COMPUTE_COLOUR, "compute")], fmt_s(cost.compute_s)),
        ("communication", [(cost.communication_s, COMM_COLOUR, "communication")], fmt_s(cost.communication_s)),
    ]
    by_kind: dict[str, tuple[int, float, float]] = {}
    for c in cost.collectives:
        n, s, b = by_kind.get(c.kind, (0, 0.0, 0.0))
        by_kind[c.kind] = (n + 1, s + c.seconds, b + c.bytes)
    for kind, (n, s, b) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        rows.append((f"{kind} ×{n}", [(s, KIND_COLOURS.get(kind, COMM_COLOUR), f"{kind}: {fmt_bytes(b)} buffers")],
                     fmt_s(s)))
    return bar_chart_svg(rows, "Predicted time per step (compute vs communication, collectives by kind)")


def memory_chart(plan: Plan) -> str:
    mem = plan.cost.memory
    if mem is None:
        return ""
    parts = [("parameters", mem.parameters), ("optimizer state", mem.optimizer_state), ("inputs", mem.inputs),
             ("activations peak", mem.activations_peak), ("outputs", mem.outputs)]  # the total's parts
    rows: list[Bar] = [("total", [(float(v), MEMORY_COLOURS[i], f"{k} {fmt_bytes(v)}") for i, (k, v) in enumerate(parts)],
                        fmt_bytes(mem.total))]
    rows += [(k, [(float(v), MEMORY_COLOURS[i], k)], fmt_bytes(v)) for i, (k, v) in enumerate(parts) if v]
    if mem.gradients:
        rows.append(("gradients (in the peak)", [(float(mem.gradients), MEMORY_COLOURS[5], "gradients")],
                     fmt_bytes(mem.gradients)))
    return bar_chart_svg(rows, "Estimated memory per device")


# -- the page --------------------------------------------------------------------------------------
def _collectives_table(plan: Plan) -> str:
    if not plan.cost.collectives:
        return "<p>None: every consumer gets its operands in the layout they already have.</p>"
    head = "".join(f"<th>{h}</th>" for h in ("kind", "axes", "buffer", "time", "tensor", "layouts", "why"))
    rows = []
    for c in plan.cost.collectives:
        rows.append(
            f"<tr><td>{_e(c.kind)}</td><td>{_e(','.join(c.axes))}</td><td class='num'>{fmt_bytes(c.bytes)}</td>"
            f"<td class='num'>{fmt_s(c.seconds)}</td><td class='mono'>{_e(c.value)}</td>"
            f"<td class='mono'>{_e(c.src)} → {_e(c.dst)}</td><td>{_e(c.reason)}</td></tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _group_section(name: str, tensors: list[TensorInfo], axes: MeshAxes, device_ids: Sequence[int] | None,
                   strip_prefix: bool = True) -> str:
    per = fmt_bytes(sum(t.bytes_per_device for t in tensors))
    cards = "".join(
        tensor_card(t, axes, (t.path[len(name):] if strip_prefix and t.path != name else "") or t.path, device_ids)
        for t in tensors)
    count = f"{len(tensors)} tensor{'s' if len(tensors) != 1 else ''}"
    return (f'<details open><summary><span class="mono">{_e(name)}</span> '
            f'<span class="dim">· {count} · {per}/device</span></summary><div class="cards">{cards}</div></details>')


def render_html(plan: Plan, **meta: Any) -> str:
    """The whole page as a string; `meta` (e.g. target=...) is listed in the header."""
    from .. import __version__

    prog, axes, cost = plan.program, plan.axes, plan.cost
    device_ids: list[int] | None
    try:
        device_ids = [int(d.id) for d in plan.mesh.devices.flat]
    except AttributeError:
        device_ids = None
    mesh = " × ".join(f"{n}={s}" for n, s in zip(axes.names, axes.sizes, strict=True))
    rows_desc = ", ".join(axes.names[:-1]) if len(axes.names) > 1 else "one row"
    extra = "".join(f" · {_e(k)} <code>{_e(v)}</code>" for k, v in meta.items())
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>shardsat plan: {_e(prog.name)}</title><style>{CSS}</style></head><body>",
        f"<header><h1>Plan for <code>{_e(prog.name)}</code></h1>",
        f'<p class="summary">mesh {_e(mesh)} ({axes.num_devices} devices) · profile {_e(plan.profile.name)} · '
        f"predicted step <b>{fmt_s(cost.total_s)}</b> = compute {fmt_s(cost.compute_s)} + communication "
        f"{fmt_s(cost.communication_s)} · {len(cost.collectives)} collectives · arguments "
        f"{fmt_bytes(cost.argument_bytes)}/device{extra}</p></header>",
        '<section id="cost"><h2>Cost</h2>', cost_chart(plan), memory_chart(plan), "</section>",
        '<section id="inputs"><h2>Parameters and inputs</h2>',
        f'<p class="legend">Each grid is the device mesh: rows are {_e(rows_desc)}, columns are '
        f"{_e(axes.names[-1])}. Inside each device the grey outline is the whole tensor and the coloured "
        "block is the part that device holds; devices with the same colour hold the same block (replicas). "
        "Hover a device for its slice. Tensors are grouped by the layer-ish prefix of their pytree path.</p>",
    ]
    parts += [_group_section(name, ts, axes, device_ids) for name, ts in group_tensors(input_tensors(plan))]
    parts += ["</section>", '<section id="outputs"><h2>Outputs</h2>',
              _group_section("outputs", output_tensors(plan), axes, device_ids, strip_prefix=False), "</section>",
              '<section id="collectives"><h2>Collectives</h2>', _collectives_table(plan), "</section>"]
    if plan.report.fallbacks:
        parts += ['<section id="fallbacks"><h2>Replicated by fallback (no sharding rule)</h2><ul>',
                  *(f"<li class='mono'>{_e(f)}</li>" for f in plan.report.fallbacks), "</ul></section>"]
    parts += ['<section id="search"><h2>Search</h2>', f"<p>{_e(plan.report)}</p></section>",
              f"<footer>Generated by shardsat {_e(__version__)}.</footer></body></html>"]
    return "\n".join(parts)


def write_html(plan: Plan, path: str | Path, **meta: Any) -> None:
    Path(path).write_text(render_html(plan, **meta), encoding="utf-8")
