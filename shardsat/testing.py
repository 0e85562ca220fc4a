"""Helpers for users' own test suites: a plan computes what the unsharded program does, and XLA
emits the collectives the plan predicts."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .checks import integer, known_keywords, real, require_mesh
from .egraph.collectives import COLLECTIVES
from .egraph.layout import auto_mesh
from .egraph.program import bind, is_extended
from .egraph.rewrite import Rewrite
from .errors import InvalidArgumentError, ShardsatError
from .runtime.plan import Plan, on_explicit_mesh
from .runtime.verify import compare, widened


class PlanMismatchError(ShardsatError, AssertionError):
    """A plan's sharded run differs from the unsharded program, or its HLO from its prediction."""


def default_rtol(dtype: Any) -> float:
    """check_plan's tolerance for outputs of a floating dtype: 1e-5, or 8 ulps of the dtype where
    that is more. A sharded plan sums in another order than one device does; in bfloat16 and
    float16 that alone moves results by up to an ulp (measured on MLP, normalisation and gradient
    plans), far above 1e-5."""
    try:
        eps = float(jnp.finfo(dtype).eps)
    except ValueError:  # not a floating dtype
        return 1e-5
    return max(1e-5, 8 * eps)


def _check_rtol(rtol: Any, allow_none: bool = False) -> None:
    if (rtol is None and allow_none) or real(rtol) is not None:
        return
    raise InvalidArgumentError(f"rtol must be a finite positive number{' or None (per dtype)' if allow_none else ''}, "
                               f"got {rtol!r}. Consider rtol=1e-5.")


def _check_is_plan(plan: Any, fn: str) -> None:
    if not isinstance(plan, Plan):
        raise InvalidArgumentError(f"{fn} takes the Plan from shardsat.saturate_and_extract first, got "
                                   f"{type(plan).__name__}. Consider {fn}(plan, *args).")


def _reference(plan: Plan, fn: Any, args: tuple[Any, ...], how: Any = jax.jit) -> Any:
    """The unsharded function's outputs: as the caller would run it, on one device where nothing
    places it (a custom_partitioning rule is then not called with the mesh's shardings). `how`
    is jax.jit, or jax.make_jaxpr for its program.

    A with_sharding_constraint(x, P(...)) in the function needs a mesh in context; where that
    fails and the caller set no mesh, it runs again under one, as the plan was traced.
    """
    try:
        return how(fn)(*args)
    except Exception as first:
        if not jax.sharding.get_abstract_mesh().empty or plan.runtime_mesh is None:
            raise
        try:
            with _reference_mesh(plan, args):
                return how(fn)(*args)
        except Exception:
            raise first from None


def _reference_mesh(plan: Plan, args: tuple[Any, ...]) -> Any:
    """The mesh to run the reference under: arguments placed on a mesh with Explicit axes carry
    that mesh in their types, and jax requires the context mesh to match it; otherwise the plan's."""
    for leaf in jax.tree_util.tree_leaves(args):
        if on_explicit_mesh(leaf):
            return jax.set_mesh(leaf.sharding.mesh)
    return jax.set_mesh(plan.runtime_mesh)


# With the default tolerance, a leaf may differ from the unsharded run by up to this many times
# what the summation order alone moves it by, measured two ways: against another layout of the
# same function (jax.jit, arguments split along their first dimension), and against the function
# run in float64, where each float32 run's error is its own noise. Adam's first step divides
# each gradient by its own size, so the order alone moves a near-zero gradient's update by up to
# the learning rate (a transformer's key bias: 0.054 in a plan, 0.048 under data-parallel
# jax.jit). The split run shares most of the one-device run's summation order: on a 3-layer
# AdamW MLP step a plan's weight was 2.96e-5 from the one-device run and 138x the split run's
# figure, yet 1.9e-5 from float64 where the one-device run was 3.5e-5. Plans measured up to 7x
# the split run's figure on ten training steps (a llama step's lm_head 7.6e-5 against 1.1e-5);
# a wrong plan is off by far more wherever the float32 runs agree with float64 to 1e-6
NOISE_FACTOR = 10.0


