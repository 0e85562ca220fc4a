"""Measured device profiles and hybrid meshes: `python -m shardsat calibrate` (its mechanics: the
numbers of simulated CPU devices only prove them), saved profiles accepted wherever a profile is,
the alpha-beta fit, and plans that put the heavy communication on the fast mesh axis."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardsat
from shardsat.runtime.calibrate import KINDS, fit, moved_bytes
from shardsat.testing import check_collectives, check_plan

ROOT = Path(__file__).resolve().parents[1]
S = jax.ShapeDtypeStruct


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m shardsat calibrate` on a 2x4 mesh of simulated CPU devices (--quick: seconds)."""
    out = tmp_path_factory.mktemp("calibrate") / "profile.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "shardsat", "calibrate", "--mesh", "data=2,model=4", "--out", str(out),
                           "--devices", "cpu", "--quick"], env=env, text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "axis data: link" in proc.stdout and "axis model: link" in proc.stdout and f"wrote {out}" in proc.stdout
    return out


def _positive(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_calibrate_measures_every_rate_and_axis(calibrated: Path) -> None:
    prof = shardsat.DeviceProfile.load(calibrated)
    assert prof.name == "calibrated-cpu"
    assert _positive(prof.flops_per_s) and _positive(prof.hbm_bytes_per_s)
    for axis in ("data", "model"):
        assert _positive(prof.link(axis)) and math.isfinite(prof.latency(axis)) and prof.latency(axis) >= 0
    m = prof.measurements
    assert m is not None and set(m["matmul_flops_per_s"]) == {"float32", "bfloat16"}
    assert prof.flops_per_s == max(m["matmul_flops_per_s"].values())
    for axis in ("data", "model"):
        fits = m["collectives"][axis]
        assert set(fits) == {*KINDS, "all"}
        assert all(_positive(f["link_bytes_per_s"]) and f["latency_s"] >= 0 for f in fits.values())
        assert prof.link(axis) == fits["all"]["link_bytes_per_s"]
    assert json.loads(calibrated.read_text())["format"] == "shardsat.DeviceProfile/1"


def test_saved_profile_is_accepted_wherever_a_profile_is(calibrated: Path, tmp_path: Path) -> None:
    prof = shardsat.DeviceProfile.load(calibrated)
    assert shardsat.DeviceProfile.load(prof.save(tmp_path / "again.json")) == prof

    def f(w: Any, x: Any) -> Any:
        return jnp.tanh(x @ w)

    w, x = jnp.ones((64, 32)), jnp.ones((16, 64))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    for given in (str(calibrated), calibrated):
        plan = shardsat.saturate_and_extract(f, mesh, w, x, profile=given)
        assert plan.profile == prof
    check_plan(plan, w, x, reference=f)
    with pytest.raises(shardsat.InvalidArgumentError, match=r"Cannot read device profile .*Consider"):
        shardsat.saturate_and_extract(f, mesh, w, x, profile=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(shardsat.InvalidArgumentError, match=r"not a saved shardsat\.DeviceProfile"):
        shardsat.DeviceProfile.load(tmp_path / "bad.json")


def test_fit_recovers_latency_and_bandwidth() -> None:
    pts = [(b, 5e-6 + b / 2e9) for b in (1e3, 1e5, 1e7)]
    got = fit(pts)
    assert got["latency_s"] == pytest.approx(5e-6, rel=1e-6) and got["link_bytes_per_s"] == pytest.approx(2e9)
    # noise below zero latency: through the origin; a falling line: the largest point's rate
    assert fit([(1e3, 0.0), (1e6, 1e-3)])["latency_s"] == 0.0
    falling = fit([(1e3, 2e-3), (1e6, 1e-3)])
    assert falling["link_bytes_per_s"] == pytest.approx(1e9) and falling["latency_s"] > 0
    assert moved_bytes("all-gather", 4, 100.0) == 300.0  # the gathered buffer, as extract/cost.py counts it
    assert moved_bytes("all-reduce", 4, 100.0) == 150.0 and moved_bytes("reduce-scatter", 4, 100.0) == 75.0


# -- hybrid meshes: `data` across hosts (slow), `model` inside one (fast) ----------------------------
def mlp_step(params: Any, x: Any) -> Any:
    def loss(p: Any) -> Any:
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), value


def bytes_per_axis(plan: shardsat.Plan) -> dict[str, float]:
    """Bytes each device sends per step over each mesh axis (a collective over both counts on both)."""
    out = {"data": 0.0, "model": 0.0}
    for c in plan.cost.collectives:
        for a in c.axes:
            out[a] += c.moved_bytes * c.count
    return out


@pytest.mark.parametrize("batch", [512, 64], ids=["data-parallel regime", "tensor-parallel regime"])
def test_heavy_communication_goes_over_the_fast_axis(batch: int) -> None:
    """The same training step under swapped link speeds: the slow axis carries less, and each
    axis carries less when it is the slow one."""
    params = {"w1": jax.random.normal(jax.random.key(0), (256, 1024)) / 16,
              "w2": jax.random.normal(jax.random.key(1), (1024, 256)) / 32}
    x = jax.random.normal(jax.random.key(2), (batch, 256))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    moved = {}
    for slow in ("data", "model"):
        fast = "model" if slow == "data" else "data"
        prof = shardsat.DeviceProfile(1e14, 2e12, {slow: 5e9, fast: 100e9}, {slow: 2e-5, fast: 2e-6},
                                      name=f"{slow} across hosts")
        plan = shardsat.saturate_and_extract(mlp_step, mesh, params, x, profile=prof, state_argnums=(0,))
        moved[slow] = bytes_per_axis(plan)
        assert moved[slow][slow] < moved[slow][fast], (slow, moved[slow], plan.explain())
        check_plan(plan, params, x, reference=mlp_step)
    assert moved["data"]["data"] < moved["model"]["data"] and moved["model"]["model"] < moved["data"]["model"]
    assert np.isfinite(list(moved["data"].values())).all()


def _gather_step(ws: list[jax.Array]) -> list[jax.Array]:
    return [w * 2 for w in ws]


def test_independent_gathers_pay_a_latency_each_where_xla_does_not_combine_them() -> None:
    """Six weights stored split, each returned whole: XLA:CPU has no all-gather combiner (six
    all-gathers compile to six), XLA:GPU's merges them under one latency. The cost model prices
    each as the mesh's platform compiles it, unless the profile names another's combiners."""
    mesh = jax.make_mesh((8,), ("data",))
    ws = [jax.random.normal(jax.random.key(i), (64, 32 + i)) for i in range(6)]
    split, whole = [jax.sharding.PartitionSpec("data")] * 6, [jax.sharding.PartitionSpec()] * 6
    prof = shardsat.DeviceProfile(1e14, 2e12, 1e11, 1e-5, name="slow latency")
    seconds = {}
    for combining in (None, "gpu"):
        plan = shardsat.saturate_and_extract(_gather_step, mesh, ws, in_shardings=(split,), out_shardings=whole,
                                             profile=dataclasses.replace(prof, combining=combining))
        gathers = [c for c in plan.cost.collectives if c.kind == "all-gather"]
        assert len(gathers) == 6, plan.explain()
        seconds[combining] = [c.seconds for c in gathers]
        check_plan(plan, ws, reference=_gather_step)
        check_collectives(plan, ws)  # six all-gathers in the compiled HLO
    assert all(s >= 1e-5 for s in seconds[None]), seconds  # a whole latency each, on CPU
    assert all(s < 1e-5 / 4 for s in seconds["gpu"]), seconds  # one shared latency
