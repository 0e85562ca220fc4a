"""A plan as plain JSON, for tools and diffs: every input and output by pytree path with its
PartitionSpec (one entry per dimension: a list of mesh axis names, or null when not split), the
predicted times, the collectives, the search report and the memory estimate.

The same file is a saved plan (`plan.save`, `shardsat.load_plan`): "fingerprint" holds digests of
the traced program, the mesh, the profile and the plan's choices, "record" what rebuilding the
plan needs (runtime/record.py). A plan made outside saturate_and_extract has neither.

The per-tensor view (`TensorInfo`) is shared with the HTML report and the CLI's tables so that the
three always agree."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..egraph.fingerprint import fingerprint
from ..egraph.layout import Layout, MeshAxes
from ..egraph.program import Literal
from ..errors import InvalidArgumentError
from .record import RECORD_VERSION, record

if TYPE_CHECKING:
    from .plan import Plan

FORMAT_VERSION = 2  # 2: "fingerprint" and "record" (saved plans)


@dataclass(frozen=True)
class TensorInfo:
    """One input or output leaf of the plan as a user sees it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    layout: Layout | None  # None: an unused input (kept replicated) or a literal output
    bytes_per_device: int
    literal: str | None = None  # repr of a literal output

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def bytes_total(self) -> int:
        from ..egraph.program import itemsize

        return math.prod(self.shape) * itemsize(self.dtype)

    def type_str(self) -> str:
        if self.literal is not None:
            return f"literal {self.literal}"
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    def spec(self, axes: MeshAxes) -> list[list[str] | None]:
        return spec_entries(self.layout, self.rank, axes)

    def describe(self, axes: MeshAxes) -> str:
        if self.layout is None:
            return "P()" if self.literal is not None else "P() (unused)"
        return self.layout.describe(axes)


def spec_entries(layout: Layout | None, rank: int, axes: MeshAxes) -> list[list[str] | None]:
    """One entry per dimension (not trimmed like PartitionSpec): the mesh axes splitting it,
    major first, or None. `PartitionSpec(*(tuple(e) if e else None for e in entries))` rebuilds it."""
    if layout is None:
        return [None] * rank
    return [[axes.names[a] for a in d] if d else None for d in layout.dims]


def input_tensors(plan: Plan) -> list[TensorInfo]:
    prog = plan.program
    out = []
    for pos, vid in enumerate(prog.args):
        v = prog.values[vid]
        path = prog.arg_paths[pos]
        out.append(TensorInfo(path, tuple(v.shape), str(v.dtype), plan.layout_of(vid),
                              int(plan.cost.argument_bytes_by_path.get(path, v.nbytes))))
    return out


def output_tensors(plan: Plan) -> list[TensorInfo]:
    prog = plan.program
    out = []
    for k, (o, lid) in enumerate(zip(prog.outputs, plan.extraction.root_layouts, strict=True)):
        path = prog.out_paths[k]
        if isinstance(o, Literal):
            out.append(TensorInfo(path, (), type(o.value).__name__, None, 0, literal=repr(o.value)))
            continue
        v = prog.values[o]
        lay = None if lid is None else plan.layouts[lid]
        b = v.nbytes if lid is None else plan.spaces.shard_bytes(plan.spaces.space(v.shape, v.dtype), lid)
        out.append(TensorInfo(path, tuple(v.shape), str(v.dtype), lay, int(b)))
    return out


def _tensor_json(t: TensorInfo, axes: MeshAxes) -> dict[str, Any]:
    d: dict[str, Any] = {
        "spec": t.spec(axes),
        "shape": list(t.shape),
        "dtype": t.dtype,
        "bytes_per_device": t.bytes_per_device,
        "bytes_total": t.bytes_total if t.literal is None else 0,
    }
    if t.layout is None and t.literal is None:
        d["used"] = False
    if t.layout is not None and t.layout.partial:
        d["partial"] = [axes.names[a] for a in t.layout.partial]
    if t.literal is not None:
        d["literal"] = t.literal
    return d


