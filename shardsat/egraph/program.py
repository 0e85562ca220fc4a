"""The program IR: a flat, inlined list of jaxpr equations over numbered values.

Tracing goes through `jax.make_jaxpr`; nested call primitives (`jit`/`pjit`, `closed_call`,
`custom_jvp_call`, `custom_vjp_call`, `checkpoint`, `composite`, and `custom_linear_solve`'s solve)
are inlined so that sharding decisions can cross function boundaries. Everything later in the
pipeline refers to values by their integer id.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from ..errors import InvalidArgumentError

# Primitives whose body is inlined. Their outputs are exactly their body's outputs.
CALL_PRIMITIVES = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "checkpoint",
        "remat",
        "remat2",
        "name",
        "composite",  # lax.composite: its body is its value (the name is for backends that match it)
    }
)
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclass(frozen=True)
class Literal:
    """A scalar literal operand of an equation (jaxpr Literal)."""

    value: Any
    dtype: np.dtype

    def __repr__(self) -> str:
        return f"{self.value!r}:{self.dtype}"


Atom = int | Literal


@dataclass(frozen=True)
class ValueInfo:
    """A logical (global) tensor. `producer` is the equation index, or None for inputs/consts."""

    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    producer: int | None = None
    output_index: int = 0
    arg: int | None = None  # flat argument position, for inputs
    const: int | None = None  # index into Program.consts, for closed-over constants
    region: int | None = None  # the scan whose body defines this value (None: top level)
    carry: tuple[int, int] | None = None  # (scan, k) for the body's k-th carry input
    weak_type: bool = False  # an argument traced from a Python scalar (weakly typed, as under jax.jit)

    @property
    def nbytes(self) -> int:
        """Python integers: a 2**63-element argument has more bytes than int64 holds."""
        return math.prod(int(d) for d in self.shape) * itemsize(self.dtype)


@dataclass
class Equation:
    index: int
    primitive: jcore.Primitive
    params: dict[str, Any]
    inputs: tuple[Atom, ...]
    outputs: tuple[int, ...]
    # jax's SourceInfo of the traced equation (or a ready "file:line" text): summarised on first
    # use, since walking a traceback for each of thousands of equations is a visible part of tracing
    origin: Any
    region: int | None = None  # the scan whose body this equation is in
    key: str | None = None  # content key, once computed (egraph/keys.py)
    # side effects (a debug print, an io_callback): the equation runs exactly as often as under
    # jax.jit, so it is never merged with an equal one, dropped, or folded away
    effects: bool = False

    @property
    def name(self) -> str:
        return self.primitive.name

    @property
    def source(self) -> str:
        """Where the user's code made this equation ("file:line (function)")."""
        if not isinstance(self.origin, str):
            self.origin = _Origin(_summary(self.origin) or "an unknown location", str(self.origin.name_stack))
        return str(self.origin)

    @property
    def scope(self) -> str:
        """The `jax.named_scope` names around this equation."""
        if isinstance(self.origin, str):
            return getattr(self.origin, "scope", "")
        return str(getattr(self.origin, "name_stack", ""))


@dataclass(frozen=True)
class Nested:
    """Where an equation inlined from a call (a jit inside jnp.pad, a cond branch) came from: its
    own SourceInfo, and the origin of the call equation, whose user frame names it when every
    frame of its own is inside jax."""

    info: Any
    outer: Any

    @property
    def name_stack(self) -> Any:
        return self.info.name_stack


def _summary(origin: Any) -> str:
    """The user's frame of an origin: its own, else that of the call it was inlined from."""
    if isinstance(origin, Nested):
        return _summary(origin.info) or _summary(origin.outer)
    return source_info_util.summarize(origin)


class _Origin(str):
    """A summarised source position that keeps the named scope it was traced in."""

    scope: str

    def __new__(cls, text: str, scope: str) -> _Origin:
        out = super().__new__(cls, text)
        out.scope = scope
        return out

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        """copy.deepcopy and pickle rebuild it with its scope (str's own takes the text alone:
        deepcopy of a Plan raised TypeError)."""
        return (_Origin, (str(self), self.scope))