@known_keywords
def check_plan(plan: Plan, *args: Any, rtol: float | None = None, reference: Any = None) -> None:
    """Run the plan and the unsharded function on `args`; compare every output leaf.

    The error of a leaf is max|sharded - unsharded| / max|unsharded|, at most `rtol`. By default
    (rtol None) the tolerance is per output dtype (`default_rtol`: 1e-5 for float32, 8 ulps for
    bfloat16 and float16); a leaf over it still passes where the summation order alone moves it
    as far (an optimizer normalising a near-zero gradient): its error is at most NOISE_FACTOR
    times that of jax.jit with the arguments split along their first dimension, or, where the
    function runs in float64 (inputs widened; no random numbers), its distance from the float64
    result is at most the tolerance or NOISE_FACTOR times the unsharded run's. A weakly typed
    output (made from Python scalars) must be weakly typed in both: dtype promotion downstream
    reads it. Raises PlanMismatchError naming the output's pytree path and its error.
    """
    _check_is_plan(plan, "check_plan")
    _check_rtol(rtol, allow_none=True)
    if reference is not None and not callable(reference):
        raise InvalidArgumentError(f"check_plan's reference must be the function to compare with, got "
                                   f"{type(reference).__name__} {reference!r}. Consider reference=fn, or none "
                                   "(the planned function).")
    fn = reference if reference is not None else plan.fn
    got = plan.jit(donate_argnums=())(*args)
    want = _reference(plan, fn, args)
    gl, gt = jax.tree_util.tree_flatten(got)
    wl, wt = jax.tree_util.tree_flatten(want)
    if gt != wt:
        raise PlanMismatchError(f"The plan returns structure {gt}, the function {wt}.")
    floor = _NoiseFloor(plan, fn, args, len(wl))
    bad = []
    for n, (path, g, w) in enumerate(zip(plan.program.out_paths, gl, wl, strict=True)):
        problem, err = _key_problem(g, w)
        if problem is None:
            g, w = _numeric(g), _numeric(w)
            problem, err = _leaf_problem(g, w)
        if problem is None and _weak(gl[n]) != _weak(wl[n]):  # promotion downstream would differ
            problem = f"weak_type {_weak(gl[n])} vs {_weak(wl[n])}"
        if problem is None and err is not None:
            tol = default_rtol(w.dtype) if rtol is None else rtol
            if not err <= tol:
                why = floor.excuse(n, g, w, err, tol) if rtol is None else ""
                problem = None if why is None else f"relative error {err:.3g} > {tol:g}{why}"
        if problem is not None:
            bad.append(f"  * {path}: {problem}")
    if bad:
        raise PlanMismatchError(f"Plan for `{plan.program.name}` differs from the unsharded function:\n" + "\n".join(bad))


class _NoiseFloor:
    """How far the summation order alone moves each output: the other layout's outputs and the
    float64 outputs, each computed once, when a leaf first exceeds its tolerance."""

    def __init__(self, plan: Plan, fn: Any, args: tuple[Any, ...], n_out: int) -> None:
        self.plan, self.fn, self.args, self.n_out = plan, fn, args, n_out
        self._split: list[Any] | None = None
        self._exact: list[Any] | None = None

    def split(self) -> list[Any]:
        if self._split is None:
            other = _other_layout(self.plan, self.fn, self.args)
            self._split = other if len(other) == self.n_out else []
        return self._split

    def exact(self) -> list[Any]:
        if self._exact is None:
            wide = _float64_outputs(self.plan, self.fn, self.args)
            self._exact = wide if len(wide) == self.n_out else []
        return self._exact

    def excuse(self, n: int, g: np.ndarray, w: np.ndarray, err: float, tol: float) -> str | None:
        """None where leaf n's error `err` is within what the order alone moves it by, else
        the evidence for the message."""
        alt = _leaf_problem(np.asarray(self.split()[n]), w)[1] if self.split() else None
        if alt is not None and err <= NOISE_FACTOR * alt:
            return None
        why = "" if alt is None else f" (jax.jit with the arguments split: {alt:.3g})"
        x = np.asarray(self.exact()[n]) if self.exact() else None
        if x is None or x.shape != w.shape or x.dtype not in (np.float64, np.complex128):
            return why
        e_plan, e_one = _distance(g, x), _distance(w, x)
        e_split = _distance(np.asarray(self.split()[n]), x) if self.split() else 0.0
        noise = max(e_one, e_split)
        # an unsharded run that overflowed where float64 did not measures no noise: no excuse
        if math.isfinite(noise) and e_plan <= max(tol, NOISE_FACTOR * noise):
            return None
        return why + f" (against float64: the plan {e_plan:.3g}, the unsharded function {e_one:.3g})"


