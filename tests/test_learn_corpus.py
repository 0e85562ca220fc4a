"""The learned prior's corpus (shardsat/learn/corpus.py): deterministic, runnable, and small."""

import jax
import numpy as np
import pytest

from shardsat.learn.corpus import FAMILIES, case, corpus, example_inputs

MAX_EQUATIONS = 400  # keeps planning one case to seconds


def _shapes(c):
    return [(leaf.shape, str(leaf.dtype)) for leaf in jax.tree.leaves(c.args)]


def test_corpus_is_distinct_covering_and_deterministic():
    first, second = corpus(16), corpus(16)
    names = [c.name for c in first]
    assert len(first) == 16 and len(set(names)) == 16
    assert {c.family for c in first} == set(FAMILIES)
    assert names == [c.name for c in second]
    assert [_shapes(c) for c in first] == [_shapes(c) for c in second]
    assert [c.int_bounds for c in first] == [c.int_bounds for c in second]


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match="resnet"):
        case("resnet", 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_case_runs_and_is_finite(family):
    c = case(family, 3)
    args = example_inputs(c)
    out = jax.jit(c.fn)(*args)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(out))
    if c.state_argnums is not None:  # a training step: the state comes back with the same structure
        state, loss = out
        assert np.shape(loss) == ()
        in_state = jax.tree.structure(c.args[0])
        assert jax.tree.structure(state) == in_state
        assert [x.shape for x in jax.tree.leaves(state)] == [x.shape for x in jax.tree.leaves(c.args[0])]


def test_example_inputs_respect_int_bounds():
    for c in corpus(8, seed=2):
        bounds = dict(c.int_bounds)
        flat = jax.tree_util.tree_flatten_with_path(example_inputs(c, seed=1))[0]
        for path, leaf in flat:
            if np.issubdtype(leaf.dtype, np.integer):
                assert int(leaf.min()) >= 0 and int(leaf.max()) < bounds[jax.tree_util.keystr(path)]


@pytest.mark.parametrize("seed", [0, 1])
def test_cases_are_small(seed):
    for c in corpus(len(FAMILIES) * 2, seed=seed):
        jaxpr = jax.make_jaxpr(c.fn)(*c.args)
        assert len(jaxpr.jaxpr.eqns) <= MAX_EQUATIONS, c.name
        for leaf in jax.tree.leaves(c.args):
            assert np.prod(leaf.shape) * leaf.dtype.itemsize <= 4 * 2**20, c.name