# Pseudo-primitives connecting a region (a scan or while body, a cond branch) to the program
# around it; never bound.
SCAN_SLICE = jcore.Primitive("scan_slice")  # xs[i]: the iteration's slice of a scanned input
SCAN_STACK = jcore.Primitive("scan_stack")  # ys: an iteration's output, stacked over iterations
SCAN_FINAL = jcore.Primitive("scan_final")  # the carry after the last iteration (scan or while)
# a cond's k-th result: (index, branch 0's k-th output, branch 1's, ...), all in one layout
COND_MERGE = jcore.Primitive("cond_merge")
SCAN_PSEUDO = frozenset({"scan_slice", "scan_stack", "scan_final", "cond_merge"})


@dataclass
class ScanRegion:
    """A region of the program run as one unit of control flow, planned once.

    kind "scan": a `lax.scan` body; its values are weighted by the iteration count and its carry
    keeps one layout from iteration to iteration, like loop-carried state. kind "while": a
    `lax.while_loop` body, the same with no xs or ys, `length` an estimate of its trip count;
    its predicate is computed by a sibling region of kind "while_cond" over the same carry
    values. kind "branch": one branch of a `lax.cond` / `lax.switch`, reading outer values
    directly; its results meet the other branches' in one layout (COND_MERGE equations)."""

    index: int
    length: int
    reverse: bool
    parent: int | None
    multiplicity: int  # body executions per program run (length times the parent's)
    init: list[Atom]  # outer atoms: the initial carry
    carry_in: list[int]  # body values: the carry entering an iteration
    carry_out: list[Atom]  # body atoms: the carry leaving it
    final: list[int]  # outer values: the carry after the last iteration (scan_final)
    xs: list[Atom]  # outer atoms scanned over (leading dimension = iterations)
    slices: list[int]  # body values xs[i] (scan_slice)
    ys: list[Atom]  # body atoms stacked into outputs
    stacked: list[int]  # outer values: the stacked ys (scan_stack)
    params: dict[str, Any] = field(default_factory=dict)
    # A folded unrolled loop (egraph/fold.py) is not run as a scan: its original repeats are
    # replayed with the body's layouts. replay: body equation index -> the equation in each
    # repeat; members: body value -> the original value in each repeat.
    replay: dict[int, list[Any]] = field(default_factory=dict)
    members: dict[int, list[Atom]] = field(default_factory=dict)
    extra_reads: list[int] = field(default_factory=list)  # per-repeat inputs planned on their own
    # folded body values every repeat computes alike (from the same outer values only): priced
    # once, and the runtime's replay computes them in the first repeat only
    invariant: set[int] = field(default_factory=set)
    kind: str = "scan"  # "scan", "while", "while_cond" or "branch"
    pred: Atom | None = None  # while: the predicate, computed in region `cond_region`
    cond_region: int | None = None  # while: its "while_cond" region
    outs: list[Atom] = field(default_factory=list)  # branch: its results, in the cond's order

    @property
    def folded(self) -> bool:
        return bool(self.params.get("folded"))