def _distance(x: np.ndarray, exact: np.ndarray) -> float:
    """x's relative error against a float64 (complex128) result of the same shape."""
    x = np.asarray(x)
    if x.shape != exact.shape:
        return float("inf")
    return _leaf_problem(x.astype(exact.dtype), exact)[1] or 0.0


# random bits differ in float64 (jax.random draws 64-bit floats from other bits): no reference
_RANDOM = {"random_bits", "random_seed", "random_wrap", "threefry2x32", "rng_bit_generator", "rng_uniform"}


def _float64_outputs(plan: Plan, fn: Any, args: tuple[Any, ...]) -> list[Any]:
    """The function's outputs in float64, its float arguments widened, where that computes the
    same thing: the same primitives (casts aside) as in the given dtypes, and no random numbers.
    Empty where it does not, or fails."""
    def widen(x: Any) -> Any:
        if not isinstance(x, jax.Array | np.ndarray) or is_extended(x.dtype):
            return x
        kind = np.dtype(x.dtype).kind
        if kind == "f" or jnp.issubdtype(x.dtype, jnp.floating):
            return np.asarray(x).astype(np.float64)
        return np.asarray(x).astype(np.complex128) if kind == "c" else x

    try:
        narrow = _primitives(plan, fn, args)
        with jax.enable_x64(True):
            wide_args = jax.tree_util.tree_map(widen, args)
            if _RANDOM & set(narrow) or _primitives(plan, fn, wide_args) != narrow:
                return []
            return jax.tree_util.tree_leaves(_reference(plan, fn, wide_args))
    except Exception:  # a function that does not run in float64: no such floor
        return []


