"""A user's `with_sharding_constraint` naming a mesh other than the plan's, or a sharding no
layout of the plan is.

jax.jit runs such a function: on the constraint's own devices, or, where they are the plan's
devices in another arrangement (other axis names or shape), as a pin of the devices each shard
is on. Where a layout of the plan's mesh puts the same shards on the same devices, the plan
keeps the constraint as that layout. Otherwise (other devices, or an arrangement no layout
matches) no plan can keep it: it is dropped (the value is placed freely; values are the same,
a constraint only places them) and the plan says so (ConstraintWarning, report, explain()).
So is a constraint that splits a PRNG key array (plans keep key arrays replicated), and one on
the plan's mesh that no layout is: axes listed out of the mesh's order (another device order) or
a split that does not divide (jit pads the last shard).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .layout import MeshAxes, constrained_spec, enumerate_layouts, spec_to_layout
from .program import Program, is_extended

CONSTRAINT = "sharding_constraint"


def adopt_constraints(prog: Program, mesh: Mesh) -> list[str]:
    """Rewrite, in place, each constraint on another mesh as the equivalent one on `mesh` (the
    plan's runtime mesh, Auto axes), or drop it (its sharding param set to None). Returns one
    line per dropped constraint, saying where it is and why."""
    dropped = []
    for eqn in prog.equations:
        sharding = eqn.params.get("sharding") if eqn.name == CONSTRAINT else None
        if sharding is None:
            continue
        why = _unkept(sharding, prog.values[eqn.outputs[0]], eqn.params.get("unconstrained_dims"), mesh)
        if isinstance(why, NamedSharding):
            eqn.params = {**eqn.params, "sharding": why}
        elif why is not None:
            eqn.params = {**eqn.params, "sharding": None}
            dropped.append(f"with_sharding_constraint at {eqn.source}: {why}")
    return dropped


def _unkept(sharding: Any, value: Any, free: Any, mesh: Mesh) -> str | NamedSharding | None:
    """None where the plan keeps the constraint as it is; its equivalent on `mesh` where that
    is another sharding; else why no plan keeps it."""
    if is_extended(value.dtype) and _splits(sharding):
        return (f"spec {getattr(sharding, 'spec', sharding)} on a PRNG key array: plans keep key arrays replicated "
                "(the keys are the same either way); not kept")
    shape = tuple(value.shape)
    if isinstance(sharding, NamedSharding) and not _same_mesh(sharding.mesh, mesh):
        spec = _equivalent_spec(sharding, shape, mesh)
        if spec is not None:
            return NamedSharding(mesh, spec)
        return (f"{_describe(sharding)}: no layout of shape {shape} on the plan's mesh puts the same shards on the "
                "same devices; not kept, the value is placed freely")
    spec = getattr(sharding, "spec", sharding)
    if not isinstance(spec, PartitionSpec):
        return None
    # jax.jit runs what no layout of the plan is: axes out of the mesh's order (another device
    # order), or a split that does not divide (jit pads the last shard)
    lay, why = spec_to_layout(constrained_spec(spec, len(shape), free), shape, MeshAxes.from_mesh(mesh))
    if lay is not None or len(spec) > len(shape):
        return None  # a spec longer than the rank: jax refuses it at trace time
    return f"spec {spec} on shape {shape}: {why}; no layout of the plan is that sharding; not kept, the value is placed freely"


def _splits(sharding: Any) -> bool:
    """Does the sharding (a NamedSharding or a bare spec) split anything?"""
    spec = getattr(sharding, "spec", sharding)
    return isinstance(spec, PartitionSpec) and any(e is not None for e in spec)


def _same_mesh(a: Any, b: Mesh) -> bool:
    if not isinstance(a, Mesh):
        return True  # an abstract mesh: the context mesh's axes, which the plan resolves by name
    return tuple(a.axis_names) == tuple(b.axis_names) and np.array_equal(_ids(a), _ids(b))


def _ids(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)


def _equivalent_spec(sharding: NamedSharding, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec | None:
    """The spec of the first layout the plan's value can take (egraph/layout.py, fewest axes
    first) that puts the same shards on the same devices as `sharding`."""
    if sorted(_ids(sharding.mesh).ravel()) != sorted(_ids(mesh).ravel()):
        return None
    axes = MeshAxes.from_mesh(mesh)
    for lay in enumerate_layouts(shape, np.float32, axes):
        spec = lay.spec(axes)
        if not lay.partial and sharding.is_equivalent_to(NamedSharding(mesh, spec), len(shape)):
            return spec
    return None


def _describe(sharding: NamedSharding) -> str:
    axes = ", ".join(f"{n}={k}" for n, k in sharding.mesh.shape.items())
    ids = _ids(sharding.mesh).ravel().tolist()
    return f"its mesh ({axes}) on devices {ids}, spec {sharding.spec}"


__all__ = ["adopt_constraints"]