@dataclass
class Program:
    """A traced function: flat inputs, equations in topological order, flat outputs."""

    values: list[ValueInfo]
    equations: list[Equation]
    args: list[int]  # value id of each flat argument leaf
    consts: list[Any]  # closed-over constant arrays (value ids via ValueInfo.const)
    const_values: list[int]
    outputs: list[Atom]
    in_tree: Any  # treedef of the positional-args tuple
    out_tree: Any
    arg_paths: list[str]
    out_paths: list[str]
    arg_counts: list[int] = field(default_factory=list)  # flat leaves per positional arg
    name: str = "fn"
    scans: list[ScanRegion] = field(default_factory=list)
    carries: list[int] = field(default_factory=list)  # carry-input values, placed like arguments
    aliases: dict[int, int] = field(default_factory=dict)  # value -> the value whose layout it shares
    equivalences: list[tuple[int, int]] = field(default_factory=list)  # values a rewrite proved equal
    notes: list[str] = field(default_factory=list)  # what folding saw of the named scopes (egraph/scopes.py)
    # each flat output's weak_type under jax.jit (a scan carry started from 0.0, a Python scalar
    # a branch returns): the runtime gives its outputs the same, so dtype promotion downstream
    # is jax.jit's
    out_weak: list[bool] = field(default_factory=list)

    def alias(self, vid: int) -> int:
        """The representative of a folded value (itself if not an alias)."""
        while vid in self.aliases:
            vid = self.aliases[vid]
        return vid

    def run_loop(self, r: int) -> int | None:
        """The loop XLA runs region `r` in as one while instruction: a scan or while loop not
        folded (its body), or a while loop's predicate region (its loop); None otherwise."""
        reg = self.scans[r]
        loop = self.scans[reg.params["loop"]] if reg.kind == "while_cond" else reg
        return loop.index if not loop.folded and loop.kind in ("scan", "while") else None

    def is_folded_body(self, vid: int) -> bool:
        """A value of a folded loop's body: it stands for its repeats' arrays, not one of its own."""
        r = self.values[vid].region
        return r is not None and bool(self.scans[r].params.get("folded"))

    def region_multiplicity(self, region: int | None) -> int:
        return 1 if region is None else self.scans[region].multiplicity

    def is_loop_invariant(self, vid: int) -> bool:
        """A folded body value every repeat computes alike (see ScanRegion.invariant)."""
        r = self.values[vid].region
        return r is not None and vid in self.scans[r].invariant

    def value_multiplicity(self, vid: int) -> int:
        """Times per step the value is computed: its region's multiplicity, but once for a folded
        body's loop-invariant values."""
        return 1 if self.is_loop_invariant(vid) else self.region_multiplicity(self.values[vid].region)

    def consumers(self) -> list[list[tuple[int, int]]]:
        """For each value: the (equation index, operand position) pairs that read it."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.values]
        for eqn in self.equations:
            for pos, a in enumerate(eqn.inputs):
                if isinstance(a, int):
                    out[a].append((eqn.index, pos))
        return out

    def required_values(self) -> list[tuple[int, bool]]:
        """Values computed whether or not an output reads them, and whether they must be whole
        (replicated): a while loop's predicate; every result of an equation or region with side
        effects (so it runs exactly as under jax.jit); and, whole, the operands of an effect with
        no results (a debug print), which the runtime runs on whole arrays."""
        out: list[tuple[int, bool]] = []
        effectful = {r.index for r in self.scans if r.params.get("effects")}
        for reg in self.scans:
            if reg.kind == "while" and isinstance(reg.pred, int):
                out.append((reg.pred, False))
        for eqn in self.equations:
            region_fx = (eqn.name in ("scan_final", "scan_stack") and eqn.params["scan"] in effectful) or (
                eqn.name == "cond_merge" and bool(effectful.intersection(eqn.params["cond"])))
            if eqn.effects or region_fx:
                out.extend((o, False) for o in eqn.outputs)
            if eqn.effects and not eqn.outputs:
                out.extend((a, True) for a in eqn.inputs if isinstance(a, int))
        return out

    def shape(self, atom: Atom) -> tuple[int, ...]:
        return () if isinstance(atom, Literal) else self.values[atom].shape


def bind(primitive: Any, operands: Sequence[Any], params: dict[str, Any]) -> Any:
    """Apply a traced equation's primitive to `operands`. Higher-order primitives (shard_map, for
    one) take their bodies as bind arguments, not as the jaxpr params the equation holds: jax's
    own evaluator splits them the same way."""
    if primitive.name != "sharding_constraint":  # a user's pin: the plan keeps it (rules/registry.py)
        params = _typed_shardings_dropped(params)
    elif params.get("sharding") is None:  # one no plan can keep (egraph/constraints.py)
        return operands[0]
    if primitive.name in ("debug_callback", "debug_print") and params.get("partitioned"):
        # a callback per device's shard: jax.jit of the function calls it once, with the whole
        # value (one device); the plan does the same, whatever layout it gives the value
        params = {**params, "partitioned": False}
    if primitive.name == "debug_callback" and type(params.get("effect")).__name__ == "OrderedDebugEffect":
        return _ordered_debug_callback(operands, params["callback"])
    if primitive.name == "debug_print" and params.get("ordered"):
        unordered = {**params, "ordered": False}
        return _ordered_debug_callback(operands, lambda *a: primitive.impl(*a, **unordered))
    bind_params = primitive.get_bind_params(params)
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # jax versions that return the bodies beside the params
        subfuns, bind_params = bind_params
    out = primitive.bind(*subfuns, *operands, **bind_params)
    return list(out) if primitive.multiple_results else out  # shard_map gives a FlatTree


def _ordered_debug_callback(operands: Sequence[Any], callback: Callable[..., Any]) -> list[Any]:
    """jax.debug.callback / print with ordered=True: jax runs ordered debug effects on one device
    only ("not supported for more than 1 device"), so the plan calls the same callback (for a
    print, the primitive's own eager print) through io_callback(ordered=True), which jax runs
    once, in program order, on any mesh."""
    from jax.experimental import io_callback

    def call(*args: Any) -> None:
        callback(*args)

    io_callback(call, None, *operands, ordered=True)
    return []


_RESULT_SHARDINGS = ("sharding", "out_sharding")


def _typed_shardings_dropped(params: dict[str, Any]) -> dict[str, Any]:
    """A result's sharding type (`out_sharding=`, broadcast_in_dim's `sharding`) on a mesh of
    Explicit axes, dropped where none is in context: a function traced under a user's
    `jax.set_mesh` of Explicit axes carries them, and the plan runs on its Auto copy of the mesh,
    where jax refuses them. The plan places the value itself."""
    drop = [k for k in _RESULT_SHARDINGS if isinstance(params.get(k), jax.sharding.NamedSharding)
            and any(t == jax.sharding.AxisType.Explicit for t in params[k].mesh.axis_types)]
    if not drop or not all(t == jax.sharding.AxisType.Auto for t in jax.sharding.get_abstract_mesh().axis_types):
        return params
    return {**params, **{k: None for k in drop}}


def make_jaxpr_in(fn: Callable[..., Any], args: Sequence[Any], context: Any) -> tuple[jcore.ClosedJaxpr, Any]:
    """`jax.make_jaxpr(fn, return_shape=True)(*args)` inside `context` (a mesh context, or None);
    where that fails, with no mesh in context, as jax.jit would trace it: a user's shard_map over
    another mesh than the plan's is refused under the plan's. If both fail, the first error."""
    if context is None:
        return jax.make_jaxpr(fn, return_shape=True)(*args)
    try:
        with context:
            return jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as under_mesh:
        try:
            return jax.make_jaxpr(fn, return_shape=True)(*args)
        except Exception:
            raise under_mesh from None


@functools.cache
def dtype_name(dtype: Any) -> str:
    """str(dtype), kept: the memory model names the dtypes of every equation's values (numpy's
    __str__ took a tenth of a 24-layer step's estimate)."""
    return str(dtype)