def _primitives(plan: Plan, fn: Any, args: tuple[Any, ...]) -> Counter[str]:
    """The primitives `fn(*args)` traces to, in nested programs too, bar dtype conversions."""
    out: Counter[str] = Counter()
    todo = [_reference(plan, fn, args, jax.make_jaxpr).jaxpr]
    while todo:
        j = todo.pop()
        for eqn in j.eqns:
            if eqn.primitive.name != "convert_element_type":
                out[eqn.primitive.name] += 1
            for v in eqn.params.values():
                for item in v if isinstance(v, tuple | list) else (v,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        todo.append(inner)
    return out


def _weak(x: Any) -> bool:
    return bool(getattr(x, "weak_type", False))


def _key_problem(g: Any, w: Any) -> tuple[str | None, None]:
    """A mismatch of PRNG key arrays' types (their bits are compared as integers, _numeric)."""
    kg, kw = getattr(g, "dtype", None), getattr(w, "dtype", None)
    if (is_extended(kg) or is_extended(kw)) and kg != kw:
        return f"{kg}{list(np.shape(g))} vs {kw}{list(np.shape(w))}", None
    return None, None


def _numeric(x: Any) -> np.ndarray:
    """An output leaf as numpy: a PRNG key array (a step's new key) as its key bits, which numpy
    cannot hold as keys."""
    return np.asarray(jax.random.key_data(x) if is_extended(getattr(x, "dtype", None)) else x)


def _leaf_problem(g: np.ndarray, w: np.ndarray) -> tuple[str | None, float | None]:
    """(a mismatch that no tolerance excuses, or None; the relative error of a float leaf, or
    None where it matches exactly or is not a float)."""
    if g.shape != w.shape or g.dtype != w.dtype:
        return f"{g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}", None
    if w.size == 0:
        return None, None
    if w.dtype == bool or np.issubdtype(w.dtype, np.integer):
        n = int(np.sum(g != w))
        return (f"{n} of {w.size} elements differ" if n else None), None
    g64, w64 = widened(g, w)
    same = (g64 == w64) | (np.isnan(g64) & np.isnan(w64))  # equal infinities and NaNs match
    if same.all():
        return None, None
    finite = np.isfinite(w64)
    scale = float(np.max(np.abs(w64[finite]))) if finite.any() else 1.0
    return None, float(np.max(np.abs(np.where(same, 0.0, g64 - w64)))) / (scale or 1.0)


def _other_layout(plan: Plan, fn: Any, args: tuple[Any, ...]) -> list[Any]:
    """The function's outputs under jax.jit with each array argument split along its first
    dimension over every device where that divides (else whole), on an Auto mesh of the plan's
    devices: another summation order than one device's, as a measure of what the order alone
    moves. Empty where that run fails (the default tolerance then holds alone)."""
    if plan.runtime_mesh is None:
        return []
    auto = auto_mesh(plan.runtime_mesh)

    def place(x: Any) -> Any:
        shape = np.shape(x) if isinstance(x, jax.Array | np.ndarray) else None
        if shape is None:
            return x
        split = bool(shape) and shape[0] % auto.size == 0
        spec = jax.sharding.PartitionSpec(tuple(auto.axis_names)) if split else jax.sharding.PartitionSpec()
        return jax.device_put(x, jax.sharding.NamedSharding(auto, spec))

    try:
        with jax.set_mesh(auto):
            return jax.tree_util.tree_leaves(jax.jit(fn)(*jax.tree_util.tree_map(place, args)))
    except Exception:  # a function this layout cannot run: no noise floor
        return []


def normalize_collectives(counts: Counter[str]) -> Counter[str]:
    """Merge all-reduce and reduce-scatter into one "reduction" count: on CPU a reduce-scatter is
    an all-reduce whose result is sliced, and XLA fuses a plan's all-reduce with a later slice of
    the same value into exactly that form, so the two kinds cannot be told apart in HLO."""
    sums = [kind.name for kind in COLLECTIVES.values() if kind.sums]
    out = Counter({k: v for k, v in counts.items() if k not in sums and v})
    red = sum(counts.get(k, 0) for k in sums)
    if red:
        out["reduction"] = red
    return out


def check_collectives(plan: Plan, *args: Any) -> None:
    """The compiled HLO holds the collectives `plan.cost` lists (count by kind)."""
    _check_is_plan(plan, "check_collectives")
    want = normalize_collectives(plan.predicted_collectives())
    got = normalize_collectives(plan.hlo_collectives(*args))
    if dict(got) != dict(want):
        raise PlanMismatchError(
            f"Compiled HLO has collectives {dict(plan.hlo_collectives(*args))}, the plan predicts "
            f"{dict(plan.predicted_collectives())}.\n{plan.explain()}"
        )


class RuleCheckError(PlanMismatchError):
    """A sharding rule computes something different on shards than on the whole array."""


_MESHES = ((2, 4), (1, 8), (8,), (2, 2), (4,))


def _mesh(shape: tuple[int, ...]) -> Any:
    import math

    names = ("x", "y", "z")[: len(shape)]
    n = math.prod(shape)
    if jax.device_count() < n:
        return None
    return jax.make_mesh(shape, names, devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@known_keywords
def check_strategies(
    sig: Any,
    apply: Any,
    operands: list[np.ndarray],
    mesh: Any,
    rng: np.random.Generator,
    *,
    name: str,
    params_for: Any = None,
    rtol: float = 1e-5,
    max_strategies: int | None = None,
) -> list[str]:
    """Run every strategy the generic rule derives from `sig` on `mesh`; return failures."""
    from .egraph.layout import MeshAxes, SpaceTable
    from .rules.strategies import enumerate_strategies
    from .runtime.verify import check_local

    axes = MeshAxes.from_mesh(mesh)
    spaces = SpaceTable(axes)
    outs = jax.eval_shape(apply, *operands)
    outs_l = list(outs) if isinstance(outs, list | tuple) else [outs]
    op_spaces = [spaces.space(tuple(x.shape), x.dtype) for x in operands]
    res_spaces = [spaces.space(tuple(o.shape), o.dtype) for o in outs_l]
    strategies = enumerate_strategies(sig, axes, spaces, op_spaces, res_spaces)
    if max_strategies is not None and len(strategies) > max_strategies:
        pick = rng.choice(len(strategies), max_strategies, replace=False)
        strategies = [strategies[i] for i in sorted(pick)]
    failures = []
    for st in strategies:
        ins = [spaces.layouts[lid] for lid in st.ins]
        res = [spaces.layouts[lid] for lid in st.outs]
        bad = check_local(apply, operands, ins, res, axes, mesh, rng, name=name, params_for=params_for)
        if bad is not None and not bad.error <= rtol:
            assign = ", ".join(f"{f}->{axes.label(ax)}" for f, ax in st.factor_axes) or "none"
            failures.append(
                f"{name} on mesh {dict(zip(axes.names, axes.sizes, strict=True))}, operand shapes "
                f"{[tuple(x.shape) for x in operands]}: factors sharded {assign}"
                + (f", partial sums carried over {axes.label(st.carried)}" if st.carried else "")
                + f" -> relative error {bad.error:.3g} ({bad.detail})"
            )
    return failures


@known_keywords
def check_rule(
    rule: Any,
    *,
    params: dict[str, Any] | None = None,
    apply: Any = None,
    meshes: tuple[tuple[int, ...], ...] = _MESHES,
    sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16),
    max_examples: int = 20,
    max_strategies: int = 12,
    rtol: float = 1e-5,
    seed: int = 0,
) -> None:
    """Check a rule from `shardsat.register_signature` on the simulated devices.

    Hypothesis draws factor sizes (divisible and not divisible by the mesh) and a mesh; for each
    strategy the generic rule derives (factors sharded over mesh axes, pending sums carried), the
    primitive runs on shards inside `shard_map` (pending sums fed in as random parts that sum to
    the operand) and is compared with the unsharded result. Raises RuleCheckError with the
    first failing example (hypothesis draws the first mesh and sizes of each list first).
    """
    try:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import strategies as hs
    except ImportError as e:  # pragma: no cover
        raise ShardsatError("check_rule needs hypothesis: pip install hypothesis") from e
    _check_rule_args(rule, meshes, sizes, max_examples, max_strategies, rtol)
    if (params is not None and not isinstance(params, dict)) or (apply is not None and not callable(apply)):
        raise InvalidArgumentError(f"check_rule: params must be a dict of the primitive's parameters and apply a "
                                   f"function of the operands, got params={params!r}, apply={apply!r}.")
    if isinstance(rule, Rewrite):
        _check_rewrite(rule, sizes, max_examples, rtol, seed)
        return
    params = dict(params or {})
    if apply is None and not hasattr(rule.primitive, "bind"):  # a custom_partitioning function
        def apply(*xs: Any, **kw: Any) -> Any:
            return rule.primitive(*xs)
    elif apply is None:
        def apply(*xs: Any, **kw: Any) -> Any:
            return rule.primitive.bind(*xs, **{**params, **kw})
    usable = [m for m in meshes if _mesh(m) is not None]
    if not usable:
        raise ShardsatError(f"check_rule needs devices for one of the meshes {meshes}; jax has {jax.device_count()}.")
    factors = rule.factors

    # no shrinking: hypothesis draws the first sizes of each list first, and shrinking a failure
    # over a few sampled sizes re-ran dozens of shard programs (a wrong rule took 25 s to report)
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate))
    @given(hs.sampled_from(usable), hs.fixed_dictionaries({f: hs.sampled_from(sizes) for f in factors}))
    def run(mesh_shape: tuple[int, ...], fsizes: dict[str, int]) -> None:
        rng = np.random.default_rng(seed)
        operands = []
        for t in rule.operands:
            shape = tuple(int(np.prod([fsizes[f] for f in d])) if d else 1 for d in t)
            operands.append(rng.standard_normal(shape).astype(np.float32))
        try:
            outs = jax.eval_shape(apply, *operands)
            outs_l = list(outs) if isinstance(outs, list | tuple) else [outs]
            sig = rule.signature([tuple(x.shape) for x in operands], [tuple(o.shape) for o in outs_l])
            failures = check_strategies(sig, apply, operands, _mesh(mesh_shape), rng, name=rule.name,
                                        rtol=rtol, max_strategies=max_strategies)
            failures += _pin_failures(rule, apply, operands)
        except RuleCheckError:
            raise
        except Exception as e:  # the primitive or the rule fails on these shapes: a counterexample too
            raise RuleCheckError(
                f"Rule `{rule.name}` ({rule.spec!r}) fails for factor sizes {fsizes} on mesh {mesh_shape}: "
                f"{type(e).__name__}: {_first_line(e)}") from e
        if failures:
            raise RuleCheckError(f"Rule `{rule.name}` ({rule.spec!r}) is wrong:\n  * " + "\n  * ".join(failures[:5])
                                 + ("\nConsider declaring the factor as a reduction or need-replication factor."))

    _run_property(run, f"Rule `{rule.name}`", [])


