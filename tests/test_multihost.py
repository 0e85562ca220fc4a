"""Many hosts: two processes x 4 CPU devices, joined by jax.distributed (gloo collectives on
127.0.0.1), plan and run training steps on one 2x4 mesh whose `data` axis crosses the processes.

One job (tests/multihost_worker.py, started by examples/multihost.py's launcher) runs every case;
the tests compare what it wrote with this process, where 8 simulated devices stand in for both
hosts: the same step run in one process, and the same plan made in one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardsat
from shardsat.runtime.record import decisions, digest
from shardsat.testing import check_plan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import multihost as ex  # noqa: E402  (examples/multihost.py)
import multihost_worker as worker  # noqa: E402


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("hosts")
    ex.launch(out, model="mlp", script=Path(worker.__file__), timeout=300)
    return out, [json.loads((out / f"process{i}.json").read_text()) for i in range(ex.PROCESSES)]


def _mlp() -> tuple[Any, Any, Any, Any, Any]:
    step, state, batches, (a_state, a_batch) = ex.model_and_data("mlp")
    by_rows = jax.tree_util.tree_map(lambda _: P("data"), a_batch)
    return step, state, batches, (a_state, a_batch), by_rows


def test_training_step_equals_the_single_process_step(job: Any) -> None:
    out, _ = job
    ex.compare(out, "mlp")  # loss and every parameter after two steps


def test_every_process_plans_what_one_process_plans(job: Any) -> None:
    """The plans of both processes (planned by each, and shared by process 0) are the plan this
    process makes for the same mesh shape: planning does not depend on the process."""
    _, res = job
    step, _, _, (a_state, a_batch), by_rows = _mlp()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    here = shardsat.saturate_and_extract(step, mesh, a_state, a_batch, state_argnums=(0,),
                                         in_shardings=(None, by_rows))
    want = digest(decisions(here))
    assert [r["check"] for r in res] == [want, want]
    assert [r["share"] for r in res] == [want, want]
    assert res[0]["share_loaded_from"] is None and res[1]["share_loaded_from"] == "process 0's plan"


def test_the_jobs_saved_plan_runs_in_one_process(job: Any) -> None:
    out, _ = job
    step, state, batches, (a_state, a_batch), _ = _mlp()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = shardsat.load_plan(out / "plan.json", step, mesh, a_state, a_batch)
    assert plan.report.loaded_from == str(out / "plan.json")
    check_plan(plan, state, batches[0], reference=step)


def test_processes_that_plan_differently_raise_instead_of_hanging(job: Any) -> None:
    _, res = job
    for r in res:
        assert r["diverge"] is not None and "planned differently" in r["diverge"], r["diverge"]
        assert "multihost='share'" in r["diverge"]


def test_a_process_that_fails_to_plan_fails_the_others(job: Any) -> None:
    _, res = job
    assert "extraction must be" in res[1]["fail"]  # its own error
    assert "Planning failed in process(es) [1]" in res[0]["fail"]


def test_scan_and_cond_on_explicit_axes_across_processes(job: Any) -> None:
    out, res = job
    state, x = worker.control_flow_data()
    want_state, want_value = jax.jit(worker.control_flow_step)(state, x)
    got = np.load(out / "control_flow.npz")
    np.testing.assert_allclose(got["value"], want_value, rtol=1e-5)
    np.testing.assert_allclose(got["w"], want_state[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["b"], want_state[1], rtol=1e-4, atol=1e-6)
    assert res[0]["control_flow"] == res[1]["control_flow"]