def itemsize(dtype: Any) -> int:
    """Bytes per element; extended dtypes (PRNG keys) count their underlying words."""
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return int(getattr(dtype, "itemsize", 8) or 8)


def is_extended(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=bool(getattr(x, "weak_type", False)))
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, weak_type=bool(getattr(x, "weak_type", False)))
    if isinstance(x, int | float | complex) and not isinstance(x, bool):
        # a Python scalar is weakly typed under jax.jit: `x * 0.5` keeps x's dtype (bf16 stays bf16)
        return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, weak_type=True)
    try:
        arr = jax.numpy.asarray(x)
    except TypeError as e:
        raise InvalidArgumentError(
            f"Example argument {x!r} of type {type(x).__name__} is not an array. "
            "Consider passing arrays or jax.ShapeDtypeStruct leaves, and binding static "
            "arguments with functools.partial."
        ) from e
    return jax.ShapeDtypeStruct(arr.shape, arr.dtype)


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path)


def trace(fn: Callable[..., Any], args: Sequence[Any], mesh: Any = None) -> Program:
    """Trace `fn(*args)` into a Program (args may hold arrays or ShapeDtypeStructs), under
    `mesh` where given (with Auto axes: the plan's runtime mesh): `with_sharding_constraint(x,
    P(...))` needs a mesh in context, and under a user's mesh of Explicit axes jax would write
    that mesh's shardings into the equations' types and params, which the runtime's Auto mesh
    then rejects."""
    args = tuple(args)
    abstract = jax.tree_util.tree_map(_abstract, args)
    try:
        closed, out_shape = make_jaxpr_in(fn, abstract, jax.set_mesh(mesh) if mesh is not None else None)
    except ValueError as e:
        if "static argument" not in str(e).lower():
            raise
        raise InvalidArgumentError(
            f"saturate_and_extract traces every example argument as an array, and `{getattr(fn, '__name__', fn)}` is "
            f"a jax.jit function with static arguments among them ({str(e).splitlines()[0][:200]}). Consider "
            "functools.partial(fn, <static values>) as the function, or planning the function before jax.jit."
        ) from e
    leaves_with_path, in_tree = jax.tree_util.tree_flatten_with_path(abstract)
    arg_paths = [f"args{_path_str(p)}" for p, _ in leaves_with_path]
    arg_counts = [len(jax.tree_util.tree_leaves(a)) for a in abstract]
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    out_paths = [f"out{_path_str(p)}" for p, _ in out_leaves]
    builder = _Builder()
    jaxpr = closed.jaxpr
    arg_ids = [builder.new_value(v.aval, arg=i) for i, v in enumerate(jaxpr.invars)]
    const_ids = [builder.new_const(v.aval, c) for v, c in zip(jaxpr.constvars, closed.consts, strict=True)]
    env = dict(zip(jaxpr.invars, arg_ids, strict=True)) | dict(zip(jaxpr.constvars, const_ids, strict=True))
    outs = builder.inline(jaxpr, env)
    return Program(
        values=builder.values,
        equations=builder.equations,
        args=arg_ids,
        consts=builder.consts,
        const_values=builder.const_ids,
        outputs=outs,
        in_tree=in_tree,
        out_tree=out_tree,
        arg_paths=arg_paths,
        out_paths=out_paths,
        out_weak=[bool(getattr(v.aval, "weak_type", False)) for v in jaxpr.outvars],
        arg_counts=arg_counts,
        name=getattr(fn, "__name__", "fn"),
        scans=builder.scans,
        carries=builder.carries,
    )