def _pin_failures(rule: Any, apply: Any, operands: list[Any]) -> list[str]:
    """A rule registered with pin= is lowered as its operand, placed (runtime/lower.py): the
    primitive must return its first operand unchanged."""
    from .rules.registry import rule_for

    if not hasattr(rule.primitive, "bind") or rule_for(rule.primitive).pin is None:  # custom_partitioning: no pins
        return []
    got, want = np.asarray(apply(*operands)), np.asarray(operands[0])
    if got.shape != want.shape or got.dtype != want.dtype:
        change = f"{want.dtype}{list(want.shape)} -> {got.dtype}{list(got.shape)}"
    elif np.array_equal(got, want, equal_nan=got.dtype.kind in "fc"):
        return []
    else:
        change = f"{int(np.sum(got != want))} of {want.size} elements differ"
    return [f"registered with pin={rule_for(rule.primitive).pin!r}, so plans return its operand unchanged, but "
            f"`{rule.name}` changes it ({change}). Consider register_signature(...) without pin="]


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


def _run_property(prop: Any, what: str, skipped: list[BaseException]) -> None:
    """Run a hypothesis property so that what it finds comes back as one shardsat error: several
    distinct failures arrive from hypothesis as an ExceptionGroup, and an example that never
    applies as hypothesis's Unsatisfiable (`skipped` holds why examples were skipped)."""
    from hypothesis.errors import Unsatisfiable

    try:
        prop()
    except Unsatisfiable:
        why = f" ({type(skipped[0]).__name__}: {_first_line(skipped[0])})" if skipped else ""
        raise InvalidArgumentError(
            f"{what} could not be checked: it applies to none of the operand shapes tried{why}. Consider "
            "example_args whose shapes the lhs accepts, and a `sizes=` its dimensions may take.") from None
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        first = next((e for e in leaves if isinstance(e, RuleCheckError)), leaves[0])
        others = "; ".join(f"{type(e).__name__}: {_first_line(e)}" for e in leaves if e is not first)
        raise RuleCheckError(
            (str(first) if isinstance(first, RuleCheckError) else f"{what} fails: {type(first).__name__}: {first}")
            + f"\n(hypothesis found {len(leaves)} distinct failures; the others: {others})") from group


