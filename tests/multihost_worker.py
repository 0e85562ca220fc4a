"""One process of tests/test_multihost.py's two-process job (started by examples/multihost.py's
launch()): the example's training step, then what the example does not show. Each process writes
what it saw to OUT/process{I}.json; process 0 also writes the arrays to compare.

* multihost="share": process 0 plans, process 1 loads its plan;
* processes given different pins: a ShardsatError in both, not a hang in mismatched collectives;
* a process whose planning fails (a bad option there only): its error there, a ShardsatError naming
  it in the other;
* a step with lax.scan and lax.cond on a mesh of Explicit axes, run under jax.set_mesh.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import multihost as ex  # examples/multihost.py


def control_flow_step(state: Any, x: Any) -> Any:
    """Stacked layers run by lax.scan, a data-dependent lax.cond, SGD on (weights, bias)."""
    import jax
    import jax.numpy as jnp

    def loss(state: Any) -> Any:
        w, b = state

        def layer(h: Any, wi: Any) -> Any:
            return jnp.tanh(h @ wi), None

        h, _ = jax.lax.scan(layer, x, w)
        h = jax.lax.cond(h.sum() > 0, lambda h: h * 2.0, lambda h: h - 1.0, h)
        return jnp.mean((h + b) ** 2)

    value, grads = jax.value_and_grad(loss)(state)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, state, grads), value


def control_flow_data() -> tuple[Any, Any]:
    rng = np.random.default_rng(7)
    state = ((rng.standard_normal((3, 16, 16)) / 4).astype(np.float32), np.zeros(16, np.float32))
    return state, rng.standard_normal((8, 16)).astype(np.float32)


def _error(fn: Callable[[], Any]) -> str | None:
    import shardsat

    try:
        fn()
    except shardsat.ShardsatError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _control_flow(mesh: Any, out: Path) -> str:
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh

    import shardsat
    from shardsat.runtime.record import decisions, digest

    explicit = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * 2)
    state, x = control_flow_data()
    plan = shardsat.saturate_and_extract(control_flow_step, explicit, state, x, state_argnums=(0,))
    args = jax.tree_util.tree_map(lambda v, s: jax.make_array_from_callback(v.shape, s, lambda idx: v[idx]),
                                  (state, x), plan.in_shardings)
    with jax.set_mesh(explicit):
        new_state, value = plan.jit()(*args)
    w, b = (multihost_utils.process_allgather(a, tiled=True) for a in new_state)
    value = multihost_utils.process_allgather(value, tiled=True)
    if jax.process_index() == 0:
        np.savez(out / "control_flow.npz", w=w, b=b, value=value)
    return digest(decisions(plan))


def scenarios(mesh: Any, out: Path, plan: Any) -> dict[str, Any]:
    import jax
    from jax.sharding import PartitionSpec as P

    import shardsat
    from shardsat.runtime.record import decisions, digest

    me = jax.process_index()
    step, _, _, (a_state, a_batch) = ex.model_and_data("mlp")
    by_rows = jax.tree_util.tree_map(lambda _: P("data"), a_batch)
    res: dict[str, Any] = {"check": digest(decisions(plan))}
    shared = shardsat.saturate_and_extract(step, mesh, a_state, a_batch, state_argnums=(0,),
                                           in_shardings=(None, by_rows), multihost="share")
    res["share"] = digest(decisions(shared))
    res["share_loaded_from"] = shared.report.loaded_from
    spec = P("data") if me == 0 else P("model")  # the processes disagree on the batch's layout
    res["diverge"] = _error(lambda: shardsat.saturate_and_extract(
        step, mesh, a_state, a_batch, in_shardings=(None, jax.tree_util.tree_map(lambda _: spec, a_batch))))
    res["fail"] = _error(lambda: shardsat.saturate_and_extract(
        step, mesh, a_state, a_batch, extraction="greedy" if me == 0 else "bogus"))
    res["control_flow"] = _control_flow(mesh, out)
    return res


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    for flag, kind in (("--worker", int), ("--port", int), ("--out", Path), ("--model", str), ("--multihost", str)):
        ap.add_argument(flag, type=kind)
    ns = ap.parse_args()
    mesh = ex.join(ns.worker, ns.port)
    plan = ex.train(mesh, ns.out, ns.model, ns.multihost)
    res = scenarios(mesh, ns.out, plan)
    (ns.out / f"process{ns.worker}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
