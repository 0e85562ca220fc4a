"""Training and evaluating the prior's perceptron (extract/prior.py) on labelled examples.

The loss is a softmax cross-entropy per value: its chosen layout's score against the others'
(a listwise ranking loss: only the order of one value's layouts matters to the planner). Full
batch, AdamW (optax), a fixed number of steps from a fixed key: the same examples give the same
weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InvalidArgumentError
from ..extract.prior import PriorWeights, kept
from ..extract.prior_features import FEATURES
from .labels import Example

HIDDEN = (64, 32)
STEPS = 600
LEARNING_RATE = 3e-3


def _optax() -> Any:
    try:
        import optax
    except ImportError as e:
        raise InvalidArgumentError("training a prior needs optax: pip install 'shardsat[learn]'") from e
    return optax


def _batch(examples: list[Example]) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """(rows, value id per row, each value's chosen row, number of values) of all examples."""
    x = np.concatenate([e.x for e in examples])
    seg, first, base, n = [], [], 0, 0
    for e in examples:
        sizes = np.diff(e.offsets)
        seg.append(np.repeat(np.arange(n, n + len(sizes)), sizes))
        first.append(base + e.offsets[:-1])
        base += len(e.x)
        n += len(sizes)
    return jnp.asarray(x), jnp.asarray(np.concatenate(seg)), jnp.asarray(np.concatenate(first)), n


def _forward(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    h = x
    for k, (w, b) in enumerate(params):
        h = h @ w + b
        if k < len(params) - 1:
            h = jax.nn.relu(h)
    return h[:, 0]


def _loss(params: list[tuple[jax.Array, jax.Array]], x: jax.Array, seg: jax.Array, first: jax.Array,
          n: int) -> jax.Array:
    s = _forward(params, x)
    top = jax.ops.segment_max(s, seg, num_segments=n)
    lse = top + jnp.log(jax.ops.segment_sum(jnp.exp(s - top[seg]), seg, num_segments=n))
    return jnp.mean(lse - s[first])


def _init(key: jax.Array, hidden: tuple[int, ...]) -> list[tuple[jax.Array, jax.Array]]:
    sizes = (FEATURES, *hidden, 1)
    keys = jax.random.split(key, len(sizes) - 1)
    return [(jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a), jnp.zeros(b))
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def train(examples: list[Example], *, steps: int = STEPS, hidden: tuple[int, ...] = HIDDEN, seed: int = 0,
          about: str = "", on_step: Any = None) -> PriorWeights:
    """The perceptron fitted to `examples` (deterministic in them and `seed`)."""
    optax = _optax()
    x, seg, first, n = _batch(examples)
    params = _init(jax.random.PRNGKey(seed), hidden)
    opt = optax.adamw(LEARNING_RATE, weight_decay=1e-4)
    state = opt.init(params)

    @jax.jit
    def step(params: Any, state: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(_loss)(params, x, seg, first, n)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    for i in range(steps):
        params, state, loss = step(params, state)
        if on_step is not None and (i % 100 == 0 or i == steps - 1):
            on_step(i, float(loss))
    layers = tuple((np.asarray(w, np.float32), np.asarray(b, np.float32)) for w, b in params)
    return PriorWeights(layers, about)


@dataclass
class Score:
    """How a prior ranks one example's chosen layouts."""

    values: int
    top1: float  # share of values whose chosen layout scores highest
    recall: float  # share whose chosen layout the narrowing keeps
    kept: float  # mean layouts kept per value
    layouts: float  # mean layouts per value


def evaluate(weights: PriorWeights, example: Example, mass: float, width: int) -> Score:
    """Top-1 accuracy and the narrowing's recall (extract/prior.kept) on one example."""
    params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in weights.layers]
    s = np.asarray(_forward(params, jnp.asarray(example.x)))
    top1 = recall = nkept = 0
    for lo, hi in zip(example.offsets[:-1], example.offsets[1:], strict=True):
        v = s[lo:hi]
        top1 += int(np.argmax(v) == 0)
        keep = kept(v, mass, width)
        recall += int(0 in keep.tolist())
        nkept += len(keep)
    n = max(len(example.offsets) - 1, 1)
    return Score(n, top1 / n, recall / n, nkept / n, len(example.x) / n)


__all__ = ["Score", "evaluate", "train"]
