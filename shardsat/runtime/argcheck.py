"""plan.jit()'s arguments against the ones the plan was made for.

A plan holds for fixed shapes and dtypes: its layouts were chosen for them, and the runtime
replays the planned program's equations, whose shape parameters (a mean's divisor, a reshape's
sizes) were fixed by tracing. Arguments of another shape would run that program anyway and return
wrong numbers, so they are refused, naming the argument, as jax.jit's in_shardings checks do.

What jax.jit itself treats as the same program is accepted: a numpy float64 array where float32
was planned (jit canonicalises it), a Python scalar where a 0-d array of its dtype was planned.
Weak types (Python scalars) change a program only through type promotion; where a weak/strong
difference would make jax.jit trace a different program, the call is refused too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from ..egraph.program import make_jaxpr_in
from ..errors import InvalidArgumentError

_SCALARS = (bool, int, float, complex)


def _canonical(dtype: Any) -> Any:
    try:
        return jax.dtypes.canonicalize_dtype(dtype)
    except Exception:  # extended dtypes (PRNG keys) and the like: compared as they are
        return dtype


def _type_of(x: Any) -> tuple[tuple[int, ...], Any] | None:
    """(shape, dtype) jax.jit would see for a leaf, or None for what it does not take (it says why)."""
    if isinstance(x, _SCALARS):
        return (), _canonical(jnp.result_type(x))
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return None
    return tuple(shape), _canonical(dtype)


def weak_flags(leaves: list[Any]) -> tuple[bool, ...]:
    """Which leaves are weakly typed (Python scalars, weak jax values and ShapeDtypeStructs)."""
    return tuple(isinstance(x, _SCALARS) or bool(getattr(x, "weak_type", False)) for x in leaves)


def _fmt(shape: tuple[int, ...], dtype: Any) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


@dataclass(frozen=True)
class PlannedArgs:
    """The arguments a plan was made for: structure, and per flat leaf its path, shape and dtype."""

    name: str
    tree: Any
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    weak: tuple[bool, ...] = ()  # planned weakly typed (from a Python scalar example)

    def _refuse(self, lines: list[str], why: str, fix: str = "") -> InvalidArgumentError:
        return InvalidArgumentError(
            f"plan.jit() of `{self.name}` was called with arguments the plan was not made for:\n"
            + "\n".join(f"  * {line}" for line in lines)
            + f"\n{why} Consider {fix}planning again for these arguments: "
            "shardsat.saturate_and_extract(fn, mesh, *args)."
        )

    def check(self, leaves: list[Any], tree: Any) -> None:
        """Structure, shapes and dtypes: raises the mismatch, if any."""
        err = self.mismatch(leaves, tree)
        if err is not None:
            raise err

    def mismatch(self, leaves: list[Any], tree: Any) -> InvalidArgumentError | None:
        """The error naming every argument that is not as planned, or None."""
        if tree != self.tree:
            return self._refuse([f"structure {tree}, planned {self.tree}"],
                                "A plan holds for the pytree structure it was made for.")
        bad = []
        for k, x in enumerate(leaves):
            if getattr(x, "shape", None) == self.shapes[k] and getattr(x, "dtype", None) == self.dtypes[k]:
                continue  # the common case, without canonicalising
            got = _type_of(x)
            if got is None or got == (self.shapes[k], _canonical(self.dtypes[k])):
                continue  # jax.jit reports what it cannot take
            what = f" (a Python {type(x).__name__})" if isinstance(x, _SCALARS) else ""
            bad.append(f"{self.paths[k]}: got {_fmt(*got)}{what}, planned {_fmt(self.shapes[k], self.dtypes[k])}")
        if bad:
            return self._refuse(bad, "A plan's layouts, collectives and the shapes inside its program (a mean's "
                                     "divisor, a reshape's sizes) hold only for the planned shapes and dtypes.")
        return None

    def check_weak(self, fn: Any, leaves: list[Any], mesh: Any = None) -> None:
        """At trace time: leaves weakly typed where the plan's are strong (or the other way) are
        accepted only if jax.jit traces `fn` to the same program with them (promotion may differ).
        `fn` is traced under `mesh` where no mesh is in context, as the plan traced it: a
        with_sharding_constraint(x, P(...)) in `fn` needs one."""
        given = weak_flags([jax.typeof(x) for x in leaves])
        planned = self.weak or (False,) * len(given)
        if given == planned:
            return

        def program(flags: tuple[bool, ...]) -> tuple[Any, ...]:
            structs = [jax.ShapeDtypeStruct(s, d, weak_type=f)
                       for s, d, f in zip(self.shapes, self.dtypes, flags, strict=True)]
            bare = mesh is not None and jax.sharding.get_abstract_mesh().empty
            context = jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if bare else None
            traced, _ = make_jaxpr_in(fn, jax.tree_util.tree_unflatten(self.tree, structs), context)
            return program_key(traced.jaxpr)

        if program(given) == program(planned):
            return
        kind = {True: "weakly typed", False: "strongly typed"}
        lines = [f"{self.paths[k]}: {kind[g]} {_fmt(self.shapes[k], self.dtypes[k])}, planned {kind[p]} (a Python "
                 "scalar is weakly typed, an array strongly)" for k, (g, p) in enumerate(zip(given, planned, strict=True))
                 if g != p]
        raise self._refuse(lines, "With these weak types jax.jit traces a different program (type promotion "
                                  "differs), so the plan's program would not compute what fn does.",
                           "passing the arguments as arrays (jnp.asarray(x, dtype)) as planned, or ")


def program_key(jaxpr: Any) -> tuple[Any, ...]:
    """A jaxpr's equations with weak types left out: converts that only drop a weak type are
    skipped, variables are numbered by first definition. Equal keys: the same computation."""
    ids: dict[Any, Any] = {}
    count = itertools.count()

    def ref(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return ("lit", repr(v.val), str(v.aval.dtype))
        if v not in ids:
            ids[v] = next(count)
        return ids[v]

    def param(x: Any) -> Any:
        inner = getattr(x, "jaxpr", x)
        if isinstance(inner, jcore.Jaxpr):
            return program_key(inner)
        if isinstance(x, tuple | list):
            return tuple(param(y) for y in x)
        return repr(x)

    for v in jaxpr.invars:
        ref(v)
    out: list[Any] = []
    for e in jaxpr.eqns:
        if (e.primitive.name == "convert_element_type" and not isinstance(e.invars[0], jcore.Literal)
                and e.invars[0].aval.dtype == e.params["new_dtype"]):
            ids[e.outvars[0]] = ref(e.invars[0])  # only the weak type changes
            continue
        out.append((e.primitive.name, tuple((k, param(x)) for k, x in sorted(e.params.items())),
                    tuple(ref(v) for v in e.invars),
                    tuple((ref(v), tuple(v.aval.shape), str(v.aval.dtype)) for v in e.outvars)))
    out.append(tuple(ref(v) for v in jaxpr.outvars))
    return tuple(out)


def planned_args(program: Any) -> PlannedArgs:
    """The PlannedArgs of a traced program (a Python scalar example is traced weakly typed)."""
    values = [program.values[v] for v in program.args]
    return PlannedArgs(program.name, program.in_tree, tuple(program.arg_paths),
                       tuple(tuple(v.shape) for v in values), tuple(v.dtype for v in values),
                       tuple(v.weak_type for v in values))

