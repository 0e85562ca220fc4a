"""The learned prior over layouts (issue 13): a score per (value, layout) pair, and the layouts
each value keeps where the planner narrows the e-graph (egraph/narrow.py).

The model is a small multilayer perceptron over extract/prior_features.py's pair features,
trained (shardsat/learn/) to give the layout the full search chose for each value the highest
score among the value's layouts (a softmax per value). Its first layer is linear, so the value
part and the layout part of it are computed apart: once per value and once per shared table of
layout rows, which keeps inference to a fraction of a second on a 2,000-value program with
850k pairs. Weights are a small .npz file: `shardsat/data/prior.npz` ships with the package,
`python -m shardsat priors train --out F` makes one.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from ..egraph.layout import SpaceTable
from ..egraph.program import Program
from ..errors import InvalidArgumentError
from ..rules.apply import RuleTables
from .prior_features import FEATURES, VALUE_FEATURES, Pairs, pair_features
from .profile import DeviceProfile

FORMAT = "shardsat-prior"
VERSION = 1


@dataclass(frozen=True)
class PriorWeights:
    """The perceptron: (weight [in, out], bias [out]) per layer, relu between, one score out."""

    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    about: str = ""  # how it was trained (corpus, meshes, held-out numbers), for people

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        arrays = {f"w{i}": w for i, (w, _) in enumerate(self.layers)}
        arrays |= {f"b{i}": b for i, (_, b) in enumerate(self.layers)}
        with path.open("wb") as f:
            np.savez(f, format=np.array(FORMAT), version=np.array(VERSION), features=np.array(FEATURES),
                     about=np.array(self.about), **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> PriorWeights:
        try:
            with np.load(path, allow_pickle=False) as data:
                return cls._from(data, str(path))
        except (OSError, ValueError, KeyError) as e:
            # numpy reads a file that is not an .npz archive as a pickle and suggests loading it unsafely
            why = "not an .npz archive" if "pickle" in str(e) else str(e)
            raise InvalidArgumentError(
                f"priors={str(path)!r} is not a prior's weights file ({why}). Make one with "
                "`python -m shardsat priors train --out FILE`, or pass priors='builtin'.") from e

    @classmethod
    def _from(cls, data: object, source: str) -> PriorWeights:
        get = data.__getitem__  # type: ignore[attr-defined]
        if str(get("format")) != FORMAT or int(get("version")) != VERSION or int(get("features")) != FEATURES:
            raise ValueError(f"{source} is format {get('format')} version {get('version')} with "
                             f"{get('features')} features; this shardsat reads {FORMAT} version {VERSION} "
                             f"with {FEATURES}")
        n = sum(1 for k in data.files if k.startswith("w"))  # type: ignore[attr-defined]
        layers = tuple((np.asarray(get(f"w{i}"), np.float32), np.asarray(get(f"b{i}"), np.float32))
                       for i in range(n))
        return cls(layers, str(get("about")))


@functools.cache
def builtin() -> PriorWeights:
    """The weights shipped with the package, loaded once, on first use."""
    with resources.as_file(_BUILTIN) as path:
        return PriorWeights.load(path)


_BUILTIN = resources.files("shardsat") / "data" / "prior.npz"


def resolve(priors: str) -> PriorWeights:
    """The weights a `priors=` argument names: "builtin" or a path to a weights file."""
    return builtin() if priors == "builtin" else PriorWeights.load(priors)


def fingerprint(priors: str) -> str:
    """`priors` with its weights' digest: a saved plan (cache_dir) is found again only with the
    same weights."""
    data = _BUILTIN.read_bytes() if priors == "builtin" else Path(priors).read_bytes()
    return f"{priors}@{hashlib.sha256(data).hexdigest()[:16]}"


def profile_balance(profile: DeviceProfile, spaces: SpaceTable) -> float:
    """FLOPs per byte over the slowest active link: how much compute one byte of resharding costs."""
    links = [profile.link(spaces.mesh.names[a]) for a in spaces.mesh.active] or [1.0]
    return profile.flops_per_s / min(links)


# OpenBLAS runs a product on one thread up to m * n * k = 65536 * GEMM_MULTITHREAD_THRESHOLD (4)
_ONE_THREAD_MNK = 1 << 18


def _matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w in blocks of rows small enough for one BLAS thread. The prior's products are small
    (hundreds of layouts by 64), and waking OpenBLAS's threads for each made scoring a 4-axis
    GPT step take 3.3-5.0 s on a busy 2-core machine instead of 0.14; each entry is the same
    dot product either way."""
    block = max(8, _ONE_THREAD_MNK // max(1, w.shape[0] * w.shape[1]))
    if len(x) <= block:
        return x @ w
    return np.concatenate([x[a : a + block] @ w for a in range(0, len(x), block)])


def scores(weights: PriorWeights, pairs: Pairs) -> list[np.ndarray]:
    """Per value of `pairs`, a score per layout (higher: more likely the full search's choice)."""
    (w0, b0), rest = weights.layers[0], weights.layers[1:]
    ctx_w, row_w = w0[:2 * VALUE_FEATURES], w0[2 * VALUE_FEATURES:]
    ctx = _matmul(pairs.context, ctx_w) + b0
    memo: dict[int, np.ndarray] = {}
    out = []
    for i, rows in enumerate(pairs.rows):
        part = memo.get(id(rows))
        if part is None:
            part = memo[id(rows)] = _matmul(rows, row_w)
        h = np.maximum(part + ctx[i], 0.0)
        for k, (w, b) in enumerate(rest):
            h = _matmul(h, w) + b
            if k < len(rest) - 1:
                h = np.maximum(h, 0.0)
        out.append(h[:, 0])
    return out


def kept(score: np.ndarray, mass: float, width: int) -> np.ndarray:
    """Indices of the best-scored layouts: the fewest whose softmax mass reaches `mass`, at most
    `width`, at least one."""
    order = np.argsort(-score, kind="stable")
    p = np.exp(score[order] - score[order[0]])
    cum = np.cumsum(p) / p.sum()
    n = min(int(np.searchsorted(cum, mass)) + 1, width, len(order))
    return order[:max(n, 1)]


def learned_layouts(program: Program, spaces: SpaceTable, tables: RuleTables, ties: list[tuple[int, int]],
                    profile: DeviceProfile, weights: PriorWeights, budget: int, mass: float
                    ) -> dict[int, set[int]]:
    """Per value, the layouts the prior keeps: the best-scored ones up to softmax `mass`, as
    many per value as keep the total within `budget` (value, layout) pairs (at least two each)."""
    pairs = pair_features(program, spaces, tables, ties, profile_balance(profile, spaces))
    if not pairs.values:
        return {}
    all_scores = scores(weights, pairs)
    width = max(2, math.floor(budget / len(pairs.values)))
    return {vid: {lids[j] for j in kept(s, mass, width).tolist()}
            for vid, lids, s in zip(pairs.values, pairs.layouts, all_scores, strict=True)}


__all__ = ["PriorWeights", "builtin", "fingerprint", "learned_layouts", "profile_balance", "resolve", "scores"]