def _check_rule_args(rule: Any, meshes: Any, sizes: Any, max_examples: Any, max_strategies: Any, rtol: Any) -> None:
    """check_rule's arguments: a rule, and the sizes and counts hypothesis draws from."""
    from .rules.user import SignatureRule

    problems = []
    if not isinstance(rule, SignatureRule | Rewrite):
        problems.append(f"rule must be a SignatureRule (from shardsat.register_signature) or a shardsat.Rewrite, "
                        f"got {type(rule).__name__} {rule!r}")
    if not isinstance(sizes, tuple | list) or not sizes or any(integer(s) is None for s in sizes):
        problems.append(f"sizes must be a non-empty tuple of positive integers, got {sizes!r}")
    if not isinstance(meshes, tuple | list) or not meshes or any(
            not isinstance(m, tuple) or not m or any(integer(n) is None for n in m) for m in meshes):
        problems.append(f"meshes must be a tuple of mesh shapes such as ((2, 4), (8,)), got {meshes!r}")
    for label, n in (("max_examples", max_examples), ("max_strategies", max_strategies)):
        if integer(n) is None:
            problems.append(f"{label} must be a positive integer, got {n!r}")
    if real(rtol) is None:
        problems.append(f"rtol must be a finite positive number, got {rtol!r}")
    if problems:
        raise InvalidArgumentError("check_rule: " + "; ".join(problems) + ". Consider check_rule(rule) with the defaults.")