class _Builder:
    def __init__(self) -> None:
        self.values: list[ValueInfo] = []
        self.equations: list[Equation] = []
        self.consts: list[Any] = []
        self.const_ids: list[int] = []
        self.scans: list[ScanRegion] = []
        self.carries: list[int] = []
        self.outer: Any = None  # origin of the call being inlined (see Nested)

    def origin(self, eqn: jcore.JaxprEqn) -> Any:
        return eqn.source_info if self.outer is None else Nested(eqn.source_info, self.outer)

    def new_value(self, aval: Any, **kw: Any) -> int:
        vid = len(self.values)
        if kw.get("arg") is not None:
            kw["weak_type"] = bool(getattr(aval, "weak_type", False))
        self.values.append(ValueInfo(vid, tuple(map(int, aval.shape)), aval.dtype, **kw))
        return vid

    def new_const(self, aval: Any, value: Any) -> int:
        vid = self.new_value(aval, const=len(self.consts))
        self.consts.append(value)
        self.const_ids.append(vid)
        return vid

    def atom(self, v: Any, env: dict[Any, int]) -> Atom:
        if isinstance(v, jcore.Literal):
            return Literal(v.val, v.aval.dtype)
        return env[v]

    def equation(self, prim: Any, params: dict[str, Any], ins: list[Atom], out_avals: list[Any], origin: Any,
                 region: int | None, effects: bool = False) -> list[int]:
        idx = len(self.equations)
        if self.outer is not None and not isinstance(origin, Nested | str):
            origin = Nested(origin, self.outer)
        outs = [self.new_value(a, producer=idx, output_index=k, region=region) for k, a in enumerate(out_avals)]
        self.equations.append(Equation(idx, prim, params, tuple(ins), tuple(outs), origin, region, effects=effects))
        return outs

    def region(self, kind: str, length: int, parent: int | None, eqn: jcore.JaxprEqn, **params: Any) -> ScanRegion:
        """A new region nested in `parent`, run `length` times per run of its parent."""
        parent_mult = 1 if parent is None else self.scans[parent].multiplicity
        reg = ScanRegion(index=len(self.scans), length=length, reverse=False, parent=parent,
                         multiplicity=length * parent_mult, init=[], carry_in=[], carry_out=[], final=[],
                         xs=[], slices=[], ys=[], stacked=[], params=params, kind=kind)
        reg.params["effects"] = bool(eqn.effects)
        self.scans.append(reg)
        return reg

    def _outer(self, a: Atom, aval: Any) -> Atom:
        """An operand passed into a region: literals become constants (they cross a boundary)."""
        return self._materialize_literal(a, aval) if isinstance(a, Literal) else a

    def _body_out(self, o: Atom, aval: Any) -> Atom:
        """A region's result: a literal becomes a constant value the region returns."""
        return self.new_const(aval, np.asarray(o.value, dtype=o.dtype)) if isinstance(o, Literal) else o

    def cond(self, eqn: jcore.JaxprEqn, ins: list[Atom], env: dict[Any, int], region: int | None) -> bool:
        """`lax.cond` / `lax.switch`: each branch a region reading the operands in place; the k-th
        results of all branches meet in one COND_MERGE equation. A cond with effects and no
        results stays one opaque equation."""
        if eqn.effects and not eqn.outvars:
            return False
        index, ops = ins[0], ins[1:]
        regs = []
        for b, closed in enumerate(eqn.params["branches"]):
            reg = self.region("branch", 1, region, eqn, branch=b)
            inner = {v: self.new_const(v.aval, c) for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)}
            for v, a in zip(closed.jaxpr.invars, ops, strict=True):
                inner[v] = a if isinstance(a, int) or not np.shape(a.value) else self._outer(a, v.aval)
            with self.nested(eqn):
                outs = self.inline(closed.jaxpr, inner, reg.index)
            reg.outs = [self._body_out(o, ov.aval) for o, ov in zip(outs, closed.jaxpr.outvars, strict=True)]
            regs.append(reg)
        for k, ov in enumerate(eqn.outvars):
            (env[ov],) = self.equation(COND_MERGE, {"cond": tuple(r.index for r in regs)},
                                       [index, *(r.outs[k] for r in regs)], [ov.aval], eqn.source_info, region)
        return True

    def while_(self, eqn: jcore.JaxprEqn, ins: list[Atom], env: dict[Any, int], region: int | None) -> bool:
        """`lax.while_loop`: the body planned once like a scan's (carries tied, weighted by an
        estimate of the trip count), the predicate in a sibling region over the same carries."""
        p = eqn.params
        cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
        cond_j, body_j = p["cond_jaxpr"], p["body_jaxpr"]
        trips = _trip_estimate(cond_j.jaxpr, body_j.jaxpr, ins, cn, bn)
        reg = self.region("while", trips, region, eqn)
        inner = {v: self.new_const(v.aval, c) for v, c in zip(body_j.jaxpr.constvars, body_j.consts, strict=True)}
        for v, a in zip(body_j.jaxpr.invars[:bn], ins[cn:cn + bn], strict=True):
            inner[v] = self._outer(a, v.aval)
        for k, (v, a) in enumerate(zip(body_j.jaxpr.invars[bn:], ins[cn + bn:], strict=True)):
            reg.init.append(self._outer(a, v.aval))
            vid = self.new_value(v.aval, region=reg.index, carry=(reg.index, k))
            reg.carry_in.append(vid)
            self.carries.append(vid)
            inner[v] = vid
        with self.nested(eqn):
            outs = self.inline(body_j.jaxpr, inner, reg.index)
        creg = self.region("while_cond", trips + 1, region, eqn, loop=reg.index)
        reg.cond_region = creg.index
        cinner = {v: self.new_const(v.aval, c) for v, c in zip(cond_j.jaxpr.constvars, cond_j.consts, strict=True)}
        for v, a in zip(cond_j.jaxpr.invars[:cn], ins[:cn], strict=True):
            cinner[v] = self._outer(a, v.aval)
        cinner.update(zip(cond_j.jaxpr.invars[cn:], reg.carry_in, strict=True))
        with self.nested(eqn):
            (pred,) = self.inline(cond_j.jaxpr, cinner, creg.index)
        reg.pred = pred
        for k, (o, ov) in enumerate(zip(outs, eqn.outvars, strict=True)):
            reg.carry_out.append(self._body_out(o, body_j.jaxpr.outvars[k].aval))
            (fin,) = self.equation(SCAN_FINAL, {"scan": reg.index}, [reg.carry_out[-1]], [ov.aval],
                                   eqn.source_info, region)
            reg.final.append(fin)
            env[ov] = fin
        return True

    def scan(self, eqn: jcore.JaxprEqn, ins: list[Atom], env: dict[Any, int], region: int | None) -> bool:
        p = eqn.params
        body: jcore.ClosedJaxpr = p["jaxpr"]
        nc, ncar = int(p["num_consts"]), int(p["num_carry"])
        s = len(self.scans)
        parent_mult = 1 if region is None else self.scans[region].multiplicity
        source = eqn.source_info
        reg = ScanRegion(index=s, length=int(p["length"]), reverse=bool(p["reverse"]), parent=region,
                         multiplicity=int(p["length"]) * parent_mult, init=[], carry_in=[], carry_out=[], final=[],
                         xs=[], slices=[], ys=[], stacked=[],
                         params={k: v for k, v in p.items() if k in ("length", "reverse", "unroll")})
        reg.params["effects"] = bool(eqn.effects)
        self.scans.append(reg)
        inner: dict[Any, int] = {}
        for v, c in zip(body.jaxpr.constvars, body.consts, strict=True):
            inner[v] = self.new_const(v.aval, c)
        bvars = body.jaxpr.invars
        for v, a in zip(bvars[:nc], ins[:nc], strict=True):
            inner[v] = self._materialize_literal(a, v.aval) if isinstance(a, Literal) else a
        for k, (v, a) in enumerate(zip(bvars[nc:nc + ncar], ins[nc:nc + ncar], strict=True)):
            reg.init.append(self._materialize_literal(a, v.aval) if isinstance(a, Literal) else a)
            vid = self.new_value(v.aval, region=s, carry=(s, k))
            reg.carry_in.append(vid)
            self.carries.append(vid)
            inner[v] = vid
        for v, a in zip(bvars[nc + ncar:], ins[nc + ncar:], strict=True):
            x = self._materialize_literal(a, eqn.invars[bvars.index(v)].aval) if isinstance(a, Literal) else a
            reg.xs.append(x)
            (vid,) = self.equation(SCAN_SLICE, {"scan": s}, [x], [v.aval], source, s)
            reg.slices.append(vid)
            inner[v] = vid
        with self.nested(eqn):
            outs = self.inline(body.jaxpr, inner, s)
        for k, o in enumerate(outs[:ncar]):
            if isinstance(o, Literal):
                o = self.new_const(body.jaxpr.outvars[k].aval, np.asarray(o.value, dtype=o.dtype))
            reg.carry_out.append(o)
            (fin,) = self.equation(SCAN_FINAL, {"scan": s}, [o], [eqn.outvars[k].aval], source, region)
            reg.final.append(fin)
            env[eqn.outvars[k]] = fin
        for y, ov in zip(outs[ncar:], eqn.outvars[ncar:], strict=True):
            if isinstance(y, Literal):
                y = self.new_const(body.jaxpr.outvars[ncar + len(reg.ys)].aval, np.asarray(y.value, dtype=y.dtype))
            reg.ys.append(y)
            (st,) = self.equation(SCAN_STACK, {"scan": s}, [y], [ov.aval], source, region)
            reg.stacked.append(st)
            env[ov] = st
        return True

    def inline(self, jaxpr: jcore.Jaxpr, env: dict[Any, int], region: int | None = None) -> list[Atom]:
        for eqn in jaxpr.eqns:
            self._inline_eqn(eqn, env, region)
        return [self.atom(v, env) for v in jaxpr.outvars]

    @contextlib.contextmanager
    def nested(self, eqn: jcore.JaxprEqn) -> Iterator[None]:
        """Inline the body of `eqn`: its equations' origins fall back to `eqn`'s (see Nested)."""
        saved, self.outer = self.outer, self.origin(eqn)
        try:
            yield
        finally:
            self.outer = saved

    def _inline_eqn(self, eqn: jcore.JaxprEqn, env: dict[Any, int], region: int | None) -> None:
        """One equation: a region (scan, cond, while), a call's body inlined, or itself."""
        ins = [self.atom(v, env) for v in eqn.invars]
        handler = {"scan": self.scan, "cond": self.cond, "while": self.while_}.get(eqn.primitive.name)
        if handler is not None and handler(eqn, ins, env, region):
            return
        body = _call_body(eqn, ins)
        if body is not None:
            inner, consts, operands = body
            inner_env: dict[Any, int] = {}
            for v, c in zip(inner.constvars, consts, strict=True):
                inner_env[v] = self.new_const(v.aval, c)
            for v, a in zip(inner.invars, operands, strict=True):
                if isinstance(a, Literal) and np.shape(a.value):
                    a = self._materialize_literal(a, v.aval)
                inner_env[v] = a  # a scalar literal stays one: `jnp.pad`'s pad value, say
            with self.nested(eqn):
                outs = self.inline(inner, inner_env, region)
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = self._materialize_literal(o, v.aval) if isinstance(o, Literal) else o
            return
        if self._zero_size(eqn, ins, env, region):
            return
        folded = _fold_literal(eqn, ins)
        if folded is not None:
            env[eqn.outvars[0]] = folded
            return
        out_ids = self.equation(eqn.primitive, dict(eqn.params), ins, [v.aval for v in eqn.outvars],
                                eqn.source_info, region, effects=bool(eqn.effects))
        for v, o in zip(eqn.outvars, out_ids, strict=True):
            env[v] = o

    def _zero_size(self, eqn: jcore.JaxprEqn, ins: list[Atom], env: dict[Any, int], region: int | None) -> bool:
        """A concatenate leaves out its operands with no elements (lax.associative_scan's last
        level joins an empty piece to each level): else it is replicated by rule
        (rules/apply.signature_for), its other operands with it, an all-gather of a level of a
        batch-split scan. (A result with no elements is left as it is: as a constant, its
        operand stays split in the scan, and the memory estimate of the plan that follows,
        tests/test_memory_xla.py's selective scan, reads 0.825 of XLA's figure.)"""
        if eqn.effects or eqn.primitive.name != "concatenate":
            return False
        keep = [a for a, v in zip(ins, eqn.invars, strict=True) if not _no_elements(v.aval)]
        if not keep or len(keep) == len(ins):
            return False
        out = self.equation(eqn.primitive, dict(eqn.params), keep, [v.aval for v in eqn.outvars],
                            eqn.source_info, region)
        env[eqn.outvars[0]] = out[0]
        return True

    def _materialize_literal(self, lit: Literal, aval: Any) -> int:
        """A literal that crosses a call boundary becomes a constant value."""
        return self.new_const(aval, np.asarray(lit.value, dtype=lit.dtype))


