"""The learned prior over layouts (priors="builtin" or a weights file): its features, its
weights' format, deterministic training, and plans narrowed by it that compute the same."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_equivalent
from test_narrow import mlp_step  # the 3-layer MLP AdamW step narrowing is tested on

import shardsat
import shardsat.api as api
from shardsat.egraph.layout import MeshAxes, SpaceTable, auto_mesh
from shardsat.egraph.program import trace
from shardsat.extract import prior
from shardsat.extract.families import family_layouts
from shardsat.extract.prior_features import FEATURES, pair_features
from shardsat.extract.profile import get_profile
from shardsat.learn import labels
from shardsat.learn.corpus import case
from shardsat.learn.train import evaluate, train
from shardsat.pins import resolve_ties
from shardsat.rules.apply import build_tables


@pytest.fixture(scope="module")
def mesh222():
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"))


@pytest.fixture(scope="module")
def examples(mesh222):
    """Two small corpus programs labelled by the full search on 2x2x2 (all layouts kept)."""
    out = [labels.label(case("mlp", s), mesh222, get_profile("h100"), negatives=None) for s in (3, 7)]
    return [e for e in out if e is not None]


def test_features_describe_layouts_relative_to_the_value(mesh222):
    """Every value with a choice gets one row per layout; replicated (its space's first) splits
    nothing, and a data-parallel batch splits the batch dimension over the whole mesh."""
    step, state, x = mlp_step()
    program = trace(step, (state, x), auto_mesh(mesh222))
    spaces = SpaceTable(MeshAxes.from_mesh(mesh222))
    ties = resolve_ties(program, (0,), program.name)
    pairs = pair_features(program, spaces, tables := build_tables(program, spaces, "replicate", edges=False),
                          ties, 2000.0)
    assert pairs.context.shape[1] + pairs.rows[0].shape[1] == FEATURES
    assert all(len(r) == len(lids) for r, lids in zip(pairs.rows, pairs.layouts, strict=True))
    xid = program.args[-1]
    i = pairs.values.index(xid)
    rows = pairs.rows[i]
    assert rows[0, 0] == 0.0 and rows[0, 13] == 1.0  # replicated: no split, flagged as such
    full = [j for j, lid in enumerate(pairs.layouts[i]) if spaces.layouts[lid].dims == ((0, 1, 2), ())]
    assert full and rows[full[0], 0] == pytest.approx(1.0) and rows[full[0], 2] == pytest.approx(1.0)  # batch kind
    assert tables is not None


def test_training_is_deterministic_and_learns_the_examples(examples):
    a = train(examples, steps=60)
    b = train(examples, steps=60)
    for (wa, ba), (wb, bb) in zip(a.layers, b.layers, strict=True):
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_array_equal(ba, bb)
    before = train(examples, steps=1)
    s0 = [evaluate(before, e, 0.99, 4).top1 for e in examples]
    s1 = [evaluate(a, e, 0.99, 4).top1 for e in examples]
    assert sum(s1) > sum(s0)  # the chosen layouts rank higher after training than at the start


def test_weights_save_and_load_in_the_shipped_format(examples, tmp_path):
    w = train(examples, steps=2, about="test")
    path = w.save(tmp_path / "w.npz")
    back = prior.PriorWeights.load(path)
    assert back.about == "test"
    for (wa, ba), (wb, bb) in zip(w.layers, back.layers, strict=True):
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_array_equal(ba, bb)
    shipped = prior.builtin()
    assert shipped.layers[0][0].shape[0] == FEATURES == back.layers[0][0].shape[0]
    assert [layer[0].shape[1:] for layer in shipped.layers][-1] == (1,)
    (tmp_path / "bad.npz").write_bytes(b"not a prior")
    with pytest.raises(shardsat.InvalidArgumentError, match="priors"):
        prior.PriorWeights.load(tmp_path / "bad.npz")


def test_the_builtin_prior_plans_a_training_step_that_computes_the_same(mesh222):
    step, state, x = mlp_step()
    plan = shardsat.saturate_and_extract(step, mesh222, state, x, state_argnums=(0,), priors="builtin")
    assert plan.report.narrowed > 0
    assert_equivalent(plan, step, state, x, rtol=1e-4)
    for (a, o) in plan.ties:  # the state keeps one layout in and out
        assert plan.costed.assignment.arg_layouts[a] == plan.extraction.root_layouts[o]


def test_a_learned_prior_keeps_every_familys_argument_layouts(mesh222, monkeypatch):
    """The search starts from the standard families (extract/search.py): a prior that keeps
    nothing of its own still leaves each family's argument layouts in the e-graph."""
    monkeypatch.setattr(api, "learned_layouts", lambda *a, **k: {})
    step, state, x = mlp_step()
    plan = shardsat.saturate_and_extract(step, mesh222, state, x, state_argnums=(0,), priors="builtin")
    assert plan.report.narrowed > 0
    prog, spaces = plan.program, plan.spaces
    for name, layouts in family_layouts(prog, spaces, plan.ties, plan.tables):
        for pos, lay in layouts.items():
            v = prog.values[prog.args[pos]]
            assert spaces.layouts.intern(lay) in spaces.of_value(prog.args[pos], v.shape, v.dtype).layouts, name
    assert_equivalent(plan, step, state, x, rtol=1e-4)


def test_a_weights_file_is_a_prior_and_its_digest_keys_the_cache(mesh222, examples, tmp_path):
    step, state, x = mlp_step()
    one = train(examples, steps=60).save(tmp_path / "one.npz")  # sure enough to leave layouts out
    two = train(examples, steps=3).save(tmp_path / "two.npz")
    assert prior.fingerprint(str(one)) != prior.fingerprint(str(two))
    plan = shardsat.saturate_and_extract(step, mesh222, state, x, state_argnums=(0,), priors=one)
    assert plan.report.narrowed > 0
    assert_equivalent(plan, step, state, x, rtol=1e-4)
    with pytest.raises(shardsat.InvalidArgumentError, match="priors"):
        shardsat.saturate_and_extract(step, mesh222, state, x, priors=tmp_path / "missing.npz")


def test_priors_train_writes_weights_the_planner_reads(examples, tmp_path, monkeypatch):
    """`python -m shardsat priors train --examples F --out W` on examples already labelled."""
    import os

    from shardsat.cli import main

    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):  # the command asks for host devices: restored after
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.delenv(var, raising=False)

    labels.save(examples, tmp_path / "ex.npz")
    assert [e.name for e in labels.load(tmp_path / "ex.npz")] == [e.name for e in examples]
    assert main(["priors", "train", "--examples", str(tmp_path / "ex.npz"), "--out", str(tmp_path / "w.npz")]) == 0
    w = prior.PriorWeights.load(tmp_path / "w.npz")
    assert "2 examples" in w.about
    assert evaluate(w, examples[0], 0.999, 8).recall > 0.9