@known_keywords
def check_equation_rules(fn: Any, *args: Any, mesh: Any, rtol: float = 1e-5, max_strategies: int | None = None,
                         seed: int = 0) -> list[str]:
    """Check the built-in signature of every equation `fn(*args)` traces to, on `mesh`: each
    strategy runs on shards and is compared with the unsharded equation. Returns failures.
    Equations inside loops and branches, and those reading their results, are not checked (their
    operands are known only by running the loop); nor are those on PRNG key arrays (plans keep
    them replicated)."""
    from .egraph.program import SCAN_PSEUDO, Literal, trace
    from .rules.apply import _eqn_types, signature_for
    from .runtime.verify import localized

    require_mesh(mesh, "check_equation_rules")
    prog = trace(fn, args)
    env: dict[int, Any] = {}
    flat = jax.tree_util.tree_leaves(args)
    for vid, x in zip(prog.args, flat, strict=True):
        env[vid] = _host(x)
    for vid in prog.const_values:
        env[vid] = _host(prog.consts[prog.values[vid].const])
    rng = np.random.default_rng(seed)
    failures: list[str] = []
    for eqn in prog.equations:
        ins = [a for a in eqn.inputs if not isinstance(a, Literal)]
        if eqn.region is not None or eqn.name in SCAN_PSEUDO or any(a not in env for a in ins):
            continue
        operands = [env[a] for a in ins]
        keys = any(is_extended(prog.values[v].dtype) for v in (*ins, *eqn.outputs))

        def apply(*xs: Any, _eqn: Any = eqn, **kw: Any) -> Any:
            it = iter(xs)
            full = [a.value if isinstance(a, Literal) else next(it) for a in _eqn.inputs]
            return bind(_eqn.primitive, full, {**_eqn.params, **kw})

        t = _eqn_types(prog, eqn)
        sig, _ = signature_for(eqn, t, None)
        # the check runs the equation alone, so drop literal operands from the signature
        keep = [i for i, a in enumerate(eqn.inputs) if not isinstance(a, Literal)]
        remap = {old: new for new, old in enumerate(keep)}
        from dataclasses import replace

        sig2 = replace(sig, operands=tuple(sig.operands[i] for i in keep),
                       linear=tuple(tuple(remap[i] for i in grp) for grp in sig.linear if all(i in remap for i in grp)))
        if not keys and not any(0 in shape for shape in (*t.in_shapes, *t.out_shapes)):  # else: replicated
            failures += check_strategies(sig2, apply, operands, mesh, rng, name=f"{eqn.name} at {eqn.source}",
                                         params_for=_params_only(eqn.name, eqn.params, localized), rtol=rtol,
                                         max_strategies=max_strategies)
        outs = apply(*[jax.numpy.asarray(x) for x in operands])
        outs = outs if isinstance(outs, list) else [outs]
        for o, v in zip(eqn.outputs, outs, strict=True):
            env[o] = _host(v)
    return failures


def _host(x: Any) -> Any:
    """A value as check_equation_rules keeps it: numpy, but PRNG key arrays as they are."""
    return x if is_extended(getattr(x, "dtype", None)) else np.asarray(x)


def _params_only(name: str, params: dict[str, Any], localized: Any) -> Any:
    """Local params that differ from the equation's own (shape params of split dimensions)."""
    fn = localized(name, params)

    def diff(ins: list, outs: list) -> dict[str, Any]:
        new = fn(ins, outs)
        return {k: v for k, v in new.items() if params.get(k) is not v}

    return diff


@known_keywords
def check_reshard_rules(shape: tuple[int, ...], mesh: Any, dtype: Any = np.float32, seed: int = 0,
                        max_edges: int | None = None, rtol: float | None = None) -> list[str]:
    """Check every resharding rewrite between layouts of one (shape, dtype) on `mesh`: each
    collective, as the runtime lowers it, must leave the value unchanged, within `rtol` (default:
    the dtype's, `default_rtol`: a sum of pending parts moves bfloat16 by an ulp)."""
    from .egraph.layout import MeshAxes, SpaceTable
    from .rules.reshard import reshard_edges
    from .runtime.verify import check_collective

    require_mesh(mesh, "check_reshard_rules")
    _check_rtol(rtol, allow_none=True)
    tol = default_rtol(dtype) if rtol is None else rtol
    axes = MeshAxes.from_mesh(mesh)
    spaces = SpaceTable(axes)
    sp = spaces.space(tuple(shape), np.dtype(dtype))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    edges = reshard_edges(sp, spaces)
    if max_edges is not None and len(edges) > max_edges:
        edges = [edges[i] for i in sorted(rng.choice(len(edges), max_edges, replace=False))]
    failures = []
    for e in edges:
        err = check_collective(e, x, spaces.layouts.layouts, axes, mesh, rng)
        if not err <= tol:
            failures.append(f"{e.kind.name} over {axes.label(e.axes)} from {spaces.layouts[e.src].describe(axes)} to "
                            f"{spaces.layouts[e.dst].describe(axes)} on shape {shape}: relative error {err:.3g}")
    return failures