def _no_elements(aval: Any) -> bool:
    """A plain array (not a PRNG key, not float0) with a dimension of size 0."""
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or 0 not in shape or dtype is None or is_extended(dtype):
        return False
    return np.dtype(dtype) != np.dtype(jax.dtypes.float0)


def _fold_literal(eqn: jcore.JaxprEqn, ins: list[Atom]) -> Literal | None:
    """A dtype conversion of a scalar literal, done now: a literal is known to be a constant
    (a pad value of zero keeps `pad` linear), an equation's result is not."""
    if eqn.primitive.name != "convert_element_type" or not isinstance(ins[0], Literal) or np.shape(ins[0].value):
        return None
    dtype = eqn.outvars[0].aval.dtype
    if is_extended(dtype) or is_extended(ins[0].dtype):
        return None
    return Literal(np.asarray(ins[0].value).astype(dtype), dtype)


def _call_body(eqn: jcore.JaxprEqn, ins: list[Atom]) -> tuple[jcore.Jaxpr, list[Any], list[Atom]] | None:
    """The body a call's value is, its closed-over constants, and the operands it reads: a
    call's last operands; `custom_linear_solve`'s solve body (its forward value, as jax's
    impl computes it) reads the solve's slice of the constants and the right-hand side."""
    if eqn.primitive.name == "custom_linear_solve":
        lengths = list(eqn.params["const_lengths"])  # matvec, vecmat, solve, transpose_solve
        start = sum(lengths[:2])
        solve = eqn.params["jaxprs"].solve
        operands = ins[start : start + lengths[2]] + ins[sum(lengths):]
        return solve.jaxpr, list(solve.consts), operands
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    for name in _BODY_PARAMS:
        body = eqn.params.get(name)
        if isinstance(body, jcore.ClosedJaxpr):
            return body.jaxpr, list(body.consts), ins[len(ins) - len(body.jaxpr.invars):]
        if isinstance(body, jcore.Jaxpr):
            return body, [], ins[len(ins) - len(body.invars):]
    return None