def test_a_program_with_prng_keys_is_narrowed_by_the_learned_prior(mesh222):
    """Regression (fuzz seeds 39, 50 with priors="builtin"): a key<fry> value has no numpy dtype;
    the features read its size as the planner does (egraph/program.itemsize)."""
    def f(key, x):
        keys = jax.random.split(key, 8)
        noise = jax.vmap(lambda k: jax.random.normal(k, (64,)))(keys)
        return jnp.tanh(x @ x.T) + noise.sum()

    key, x = jax.random.key(0), jax.random.normal(jax.random.PRNGKey(1), (64, 64))
    plan = shardsat.saturate_and_extract(f, mesh222, key, x, priors="builtin")
    assert_equivalent(plan, f, key, x, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 1000])
def test_blocked_products_equal_one_product(rows):
    """Scoring multiplies in blocks of rows (one BLAS thread each: waking OpenBLAS's threads for
    every small product made scoring a 4-axis GPT step 25x slower on a busy machine): the same
    product to float32 rounding, and the same bits on every call. (Bit-equal to one product on
    some CPUs only: on an AMD EPYC box OpenBLAS sums 1,000 rows in another order, 7.6e-6 apart.)"""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 58)).astype(np.float32)
    for w in (rng.standard_normal((58, 64)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)):
        got = prior._matmul(x, w)
        assert np.array_equal(got, prior._matmul(x, w))
        assert np.allclose(got, x @ w, rtol=1e-5, atol=1e-5 * float(np.abs(x @ w).max()))
        x = np.maximum(got, 0.0)