def _plain(x: Any) -> Any:
    """numpy scalars to Python numbers, non-finite floats to None (JSON has no NaN/Infinity)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if hasattr(x, "item") and not isinstance(x, int | float):
        x = x.item()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return x


def plan_to_dict(plan: Plan, **meta: Any) -> dict[str, Any]:
    """The plan as JSON-ready data; `meta` (e.g. target="model.py:step") is stored as given."""
    axes, cost, rep = plan.axes, plan.cost, plan.report
    mem = cost.memory
    platform = plan.mesh.devices.flat[0].platform
    data: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "function": plan.program.name,
        **meta,
        "mesh": {
            "axes": dict(zip(axes.names, axes.sizes, strict=True)),
            "devices": axes.num_devices,
            "platform": platform,
        },
        "profile": plan.profile.name,
        "predicted": {
            "total_s": cost.total_s,
            "compute_s": cost.compute_s,
            "communication_s": cost.communication_s,
            "flops_per_device": cost.flops,
            "argument_bytes_per_device": cost.argument_bytes,
            "output_bytes_per_device": cost.output_bytes,
        },
        "state_argnums": list(plan.state_argnums),
        "inputs": {t.path: _tensor_json(t, axes) for t in input_tensors(plan)},
        "outputs": {t.path: _tensor_json(t, axes) for t in output_tensors(plan)},
        "collectives": [
            {
                "kind": c.kind,
                "axes": list(c.axes),
                "bytes": c.bytes,
                "moved_bytes": c.moved_bytes,
                "seconds": c.seconds,
                "value": c.value,
                "src": c.src,
                "dst": c.dst,
                "reason": c.reason,
            }
            for c in cost.collectives
        ],
        "report": {
            "equations": rep.equations,
            "e_classes": rep.e_classes,
            "e_nodes": rep.e_nodes,
            "iterations": rep.iterations,
            "stop_reason": rep.stop_reason.value,
            "method": rep.method,
            "sweeps": rep.sweeps,
            "gap": rep.gap,
            "lower_bound_s": rep.lower_bound_s,
            "fallbacks": list(rep.fallbacks),
            "unkept_constraints": list(rep.unkept),
            "times": {
                "trace_s": rep.trace_s,
                "rules_s": rep.rules_s,
                "saturation_s": rep.saturation_s,
                "extraction_s": rep.extraction_s,
                "total_s": rep.total_s,
            },
        },
        "memory": None if mem is None else {
            "parameters": mem.parameters,
            "optimizer_state": mem.optimizer_state,
            "inputs": mem.inputs,
            "gradients": mem.gradients,
            "activations_peak": mem.activations_peak,
            "outputs": mem.outputs,
            "arguments": mem.arguments,
            "total": mem.total,
        },
    }
    if plan.origin is not None:
        data.update(saved_sections(plan))
    return _plain(data)


def profile_digest(profile: Any) -> str:
    return hashlib.sha256(json.dumps(_plain(profile.to_dict()), sort_keys=True).encode()).hexdigest()


def saved_sections(plan: Plan) -> dict[str, Any]:
    """The "fingerprint" and "record" sections: what load_plan checks and rebuilds from."""
    from .. import __version__

    origin = plan.origin
    assert origin is not None  # (callers check)
    axes = plan.axes
    rec, plan_digest = record(plan)
    return {
        "fingerprint": {
            "program": origin.fingerprint.digest,
            "planned_program": fingerprint(plan.program).digest,
            "mesh": {"axis_names": list(axes.names), "axis_sizes": list(axes.sizes)},
            "profile": profile_digest(plan.profile),
            "plan": plan_digest,
            "options": origin.options_key,
        },
        "record": {
            "version": RECORD_VERSION,
            "shardsat": __version__,
            "function": plan.program.name,
            "equations": "".join(origin.fingerprint.equations),
            "arguments": list(origin.fingerprint.arguments),
            "folded": origin.folded,
            "rewrites": list(origin.rewrites),
            "profile": plan.profile.to_dict(),
            **rec,
        },
    }


def to_json(plan: Plan, indent: int | None = 2, **meta: Any) -> str:
    """The plan's JSON: indented for people, but the record (thousands of small lists that only
    load_plan reads) on one compact line at the end."""
    data = plan_to_dict(plan, **meta)
    rec = data.pop("record", None)
    text = json.dumps(data, indent=indent, allow_nan=False)
    if rec is None:
        return text
    body = json.dumps(rec, separators=(",", ":"), allow_nan=False)
    sep = "\n" + " " * (indent or 0) if indent is not None else " "
    return f'{text[:-1].rstrip()},{sep}"record": {body}{chr(10) if indent is not None else ""}}}'


def write_json(plan: Plan, path: str | Path, **meta: Any) -> Path:
    """Write the plan's JSON to `path` whole or not at all (a reader never sees half a file)."""
    path = Path(path)
    text = to_json(plan, **meta) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InvalidArgumentError(
            f"Cannot write the plan to {str(path)!r}: {e.strerror or e}. Consider a file path in an existing, writable "
            "folder, e.g. plan.save('plan.json').") from e
    return path
