"""The program builder: emits source lines of a generated program and records its arguments.

A generated program is Python source (what is traced, printed and pasted into a bug report),
so the builder writes text: each block emitter (fuzz/layers.py) asks it for parameters, inputs,
fresh names and a random number generator, and appends lines. It keeps the shapes itself, so the
source is correct by construction; make_program still checks it with jax.eval_shape.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Elements of the largest tensor a program may make: keeps planning, compiling and running each
# program (on 8 simulated CPU devices) to seconds.
MAX_ELEMENTS = 65536

# Degenerate sizes (0, 1, primes, sizes no mesh axis divides) drawn often, friendly ones too.
BATCH = (0, 1, 2, 3, 4, 5, 7, 8, 13, 16)
BATCH_P = (0.05, 0.12, 0.1, 0.08, 0.12, 0.07, 0.08, 0.2, 0.06, 0.12)
SEQ = (1, 3, 5, 7, 8, 13, 16, 32)
MODEL = (1, 3, 5, 7, 8, 12, 13, 16, 32, 64)
MODEL_P = (0.05, 0.06, 0.06, 0.07, 0.16, 0.08, 0.06, 0.2, 0.16, 0.1)
HIDDEN = (1, 3, 5, 7, 13, 16, 24, 32, 64, 128)
VOCAB = (1, 3, 7, 13, 16, 32, 64, 128)


@dataclass(frozen=True)
class ArgSpec:
    """One array argument: shape, dtype and how its values are drawn.

    kind: "normal" (std `scale`), "ids" (int32 in [0, high)), "mask" (bool, first entry of the
    last axis True), "flag" (a bool scalar), "count" (an int32 scalar, value `high`), "key" (a
    typed PRNG key), "rawkey" (a uint32[2] PRNGKey), "positive" (|normal| + 0.5).
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    kind: str = "normal"
    scale: float = 1.0
    high: int = 0

    def describe(self) -> str:
        extra = f", {self.kind}<{self.high}" if self.kind == "ids" else f", {self.kind}" if self.kind != "normal" else ""
        return f"{self.dtype}{list(self.shape)}{extra}"


@dataclass
class Tensor:
    """A value of the program being built: the name it has in the source, its shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Scope:
    """Where new parameters go: the expression of the dict they are read from in the source,
    the spec dict that receives them, and leading (stacked-layer) dims their arrays get."""

    root: str
    tree: dict[str, Any]
    lead: tuple[int, ...] = ()


@dataclass
class Builder:
    """Collects a program's source lines, arguments, module-level definitions and tags."""

    rng: np.random.Generator
    dtype: str = "float32"  # compute dtype of parameters and activations
    batch_style: str = "args"  # how data inputs are passed: "args" | "dict" | "tuple"
    params: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, ArgSpec] = field(default_factory=dict)
    header: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    aux: dict[str, str] = field(default_factory=dict)  # extra outputs a head may return
    layout: str = "NHWC"  # of image feature maps (fuzz/vision.py)
    training: bool = False  # the forward pass is differentiated: only differentiable blocks
    uses_key: bool = False
    indent: int = 1
    nested: int = 0  # >0 inside a scan body, branch or lambda: no aux outputs from there
    counter: int = 0
    scopes: list[Scope] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scopes.append(Scope('params', self.params))

    # -- randomness --------------------------------------------------------------------------
    def pick(self, options: Sequence[Any], p: Sequence[float] | None = None) -> Any:
        if p is not None:
            p = np.asarray(p, dtype=float) / np.sum(p)
        return options[int(self.rng.choice(len(options), p=p))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def randint(self, lo: int, hi: int) -> int:
        """An int in [lo, hi] (inclusive)."""
        return int(self.rng.integers(lo, hi + 1))

    # -- source ------------------------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}{self.counter}"

    def line(self, code: str) -> None:
        self.lines.append("    " * self.indent + code)

    def tag(self, name: str) -> None:
        if name not in self.tags:
            self.tags.append(name)

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """Lines emitted inside are indented one level (a nested def or a with-statement)."""
        self.indent += 1
        self.nested += 1
        try:
            yield
        finally:
            self.indent -= 1
            self.nested -= 1

    @contextlib.contextmanager
    def scope(self, root: str, tree: dict[str, Any], lead: tuple[int, ...] = ()) -> Iterator[None]:
        """Parameters created inside live in `tree`, are read from `root` and get `lead` dims."""
        self.scopes.append(Scope(root, tree, lead))
        try:
            yield
        finally:
            self.scopes.pop()

    # -- arguments ---------------------------------------------------------------------------
    def group(self, stem: str, entries: dict[str, Any]) -> str:
        """A dict of parameters `{name: shape | ArgSpec | dict}` (shapes: normal, scaled by
        1/sqrt(fan_in)); returns the expression that reads it."""
        scope = self.scopes[-1]
        name = self.fresh(stem)
        scope.tree[name] = self._param_tree(entries, scope.lead)
        return f'{scope.root}["{name}"]'

    def _param_tree(self, entries: dict[str, Any], lead: tuple[int, ...]) -> dict[str, Any]:
        return {k: self._param_tree(v, lead) if isinstance(v, dict) else self._param_spec(v, lead)
                for k, v in entries.items()}

    def param(self, stem: str, shape: tuple[int, ...] | ArgSpec) -> str:
        """One parameter array; returns its expression."""
        scope = self.scopes[-1]
        name = self.fresh(stem)
        scope.tree[name] = self._param_spec(shape, scope.lead)
        return f'{scope.root}["{name}"]'

    def _param_spec(self, v: tuple[int, ...] | ArgSpec, lead: tuple[int, ...]) -> ArgSpec:
        if isinstance(v, ArgSpec):
            return ArgSpec(lead + v.shape, v.dtype, v.kind, v.scale, v.high)
        fan_in = v[0] if len(v) > 1 else 1
        return ArgSpec(lead + tuple(v), self.dtype, "normal", 1.0 / math.sqrt(max(fan_in, 1)))

    def input(self, name: str, spec: ArgSpec) -> str:
        """A data input (batch entry); returns the expression that reads it."""
        if name not in self.inputs:
            self.inputs[name] = spec
        if self.batch_style == "args":
            return name
        if self.batch_style == "dict":
            return f'batch["{name}"]'
        return f"batch[{list(self.inputs).index(name)}]"

    def key(self) -> str:
        """An expression of a fresh PRNG key derived from the program's `key` argument."""
        self.uses_key = True
        return f"jax.random.fold_in(key, {self.randint(0, 1000)})"

    def fits(self, *dims: int) -> bool:
        return math.prod(dims) <= MAX_ELEMENTS
