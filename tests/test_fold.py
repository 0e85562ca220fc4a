"""Unrolled loops folded into scans: found, planned once, and still computing the same thing."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_equivalent

import shardsat
from shardsat.egraph.fold import find_runs, fold
from shardsat.egraph.program import trace
from shardsat.testing import check_collectives


def mlp(p, x):
    for w1, w2 in p:
        x = x + jnp.tanh(x @ w1) @ w2
    return x


def step(p, x):
    loss, g = jax.value_and_grad(lambda p, x: jnp.mean(mlp(p, x) ** 2))(p, x)
    return loss, jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)


def params(n, seed=0):
    k = jax.random.split(jax.random.key(seed), 2 * n + 1)
    p = [(jax.random.normal(k[2 * i], (64, 256)) * 0.1, jax.random.normal(k[2 * i + 1], (256, 64)) * 0.1)
         for i in range(n)]
    return p, jax.random.normal(k[-1], (32, 64))


def test_tandem_repeats_are_found():
    runs = find_runs(list("xyABCABCABCz"))
    assert [(r.start, r.period, r.repeats) for r in runs] == [(2, 3, 3)]


@pytest.mark.parametrize("n", [3, 6])
def test_folded_program_size_does_not_grow(n):
    p, x = params(n)
    folded = fold(trace(step, (p, x)))
    small = fold(trace(step, params(3)))
    assert folded.scans and len(folded.equations) == len(small.equations)
    assert max(s.length for s in folded.scans) == n


@pytest.mark.parametrize("fn", [mlp, step])
def test_folded_plans_match_unsharded(fn):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    p, x = params(4)
    plan = shardsat.saturate_and_extract(fn, mesh, p, x, profile="h100", fold_loops=True)
    assert plan.program.scans
    # every layer's weights take one layout
    specs = {str(s.spec) for s in jax.tree_util.tree_leaves(plan.in_shardings[0])[0::2]}
    assert len(specs) == 1
    assert_equivalent(plan, fn, p, x)


def test_folded_training_step_keeps_leaves_apart():
    # Optimizer updates of same-shaped leaves (a layer norm's scale and bias) fold into one body
    # whose inputs alias for their layout: their values must still be computed apart.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

    cfg = GPTConfig(layers=4, d_model=64, heads=4, mlp=256, vocab=128, seq=16, batch=8, embed="onehot")
    opt, train = make_gpt_step(cfg, eps=1e-4)  # see test_training: keeps the comparison about shardsat
    params = gpt_params(cfg, jax.random.key(0))
    state = (params, opt.init(params))
    batch = gpt_batch(cfg, jax.random.key(1))
    mesh = jax.make_mesh((8,), ("data",))
    plan = shardsat.saturate_and_extract(train, mesh, state, batch, profile="h100", state_argnums=(0,),
                                         fold_loops=True)
    assert len(plan.program.scans) > 2
    assert_equivalent(plan, train, state, batch)
    # every repeat a folded loop replays reads its inputs in the body's layouts: the compiled HLO
    # holds exactly the collectives the plan predicts (layer 0's backward differs, and the
    # optimizer's layer-0 update runs unfolded rather than reading its gradient off the model)
    check_collectives(plan, state, batch)


def test_folded_memory_and_weight_roles_match_the_unfolded_program():
    # each layer's arrays count once per layer (not once per body), and every layer's weights
    # keep their role (a layer's bias feeds the next layer's matmul through the loop carry)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

    cfg = GPTConfig(layers=4, d_model=64, heads=4, mlp=256, vocab=128, seq=16, batch=8, embed="onehot")
    opt, train = make_gpt_step(cfg, eps=1e-4)
    params = gpt_params(cfg, abstract=True)
    state = (params, jax.eval_shape(opt.init, params))
    mesh = jax.make_mesh((8,), ("data",))
    plans = [shardsat.saturate_and_extract(train, mesh, state, gpt_batch(cfg, abstract=True), profile="h100",
                                           state_argnums=(0,), fold_loops=fold) for fold in (False, True)]
    (m0, w0), (m1, w1) = [(p.cost.memory, p.weight_updates()) for p in plans]
    assert plans[1].program.scans and not plans[0].program.scans
    assert (m1.parameters, m1.optimizer_state) == (m0.parameters, m0.optimizer_state)
    assert m1.gradients == m0.gradients
    assert set(w1) == set(w0)
    assert abs(m1.activations_peak - m0.activations_peak) <= 0.25 * m0.activations_peak
    # a repeat's value no folded equation makes names its body value's producer, not an index
    # into the unfolded program (fuzz seed 269: the memory model read a stale one and crashed)
    prog = plans[1].program
    for v in prog.values:
        if v.producer is not None:
            assert prog.alias(v.id) in {prog.alias(o) for o in prog.equations[v.producer].outputs}, v


def test_loop_invariant_work_in_a_folded_loop_runs_once():
    # tanh(shared) * 2 is the same array in every layer: unrolled, its equations hash-cons into
    # one value; folded, it is priced and run once (its all-gather too), not once per layer
    def net(ws, shared, x):
        for w in ws:
            s = jnp.tanh(shared) * 2.0
            x = x + jnp.tanh(x @ w) @ s
        return x.sum()

    k = jax.random.split(jax.random.key(3), 8)
    ws = [jax.random.normal(k[i], (256, 1024)) / 16 for i in range(6)]
    shared = jax.random.normal(k[6], (1024, 256)) / 32
    x = jax.random.normal(k[7], (64, 256))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = shardsat.saturate_and_extract(net, mesh, ws, shared, x, profile="h100", fold_loops=True,
                                         in_shardings=(None, jax.sharding.PartitionSpec("model", None), None))
    (scan,) = plan.program.scans
    names = sorted({plan.program.equations[plan.program.values[v].producer].name for v in scan.invariant})
    assert names == ["mul", "tanh"]
    gathers = [c for c in plan.cost.collectives if c.kind == "all-gather" and "mul" in c.value]
    assert [c.count for c in gathers] == [1]  # the shared weight, stored split, is gathered once
    assert_equivalent(plan, net, ws, shared, x)
    check_collectives(plan, ws, shared, x)


def test_loops_fold_two_layers_per_body_so_layouts_may_alternate(monkeypatch):
    # Layers of one matmul: the unrolled optimum alternates column- and row-split weights
    # (Megatron's pairs: one all-reduce per two layers). A body of one layer cannot alternate;
    # a body of two can, and folding pairs layers wherever a loop is long enough.
    def net(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    k = jax.random.split(jax.random.key(5), 9)
    ws = [jax.random.normal(k[i], (4096, 4096)) / 64 for i in range(8)]
    x = jax.random.normal(k[8], (4, 4096))  # a batch of 4 does not split 8 ways
    mesh = jax.make_mesh((8,), ("model",))
    plan = shardsat.saturate_and_extract(net, mesh, ws, x, profile="h100", fold_loops=True)
    assert [s.length for s in plan.program.scans] == [4]
    specs = [str(s.spec) for s in plan.in_shardings[0]]
    assert len(set(specs[0::2])) == len(set(specs[1::2])) == 1 and specs[0] != specs[1]
    assert_equivalent(plan, net, ws, x)
    check_collectives(plan, ws, x)
    import shardsat.egraph.fold as fold_module

    monkeypatch.setattr(fold_module, "PAIR_REPEATS", len(ws) + 1)  # one layer per body
    single = shardsat.saturate_and_extract(net, mesh, ws, x, profile="h100", fold_loops=True)
    assert [s.length for s in single.program.scans] == [8]
    assert plan.cost.total_s < 0.8 * single.cost.total_s


def test_layers_differing_in_a_scalar_fold_and_each_keeps_its_own():
    # per-layer dropout folds its key with the layer index: a literal that differs per layer.
    # Layouts do not depend on it, so the layers are repeats; the replay gives each its own.
    def net(ws, x, key):
        for i, w in enumerate(ws):
            x = x + jnp.tanh(x @ w) * 0.5
            x = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, x.shape), x / 0.9, 0.0)
        return jnp.mean(x ** 2)

    def train(ws, x, key):
        loss, g = jax.value_and_grad(net)(ws, x, key)
        return loss, [w - 0.1 * gw for w, gw in zip(ws, g, strict=True)]

    k = jax.random.split(jax.random.key(0), 9)
    ws = [jax.random.normal(k[i], (128, 128)) / 12 for i in range(8)]
    x = jax.random.normal(k[8], (64, 128))
    key = jax.random.key(1)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = shardsat.saturate_and_extract(train, mesh, ws, x, key, profile="h100", fold_loops=True,
                                         state_argnums=(0,))
    assert plan.program.scans and max(s.length for s in plan.program.scans) >= 3
    # the key's layer index is not loop-invariant: each layer's mask differs
    assert not any(plan.program.equations[plan.program.values[v].producer].name == "random_fold_in"
                   for s in plan.program.scans for v in s.invariant)
    assert_equivalent(plan, train, ws, x, key)
    check_collectives(plan, ws, x, key)


def test_named_scopes_name_the_loops_and_say_why_layers_did_not_fold():
    def net(ws, x, acts):
        for i, (w, act) in enumerate(zip(ws, acts, strict=True)):
            with jax.named_scope(f"layer{i}"):
                x = x + act(x @ w)
        return jnp.mean(x ** 2)

    k = jax.random.split(jax.random.key(2), 9)
    ws = [jax.random.normal(k[i], (128, 128)) / 12 for i in range(6)]
    x = jax.random.normal(k[8], (64, 128))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    same = shardsat.saturate_and_extract(lambda ws, x: net(ws, x, [jnp.tanh] * 6), mesh, ws, x, fold_loops=True)
    assert same.program.scans
    assert "layer{i}, i = 0..5" in same.explain()
    mixed = [jnp.tanh, jnp.sin, jnp.cos, jax.nn.relu, jnp.exp, jnp.abs]
    plan = shardsat.saturate_and_extract(lambda ws, x: net(ws, x, mixed), mesh, ws, x, fold_loops=True)
    assert not plan.program.scans
    (note,) = plan.program.notes
    assert note.startswith("layer{i}, i = 0..5: not folded") and "`tanh`" in note and "`sin`" in note
    assert note in plan.explain()


def test_programs_with_control_flow_still_fold():
    """A training step with a lax.cond in its optimizer (optax.apply_if_finite) and a lax.scan
    beside its unrolled layers: the layers fold around the regions, which keep their own plans."""
    import optax

    tx = optax.apply_if_finite(optax.sgd(0.1), 3)

    def train(p, s, x):
        def loss(p):
            h = mlp(p, x)
            h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c), None), h, None, length=2)
            return jnp.mean(h ** 2)

        g = jax.grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, x = params(6)
    s = tx.init(p)
    folded = fold(trace(train, (p, s, x)))
    assert any(r.folded for r in folded.scans) and any(r.kind == "branch" for r in folded.scans)
    assert any(r.kind == "scan" and not r.folded for r in folded.scans)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = shardsat.saturate_and_extract(train, mesh, p, s, x, fold_loops=True, state_argnums=(0, 1), strict=True)
    assert any(r.folded for r in plan.program.scans)
    assert_equivalent(plan, train, p, s, x)