def _trip_estimate(cond: jcore.Jaxpr, body: jcore.Jaxpr, ins: list[Atom], cn: int, bn: int) -> int:
    """Iterations of a while loop of the form `i < n` with `i` counting up by one from a literal
    and `n` a literal (or a carry the body passes through unchanged, fed a literal); 1 where the
    count is not known when tracing (the body is then priced as running once)."""
    init = ins[cn + bn:]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt" or cond.outvars[0] is not cond.eqns[0].outvars[0]:
        return 1
    carries = cond.invars[cn:]

    def known(v: Any) -> float | None:
        if isinstance(v, jcore.Literal):
            return float(v.val)
        if v in carries:
            k = carries.index(v)
            passes = body.outvars[k] is body.invars[bn + k]
            if passes and isinstance(init[k], Literal):
                return float(init[k].value)
        return None

    i, n = cond.eqns[0].invars
    if i not in carries or known(n) is None:
        return 1
    k = carries.index(i)
    step = [e for e in body.eqns if body.outvars[k] in e.outvars]
    if not isinstance(init[k], Literal) or len(step) != 1 or step[0].primitive.name != "add":
        return 1
    a, b = step[0].invars
    if not (a is body.invars[bn + k] and isinstance(b, jcore.Literal) and float(b.val) == 1.0):
        return 1
    return max(1, int(np.ceil(known(n) - float(init[k].value))))  # type: ignore[operator]
