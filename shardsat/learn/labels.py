"""Training examples for the learned prior: a corpus program planned by the full search
(priors=None) on one mesh and profile, each value's pair features and the layout the plan chose.

Every value keeps its chosen layout and a deterministic sample of the others (NEGATIVES), so an
example stays a few thousand rows however many layouts a value has.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..api import saturate_and_extract
from ..extract.prior import profile_balance
from ..extract.prior_features import FEATURES, pair_features
from ..extract.profile import DeviceProfile
from .corpus import Case

NEGATIVES = 15  # other layouts sampled per value


@dataclass
class Example:
    """One planned (program, mesh, profile): rows x [pairs, FEATURES]; value i's rows are
    offsets[i]:offsets[i + 1], its chosen layout's row first."""

    name: str
    family: str
    mesh: str
    profile: str
    x: np.ndarray
    offsets: np.ndarray
    plan_s: float


def label(case: Case, mesh: Any, profile: DeviceProfile, seed: int = 0, negatives: int | None = NEGATIVES
          ) -> Example | None:
    """Plan `case` on `mesh` with every layout and make its example (`negatives` other layouts
    per value, None: all of them); None where the plan gives no value a layout with an
    alternative (nothing to learn)."""
    t = time.perf_counter()
    plan = saturate_and_extract(case.fn, mesh, *case.args, state_argnums=case.state_argnums, profile=profile,
                                priors=None)
    plan_s = time.perf_counter() - t
    pairs = pair_features(plan.program, plan.spaces, plan.tables, plan.ties, profile_balance(profile, plan.spaces))
    rng = np.random.default_rng(seed)
    blocks, sizes = [], []
    for vid, lids, ctx, rows in zip(pairs.values, pairs.layouts, pairs.context, pairs.rows, strict=True):
        chosen = plan.produced.get(vid)
        if chosen is None or chosen not in lids:
            continue
        j = lids.index(chosen)
        others = np.delete(np.arange(len(lids)), j)
        pick = others if negatives is None else rng.choice(others, size=min(negatives, len(others)), replace=False)
        take = np.concatenate([[j], np.sort(pick)])
        blocks.append(np.concatenate([np.broadcast_to(ctx, (len(take), len(ctx))), rows[take]], axis=1))
        sizes.append(len(take))
    if not blocks:
        return None
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    shape = "x".join(str(plan.mesh.shape[n]) for n in plan.mesh.axis_names)
    return Example(case.name, case.family, shape, profile.name or "custom", np.concatenate(blocks).astype(np.float32),
                   offsets, plan_s)


def save(examples: list[Example], path: str | Path) -> Path:
    """All examples in one .npz (rows concatenated; per example its metadata and row range)."""
    path = Path(path)
    starts = np.concatenate([[0], np.cumsum([len(e.offsets) - 1 for e in examples])]).astype(np.int64)
    bases = np.concatenate([[0], np.cumsum([len(e.x) for e in examples])]).astype(np.int64)
    offsets = np.concatenate([[0], *[e.offsets[1:] + bases[i] for i, e in enumerate(examples)]]).astype(np.int64)
    x = np.concatenate([e.x for e in examples]) if examples else np.zeros((0, FEATURES), np.float32)
    with path.open("wb") as f:
        np.savez(f, x=x, offsets=offsets, starts=starts, plan_s=np.array([e.plan_s for e in examples]),
                 meta=np.array([[e.name, e.family, e.mesh, e.profile] for e in examples]).reshape(-1, 4))
    return path


def load(path: str | Path) -> list[Example]:
    with np.load(path, allow_pickle=False) as d:
        x, offsets, starts, meta, plan_s = d["x"], d["offsets"], d["starts"], d["meta"], d["plan_s"]
    out = []
    for i, (name, family, mesh, profile) in enumerate(meta.tolist()):
        off = offsets[starts[i]:starts[i + 1] + 1]
        out.append(Example(name, family, mesh, profile, x[off[0]:off[-1]], off - off[0], float(plan_s[i])))
    return out


__all__ = ["Example", "label", "load", "save"]
