"""Saved plans: plan.save / shardsat.load_plan round trips (the loaded plan runs, costs and explains
itself as the planned one), the mismatches it refuses (each named), and cache_dir=."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardsat
from shardsat.runtime.record import decisions, digest
from shardsat.testing import check_plan


def mesh24(kind: AxisType = AxisType.Auto) -> Any:
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))


def train_step(state: Any, batch: Any) -> Any:
    """SGD with momentum on a two-layer model; state ({"layers": [...]}, (count, momentum))."""
    params, (count, mom) = state

    def loss(p: Any) -> Any:
        h = jnp.tanh(batch["x"] @ p["layers"][0]["w"] + p["layers"][0]["b"])
        return jnp.mean((h @ p["layers"][1]["w"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    mom = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, mom, grads)
    params = jax.tree_util.tree_map(lambda p, m: p - 0.01 * m, params, mom)
    return (params, (count + 1, mom)), {"loss": value}


def train_args() -> tuple[Any, Any]:
    k = jax.random.split(jax.random.key(0), 4)
    params = {"layers": [{"w": jax.random.normal(k[0], (32, 64)) / 6, "b": jnp.zeros(64)},
                         {"w": jax.random.normal(k[1], (64, 16)) / 8}]}
    state = (params, (jnp.zeros((), jnp.int32), jax.tree_util.tree_map(jnp.zeros_like, params)))
    return state, {"x": jax.random.normal(k[2], (16, 32)), "y": jax.random.normal(k[3], (16, 16))}


def control_flow(params: Any, x: Any) -> Any:
    """Unrolled identical layers (folded), a scan, a cond and a while loop."""
    for w in params["layers"]:
        x = jnp.tanh(x @ w)

    def body(h: Any, w: Any) -> Any:
        return jnp.tanh(h @ w), h.sum()

    x, ys = lax.scan(body, x, params["stack"])
    x = lax.cond(x.sum() > 0, lambda x: x * 2.0, lambda x: x - 1.0, x)
    x = lax.fori_loop(0, 3, lambda i, x: x * 0.5 + jnp.sin(x), x)
    return x, ys


def control_flow_args() -> tuple[Any, Any]:
    k = jax.random.split(jax.random.key(1), 3)
    params = {"layers": [jax.random.normal(jax.random.fold_in(k[0], i), (32, 32)) / 6 for i in range(4)],
              "stack": jax.random.normal(k[1], (3, 32, 32)) / 6}
    return params, jax.random.normal(k[2], (16, 32))


def pins_of(plan: shardsat.Plan) -> dict[int, set[str]]:
    """Argument pins as PartitionSpecs (layout ids are a plan's own numbering)."""
    return {pos: {plan.layouts[lid].describe(plan.axes) for lid in lids} for pos, lids in plan.arg_pins.items()}


def assert_same_plan(loaded: shardsat.Plan, plan: shardsat.Plan, path: Path) -> None:
    assert loaded.report.loaded_from == str(path)
    assert digest(decisions(loaded)) == digest(decisions(plan))
    assert loaded.in_shardings == plan.in_shardings and loaded.out_shardings == plan.out_shardings
    assert loaded.cost.total_s == plan.cost.total_s and loaded.cost.collectives == plan.cost.collectives
    assert loaded.cost.memory == plan.cost.memory and loaded.state_argnums == plan.state_argnums
    assert loaded.profile == plan.profile and loaded.weight_updates() == plan.weight_updates()
    assert loaded.explain().split("\nSearch")[0] == plan.explain().split("\nSearch")[0]
    assert "loaded from" in loaded.explain()


def test_training_step_round_trip_on_explicit_axes(tmp_path: Path) -> None:
    """State (a dict of a list, a tuple), a pinned batch, a mesh of Explicit axes (Auto ones are
    round-tripped by the cache_dir test)."""
    state, batch = train_args()
    pins = (None, {"x": P("data"), "y": None})
    mesh = mesh24(AxisType.Explicit)
    plan = shardsat.saturate_and_extract(train_step, mesh, state, batch, state_argnums=(0,), in_shardings=pins,
                                         profile="h100")
    path = plan.save(tmp_path / "plan.json")
    loaded = shardsat.load_plan(path, train_step, mesh, state, batch)
    assert_same_plan(loaded, plan, path)
    assert pins_of(loaded) == pins_of(plan) == {7: {"P('data',)"}} and loaded.ties == plan.ties
    check_plan(loaded, state, batch, reference=train_step)


def test_folded_scan_cond_while_round_trip(tmp_path: Path) -> None:
    params, x = control_flow_args()
    plan = shardsat.saturate_and_extract(control_flow, mesh24(), params, x, fold_loops=True)
    assert any(r.folded for r in plan.program.scans)
    path = plan.save(tmp_path / "cf.json")
    loaded = shardsat.load_plan(path, control_flow, mesh24(), params, x)
    assert_same_plan(loaded, plan, path)
    assert "folded loop" in loaded.explain()
    check_plan(loaded, params, x, reference=control_flow)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def f(w: Any, x: Any) -> Any:
        return jnp.tanh(x @ w["a"]) @ w["b"]

    path = tmp_path_factory.mktemp("saved") / "f.json"
    plan = shardsat.saturate_and_extract(f, mesh24(), {"a": S((64, 128)), "b": S((128, 32))}, S((16, 64)))
    plan.save(path)
    return path


def S(shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def f_again(w: Any, x: Any) -> Any:
    return jnp.tanh(x @ w["a"]) @ w["b"]


def f_relu(w: Any, x: Any) -> Any:
    return jax.nn.relu(x @ w["a"]) @ w["b"]


W = {"a": S((64, 128)), "b": S((128, 32))}
MISMATCHES = {
    "shape": (f_again, mesh24, (W, S((8, 64))), "args[1]: planned float32[16,64], given float32[8,64]"),
    "dtype": (f_again, mesh24, ({"a": S((64, 128), jnp.bfloat16), "b": W["b"]}, S((16, 64))),
              "args[0]['a']: planned float32[64,128], given bfloat16[64,128]"),
    "structure": (f_again, mesh24, ({"a": W["a"], "b": W["b"], "c": S((2,))}, S((16, 64))),
                  "args[0]['c']: given float32[2], not planned"),
    "mesh sizes": (f_again, lambda: jax.make_mesh((4, 2), ("data", "model")), (W, S((16, 64))), "axis sizes differ"),
    "mesh names": (f_again, lambda: jax.make_mesh((2, 4), ("x", "y")), (W, S((16, 64))), "axis names differ"),
    "program": (f_relu, mesh24, (W, S((16, 64))), "the first equation that differs is #1, `max` at"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatch_is_named(case: str, saved: Path) -> None:
    fn, mesh, args, expect = MISMATCHES[case]
    with pytest.raises(shardsat.SavedPlanMismatch) as err:
        shardsat.load_plan(saved, fn, mesh(), *args)
    assert expect in str(err.value) and "Consider" in str(err.value), str(err.value)


def test_the_function_itself_loads(saved: Path) -> None:
    plan = shardsat.load_plan(saved, f_again, mesh24(), W, S((16, 64)))  # another function object, same program
    k = jax.random.split(jax.random.key(3), 3)
    w = {"a": jax.random.normal(k[0], (64, 128)), "b": jax.random.normal(k[1], (128, 32))}
    check_plan(plan, w, jax.random.normal(k[2], (16, 64)), reference=f_again)


def test_unreadable_and_foreign_files_are_refused(saved: Path, tmp_path: Path) -> None:
    args = (f_again, mesh24(), W, S((16, 64)))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(shardsat.SavedPlanMismatch, match="not valid JSON"):
        shardsat.load_plan(tmp_path / "junk.json", *args)
    old = json.loads(saved.read_text())
    old["format"] = 1
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(shardsat.SavedPlanMismatch, match="format 1"):
        shardsat.load_plan(tmp_path / "old.json", *args)
    edited = json.loads(saved.read_text())
    local = next(c for c in edited["record"]["choices"] if c[1] == 1)  # a local op's strategy index
    local[3] += 1000
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(shardsat.ShardsatError, match="strategy"):
        shardsat.load_plan(tmp_path / "edited.json", *args)
    with pytest.raises(shardsat.InvalidArgumentError, match="Cannot read saved plan"):
        shardsat.load_plan(tmp_path / "missing.json", *args)


def test_rewrites_must_be_given_again(tmp_path: Path) -> None:
    reassociate = shardsat.Rewrite("matmul-reassociate", lambda a, b, c: a @ (b @ c), lambda a, b, c: (a @ b) @ c,
                                   example_args=(S((2, 3)), S((3, 4)), S((4, 5))))

    def low_rank(x: Any, u: Any, v: Any) -> Any:
        return jnp.tanh(x @ (u @ v))

    args = (S((256, 64)), S((64, 8)), S((8, 64)))
    plan = shardsat.saturate_and_extract(low_rank, mesh24(), *args, rules=[reassociate])
    path = plan.save(tmp_path / "rw.json")
    with pytest.raises(shardsat.SavedPlanMismatch, match=r"rewrite rules \['matmul-reassociate'\]"):
        shardsat.load_plan(path, low_rank, mesh24(), *args)
    loaded = shardsat.load_plan(path, low_rank, mesh24(), *args, rules=[reassociate])
    assert digest(decisions(loaded)) == digest(decisions(plan))
    k = jax.random.split(jax.random.key(4), 3)
    values = [jax.random.normal(kk, a.shape) for kk, a in zip(k, args, strict=True)]
    check_plan(loaded, *values, reference=low_rank, rtol=1e-4)  # reassociated products round differently


def test_cache_dir_saves_then_loads(tmp_path: Path) -> None:
    state, batch = train_args()
    kw: dict[str, Any] = {"state_argnums": (0,), "cache_dir": tmp_path / "plans"}
    first = shardsat.saturate_and_extract(train_step, mesh24(), state, batch, **kw)
    (path,) = (tmp_path / "plans").glob("*.json")
    assert first.report.loaded_from is None and path.name.startswith("train_step-")
    again = shardsat.saturate_and_extract(train_step, mesh24(), state, batch, **kw)
    assert_same_plan(again, first, path)
    check_plan(again, state, batch, reference=train_step)
    other = shardsat.saturate_and_extract(train_step, mesh24(), state, batch, profile="h100", **kw)
    assert other.report.loaded_from is None and len(list((tmp_path / "plans").glob("*.json"))) == 2
    path.write_text("{}")  # a damaged file is planned again (with a warning) and rewritten
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        replanned = shardsat.saturate_and_extract(train_step, mesh24(), state, batch, **kw)
    assert replanned.report.loaded_from is None and any("does not load" in str(w.message) for w in seen)
    assert shardsat.saturate_and_extract(train_step, mesh24(), state, batch, **kw).report.loaded_from == str(path)


def test_bad_cache_and_multihost_options_are_named(tmp_path: Path) -> None:
    with pytest.raises(shardsat.InvalidArgumentError, match="cache_dir must be"):
        shardsat.saturate_and_extract(jnp.sin, mesh24(), S((8,)), cache_dir=3)
    (tmp_path / "f").write_text("")  # a file where the folder would be: was FileExistsError on saving
    with pytest.raises(shardsat.InvalidArgumentError, match="is a file, not a folder"):
        shardsat.saturate_and_extract(jnp.sin, mesh24(), S((8,)), cache_dir=tmp_path / "f")
    with pytest.raises(shardsat.InvalidArgumentError, match="multihost must be one of"):
        shardsat.saturate_and_extract(jnp.sin, mesh24(), S((8,)), multihost="each")


def test_examples_are_checked_before_tracing(saved: Path) -> None:
    # a wrong pytree failed inside the user's function (TypeError from `@` on a tuple); none or
    # a string as example raised Python's TypeError from the call
    with pytest.raises(shardsat.SavedPlanMismatch, match=r"another structure(.|\n)*args\[0\]\['a'\]: planned, not given"):
        shardsat.load_plan(saved, f_again, mesh24(), (W["a"], W["b"]), S((16, 64)))
    with pytest.raises(shardsat.InvalidArgumentError, match="cannot be called with the 0 example"):
        shardsat.load_plan(saved, f_again, mesh24())
    with pytest.raises(shardsat.InvalidArgumentError, match=r"args\[1\] is str"):
        shardsat.load_plan(saved, f_again, mesh24(), W, "x")


def test_save_to_a_folder_or_a_missing_one_is_refused(saved: Path, tmp_path: Path) -> None:
    plan = shardsat.load_plan(saved, f_again, mesh24(), W, S((16, 64)))
    for bad in (tmp_path, tmp_path / "no" / "such" / "p.json"):
        with pytest.raises(shardsat.InvalidArgumentError, match="Cannot write the plan"):
            plan.save(bad)
    assert not list(tmp_path.glob(".*.tmp"))  # no half-written file left behind
    assert plan.save(tmp_path / "p.json").is_file()



def test_cache_dir_keys_each_egglog_ruleset_by_its_name(tmp_path: Path) -> None:
    """Regression: every egglog ruleset was keyed "ruleset:Ruleset", so a plan made with one was
    loaded for another (a helper's rule-author hunt: a no-op ruleset's plan returned for one
    that makes resharding free, a cheaper plan)."""
    from egglog import ruleset

    def f(x, w1, w2):
        return jnp.tanh(x @ w1) @ w2

    args = (jnp.ones((64, 32)), jnp.ones((32, 128)) / 32, jnp.ones((128, 32)) / 128)
    plans = [shardsat.saturate_and_extract(f, mesh24(), *args, rules=[ruleset(name=name)], cache_dir=tmp_path)
             for name in ("rules_a", "rules_b", "rules_a")]
    assert [p.report.loaded_from is not None for p in plans] == [False, False, True]
    check_plan(plans[2], *args)


def test_load_plan_refuses_a_struct_pinned_otherwise(tmp_path):
    """Regression (a helper's API hunt): load_plan took a ShapeDtypeStruct pinned to P(None,
    'model') and returned the saved plan's P('data') layout for it, silently; cache_dir planned
    again. The same pin, or a struct without one, still loads."""
    from jax.sharding import NamedSharding

    mesh = mesh24()
    S = jax.ShapeDtypeStruct
    g = lambda a, b: jnp.sin(a) @ b  # noqa: E731
    b = S((32, 8), jnp.float32)
    pinned = lambda *spec: S((16, 32), jnp.float32, sharding=NamedSharding(mesh, P(*spec)))  # noqa: E731
    path = shardsat.saturate_and_extract(g, mesh, pinned("data"), b).save(tmp_path / "g.json")
    assert shardsat.load_plan(path, g, mesh, pinned("data"), b).in_shardings[0].spec == P("data")
    assert shardsat.load_plan(path, g, mesh, S((16, 32), jnp.float32), b).in_shardings[0].spec == P("data")
    with pytest.raises(shardsat.SavedPlanMismatch, match=r"places args\[0\] as P\('data',\).*pinned to P\(None, 'model'\)"):
        shardsat.load_plan(path, g, mesh, pinned(None, "model"), b)