def _check_rewrite(rw: Rewrite, sizes: tuple[int, ...], max_examples: int, rtol: float, seed: int) -> None:
    """lhs == rhs on random operands. Each distinct size in `example_args` is one independent
    dimension: hypothesis draws a new size for each and runs both sides on operands of the
    resulting shapes (shapes the lhs does not apply to are skipped)."""
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import strategies as hs

    examples = [jax.ShapeDtypeStruct(np.shape(a), getattr(a, "dtype", np.float32)) for a in rw.example_args]
    distinct = sorted({d for a in examples for d in a.shape})

    # each side runs as one compiled function, on numpy operands: eager ops and jax.random
    # compile once per new shape each; no shrinking (as in check_rule): it draws many shapes
    lhs, rhs = jax.jit(rw.lhs), jax.jit(rw.rhs)

    @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate))
    @given(hs.lists(hs.sampled_from(sizes), min_size=len(distinct), max_size=len(distinct)))
    def prop(drawn: list[int]) -> None:
        to = dict(zip(distinct, drawn, strict=True))
        shapes = [tuple(to[d] for d in a.shape) for a in examples]
        rng = np.random.default_rng(seed)
        xs = [rng.standard_normal(s).astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating)
              else rng.integers(-4, 4, s).astype(a.dtype)
              for s, a in zip(shapes, examples, strict=True)]
        try:
            want = lhs(*xs)
        except (TypeError, ValueError) as e:
            skipped.append(e)
            assume(False)
        try:
            got = rhs(*xs)
        except Exception as e:
            raise RuleCheckError(f"Rewrite `{rw.name}`: rhs fails for operand shapes {shapes}, where lhs works: "
                                 f"{type(e).__name__}: {_first_line(e)}") from e
        g, w = widened(got, want)
        if g.shape != w.shape:
            raise RuleCheckError(f"Rewrite `{rw.name}`: rhs gives shape {g.shape}, lhs {w.shape} for operand "
                                 f"shapes {shapes}.")
        _compare_sides(rw.name, shapes, g, w, rtol)

    skipped: list[BaseException] = []
    _run_property(prop, f"Rewrite `{rw.name}`", skipped)


def _compare_sides(name: str, shapes: list[tuple[int, ...]], g: np.ndarray, w: np.ndarray, rtol: float) -> None:
    """A rewrite's rhs (g) against its lhs (w): NaNs and infinities must sit where the lhs has
    them (`log a + log a == 2 log a` is NaN on both sides for a < 0, and holds), the rest within
    rtol of the lhs's largest finite entry."""
    i, err = compare(g, w)
    if i is not None:
        raise RuleCheckError(
            f"Rewrite `{name}` is wrong for operand shapes {shapes}: at {i} lhs gives {w[i]} and rhs {g[i]}. Operands "
            "are drawn from a standard normal; a rewrite that holds on part of the domain only (exp(log a) == a "
            "for a > 0) changes what the program computes elsewhere.")
    if not err <= rtol:
        raise RuleCheckError(f"Rewrite `{name}` is wrong for operand shapes {shapes}: rhs differs from lhs "
                             f"(relative error {err:.3g} > rtol {rtol}).")


@known_keywords
def standard_layouts(fn: Any, mesh: Any, *args: Any, state_argnums: Any = None) -> dict[str, tuple[Any, ...]]:
    """The standard layout families (data parallel, ZeRO-1, FSDP over every set of mesh axes,
    tensor parallel per axis with data parallel or FSDP over the rest, tensor parallel over the
    whole mesh, replicated) of this program on this mesh, each as an `in_shardings` tuple for
    saturate_and_extract (None where the family leaves an argument free). The search
    starts from them (every one on small programs, as many as its budget allows on big ones:
    extract/search.py), so the free plan should be no costlier than any of them pinned:

        free = shardsat.saturate_and_extract(fn, mesh, *args)
        for name, pins in standard_layouts(fn, mesh, *args).items():
            pinned = shardsat.saturate_and_extract(fn, mesh, *args, in_shardings=pins)
            assert free.cost.total_s <= pinned.cost.total_s * (1 + 1e-6), name
    """
    from .egraph.constraints import adopt_constraints
    from .egraph.layout import MeshAxes, SpaceTable
    from .egraph.program import trace
    from .extract.families import family_layouts
    from .pins import resolve_ties
    from .rules.apply import build_tables

    require_mesh(mesh, "standard_layouts")
    program = trace(fn, args, auto_mesh(mesh))
    adopt_constraints(program, auto_mesh(mesh))  # as planning does (the plan warns of what it drops)
    spaces = SpaceTable(MeshAxes.from_mesh(mesh))
    ties = resolve_ties(program, state_argnums, program.name)
    out = {}
    tables = build_tables(program, spaces, "replicate", edges=False)
    for name, layouts in family_layouts(program, spaces, ties, tables):
        specs = [layouts[pos].spec(spaces.mesh) if pos in layouts else None for pos in range(len(program.args))]
        out[name] = tuple(jax.tree_util.tree_unflatten(program.in_tree, specs))
    return out
