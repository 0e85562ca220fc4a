"""The memory estimate's model of XLA:CPU, mechanism by mechanism: its breadth-first schedule,
the reductions it hands to YNNPACK, size-1 reductions that are reshapes, and cross-entropy's
vocabulary-sized buffers against the compiled figure."""

import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import H100_GPU, assert_hlo_matches
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardsat
from shardsat.egraph.program import Literal, trace
from shardsat.extract import deadcode, fusion, library
from shardsat.extract.buffers import (
    Allocation,
    Temp,
    chain_copies,
    heap_peak,
    packed_heap,
    reuse_fixed,
    share_inplace,
)
from shardsat.extract.liveness import _others, bfs_order
from shardsat.testing import check_plan


def _experts(*names: str) -> list[Any]:
    """Modules of the expert benchmark (benchmarks/experts/), or attributes of them ("mlp",
    "common.make_mesh"): the memory tests plan its workloads."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    for d in (str(root), str(root / "experts")):
        if d not in sys.path:
            sys.path.insert(0, d)
    out = []
    for n in names:
        mod, _, attr = n.partition(".")
        m = importlib.import_module(mod)
        out.append(getattr(m, attr) if attr else m)
    return out


LOW, HIGH = 0.95, 1.10  # predicted / compiled, as benchmarks/memory.py accepts it


@dataclass
class Eq:
    """The part of an Equation the schedule and the fusion rules read."""

    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: dict[str, Any] = field(default_factory=dict)
    effects: bool = False

    @property
    def primitive(self) -> str:
        """The rules are found by Primitive or, as here, by name (rules/registry.rule_for)."""
        return self.name


def test_breadth_first_order_is_a_permutation_when_fused_values_ready_later_roots():
    """A fused (not scheduled) equation readies its readers at once; a root it readies that
    comes later in program order is scheduled once, and the order is breadth first: both
    independent chains start before either goes deeper (program order runs a whole chain
    first)."""
    seq = [Eq("a", (98,), (0,)), Eq("b", (0,), (1,)), Eq("c", (1,), (2,)),  # chain 1: a -> b -> c
           Eq("neg", (99,), (3,)), Eq("d", (3,), (4,)), Eq("e", (4,), (5,))]  # chain 2, from a fused root
    runs = [True, True, True, False, True, True]
    order = bfs_order(seq, runs)  # type: ignore[arg-type]
    assert sorted(id(e) for e in order) == sorted(id(e) for e in seq)
    names = [e.name for e in order]
    assert names.index("d") < names.index("b") or names.index("d") < names.index("c")
    assert names != [e.name for e in seq]


def test_breadth_first_order_places_fused_equations_inside_their_readers_kernels():
    """A fused equation is no instruction: it runs inside the kernel of its reader, so it is
    placed just before that reader, not when its operands exist (a library reduction's
    member `mul` read the relu's mask at its readiness, ending the mask's life before its
    other readers ran)."""
    seq = [Eq("a", (98,), (0,)), Eq("mul", (0,), (1,)), Eq("b", (99,), (2,)), Eq("c", (2,), (3,)),
           Eq("reduce_sum", (1, 3), (4,))]
    runs = [True, False, True, True, True]
    names = [e.name for e in bfs_order(seq, runs)]  # type: ignore[arg-type]
    assert names == ["a", "b", "c", "mul", "reduce_sum"], names


def test_breadth_first_order_lets_readers_that_recompute_a_value_skip_waiting_for_it():
    """XLA computes a cheap value again inside each loop fusion reading it, so such a reader
    waits for the value's operands only: the three products of a batch norm's backward pass
    that each compute the relu's mask again are ready together, before the library sums."""
    seq = [Eq("a", (98,), (0,)), Eq("select_n", (0,), (1,)), Eq("reduce_sum", (1,), (2,)),
           Eq("mul", (1,), (3,)), Eq("reduce_sum", (3,), (4,))]
    runs = [True] * len(seq)
    names = [e.name for e in bfs_order(seq, runs)]  # type: ignore[arg-type]
    assert names.index("mul") > names.index("reduce_sum"), names  # waits for the select
    names = [e.name for e in bfs_order(seq, runs, {(3, 1)})]  # type: ignore[arg-type]
    assert names[:3] == ["a", "select_n", "mul"], names


def test_breadth_first_order_runs_a_product_after_its_operands_copy():
    """A product XLA copies an operand of into another order waits a step for the copy (an
    instruction of its own): the weight gradient's product of a layer's backward pass runs
    after the input gradient's kernel, ready at the same time, which frees the shared
    operand first (a layer norm + gelu step on 2x4 read 1.23 of compiled otherwise)."""
    seq = [Eq("a", (98,), (0,)), Eq("dot_general", (0, 97), (1,)), Eq("reduce_sum", (0,), (2,))]
    runs = [True] * len(seq)
    names = [e.name for e in bfs_order(seq, runs)]  # type: ignore[arg-type]
    assert names == ["a", "dot_general", "reduce_sum"], names
    names = [e.name for e in bfs_order(seq, runs, set(), {(1, 0)})]  # type: ignore[arg-type]
    assert names == ["a", "reduce_sum", "dot_general"], names
    # an operand made long before: its copy ran then, and the product does not wait
    seq = [Eq("a", (98,), (0,)), Eq("b", (99,), (3,)), Eq("c", (3,), (4,)),
           Eq("dot_general", (0, 4), (1,)), Eq("reduce_sum", (4,), (2,))]
    names = [e.name for e in bfs_order(seq, [True] * len(seq), set(), {(3, 0)})]  # type: ignore[arg-type]
    assert names.index("dot_general") < names.index("reduce_sum"), names


def test_breadth_first_order_runs_what_reads_constants_alone_at_the_start():
    """XLA folds ops of constants at compile time: the scatter of `-1/n` into zeros (the
    gradient of a mean) is ready at the start, beside the first dot, not behind the chain of
    scalar ops that makes `-1/n` (the 32k-vocabulary cross-entropy step on 2x2x2 was 0.71 of
    the compiled peak with the scatter dated after the logits' resharding)."""
    seq = [Eq("dot_general", (100,), (0,)), Eq("exp", (0,), (1,)), Eq("reduce_sum", (1,), (2,)),
           Eq("neg", (), (3,)), Eq("div", (3,), (4,)), Eq("broadcast_in_dim", (4,), (5,)),
           Eq("scatter-add", (5, 2), (6,))]
    names = [e.name for e in bfs_order(seq, [True] * len(seq))]  # type: ignore[arg-type]
    assert sorted(names) == sorted(e.name for e in seq)
    assert names.index("scatter-add") > names.index("reduce_sum")  # it reads the reduction too
    seq[-1] = Eq("scatter-add", (5,), (6,))
    names = [e.name for e in bfs_order(seq, [True] * len(seq))]  # type: ignore[arg-type]
    assert names.index("scatter-add") < names.index("exp"), names
    seq[3] = Eq("neg", (101,), (3,))  # of an argument: not folded, three levels deep
    names = [e.name for e in bfs_order(seq, [True] * len(seq))]  # type: ignore[arg-type]
    assert names.index("scatter-add") > names.index("exp"), names


def test_ynn_reductions_read_a_buffer_unless_the_operand_is_a_multiply_or_a_view():
    """XLA:CPU gives a large f32 sum / max / min to YNNPACK, which reads a whole buffer; a
    multiply, a broadcast or a convert is left to XLA's own fusion; small or integer
    reductions are XLA's."""
    red = Eq("reduce_sum", (0,), (1,), {"axes": (2,)})
    big, f32 = (8, 256, 1024), np.dtype(np.float32)
    assert fusion.ynn_reduce(red, big, f32, Eq("sub", (), ()))  # type: ignore[arg-type]
    assert fusion.ynn_reduce(red, big, f32, Eq("exp", (), ()))  # type: ignore[arg-type]
    assert not fusion.ynn_reduce(red, big, f32, Eq("mul", (), ()))  # type: ignore[arg-type]
    assert fusion.ynn_reduce(red, big, f32, Eq("mul", (), ()), masks=True)  # type: ignore[arg-type]
    assert not fusion.ynn_reduce(red, big, f32, Eq("convert_element_type", (), ()))  # type: ignore[arg-type]
    assert not fusion.ynn_reduce(red, (8, 16, 16), f32, Eq("sub", (), ()))  # type: ignore[arg-type]
    assert not fusion.ynn_reduce(red, big, np.dtype(np.int32), Eq("sub", (), ()))  # type: ignore[arg-type]
    assert not fusion.ynn_reduce(Eq("argmax", (0,), (1,), {"axes": (2,)}), big, f32,  # type: ignore[arg-type]
                                 Eq("sub", (), ()))  # type: ignore[arg-type]
    assert fusion.reads_whole(red, 0, 3, library=True)  # type: ignore[arg-type]
    assert not fusion.reads_whole(red, 0, 3)  # type: ignore[arg-type]


def test_an_operand_broadcast_along_size_1_dimensions_is_no_reason_against_duplicating():
    """`y - mean(y, keepdims=True)`: the jaxpr broadcasts the mean along its size-1 dimensions
    inside the subtraction, HLO with a broadcast, so the subtraction is effectively unary and
    XLA may compute it again in each reader (InstructionFusion::ComputeGloballyUnfusible); a
    difference of two full-size values is not."""
    s = jax.ShapeDtypeStruct((8, 64, 16), jnp.float32)
    prog = trace(lambda y, z: (y - y.mean((1, 2), keepdims=True), y - z), (s, s))
    made = {o: e for e in prog.equations for o in e.outputs}
    centred, diff = (next(e for e in prog.equations if o in e.outputs) for o in prog.outputs)
    for e, want in ((centred, True), (diff, False)):
        producers = [made.get(a) for a in e.inputs if isinstance(a, int)]
        assert fusion.duplicable(e, producers, prog) is want


def test_a_reduction_of_size_1_dimensions_is_fused_like_a_reshape():
    """XLA's simplifier makes a reduction over size-1 dimensions a reshape: not a buffer."""
    red = Eq("reduce_sum", (0,), (1,), {"axes": (2,)})
    assert fusion.stored(red, [Eq("mul", (1,), (2,))], False, False)  # type: ignore[arg-type, list-item]
    assert not fusion.stored(red, [Eq("mul", (1,), (2,))], False, False, reshape=True)  # type: ignore[arg-type, list-item]


def cross_entropy_step(w, x, labels):
    """Tied-embedding style loss and its gradient: vocabulary-sized logits, softmax, the
    loss's masked sum (a select after XLA's simplifier, reduced by YNNPACK) and the logits'
    gradient read by two dots."""
    def loss(w):
        logits = x @ w.T
        logp = jax.nn.log_softmax(logits, axis=-1)
        onehot = jax.nn.one_hot(labels, w.shape[0], dtype=logits.dtype)
        return -jnp.mean(jnp.sum(logp * onehot, axis=-1))
    return jax.grad(loss)(w)


@pytest.mark.parametrize("pins", ["free", "vocab"])
def test_cross_entropy_gradient_estimate_matches_compiled(pins):
    """The vocabulary-sized buffers XLA holds at the peak (softmax's exp, the loss's masked
    logits, the logits' gradient and its transposed copy) are all counted: within the band.
    With the table split by vocabulary the estimate was 1.22: the loss's negated one-hot
    product was a buffer of its own beside the logits' all-to-all slices, where XLA sums the
    product and negates the sum (Timeline.hoisted)."""
    mesh = jax.make_mesh((8,), ("data",))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k1, (8192, 256)) / 16
    x = jax.random.normal(k2, (8, 128, 256))
    labels = jax.random.randint(k3, (8, 128), 0, 8192)
    shardings = None if pins == "free" else (P("data"), None, None)
    plan = shardsat.saturate_and_extract(cross_entropy_step, mesh, w, x, labels, in_shardings=shardings,
                                         profile="h100")
    r = plan.cost.memory.total / plan.compiled_memory(w, x, labels)
    assert LOW <= r <= HIGH, r


def test_a_captured_constant_read_split_is_counted():
    """Regression (a helper's API hunt): a closed-over 16 MiB matrix read split 8 ways is sliced
    into a 2 MiB temporary per device, which the estimate left out (73,728 bytes predicted,
    2,170,880 compiled)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    c = jnp.arange(2048 * 2048, dtype=jnp.float32).reshape(2048, 2048) / 1e7
    x = jnp.ones((8, 2048))
    plan = shardsat.saturate_and_extract(lambda x: x @ c, mesh, x, memory_limit=None)
    assert plan.layout_of(plan.program.const_values[0]).used_axes()  # the case: the constant is read split
    r = plan.cost.memory.total / plan.compiled_memory(x)
    assert LOW <= r <= HIGH, r
    check_plan(plan, x)


def test_data_parallel_adam_step_on_a_2d_mesh_matches_compiled():
    """Replicated GPT weights and Adam moments on a 4x2 mesh: the plan reduces gradients over
    two device groups (XLA combines all-reduces per group only: what waits for one group's
    reduction does not wait for the other's) and all-gathers moments updated on shards (a
    moment gathered along a minor dimension is recomputed by the weight's update, and XLA
    copies the old moment first). Within the band of the compiled figure (0.91 while each
    group's reduced gradients were born at their own steps, not at the combined all-reduce)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from models import GPTConfig, gpt_batch, gpt_params, make_gpt_step

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    cfg = GPTConfig(layers=2, d_model=256, heads=4, mlp=1024, vocab=2048, seq=64, batch=16, embed="gather")
    opt, step = make_gpt_step(cfg, eps=1e-4)
    params = gpt_params(cfg, jax.random.key(0))
    state, batch = (params, opt.init(params)), gpt_batch(cfg, jax.random.key(1))
    rep = jax.tree_util.tree_map(lambda _: P(), state)
    plan = shardsat.saturate_and_extract(step, mesh, state, batch, in_shardings=(rep, P("data")),
                                         profile="h100", state_argnums=(0,), memory_limit=None)
    r = plan.cost.memory.total / plan.compiled_memory(state, batch)
    assert LOW <= r <= HIGH, r


def _megatron_mlp_step(profile: Any) -> tuple[shardsat.Plan, tuple[Any, Any]]:
    """Megatron MLP training on 4x2 (weights and moments split over "model", the batch over
    "data"): the weight gradients are partial over "data"."""
    import optax

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    ks = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(ks[i], (512, 2048) if i % 2 == 0 else (2048, 512)) / 32 for i in range(4)]
    batch = {"x": jax.random.normal(ks[4], (1024, 512)), "y": jax.random.normal(ks[5], (1024, 512))}
    opt = optax.adamw(1e-3, weight_decay=0.01)

    def step(state, batch):
        ws, o = state

        def loss(ws):
            x = batch["x"]
            for w in ws:
                x = jax.nn.relu(x @ w)
            return jnp.mean((x - batch["y"]) ** 2)

        val, g = jax.value_and_grad(loss)(ws)
        u, o = opt.update(g, o, ws)
        return (optax.apply_updates(ws, u), o), val

    state = (params, opt.init(params))
    tp = [P(None, "model") if i % 2 == 0 else P("model", None) for i in range(4)]

    def spec(path, x):
        names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
        return tp[path[-1].idx] if x.ndim and ("mu" in names or "nu" in names) else P()

    pins = ((tp, jax.tree_util.tree_map_with_path(spec, state[1])), {"x": P("data"), "y": P("data")})
    plan = shardsat.saturate_and_extract(step, mesh, state, batch, in_shardings=pins, profile=profile,
                                         state_argnums=(0,), memory_limit=None)
    return plan, (state, batch)


def test_combined_reduce_scatter_results_live_whole_until_read():
    """The Megatron MLP step priced as XLA:GPU combines gathers: its plan reduces the weight
    gradients to shards over "data"; XLA:CPU runs every such reduce-scatter as one combined
    all-reduce whose whole results live until each update slices its shard out. Within the band
    of the compiled figure (the base estimate, which held the whole buffer for an instant, was
    0.85 on the benchmark's MLP4 step)."""
    plan, args = _megatron_mlp_step(H100_GPU)
    assert plan.cost.count()["reduce-scatter"] > 0, plan.explain()
    r = plan.cost.memory.total / plan.compiled_memory(*args)
    assert LOW <= r <= HIGH, r


def _collective_ops(plan: shardsat.Plan, *args: Any) -> int:
    """Collective ops in the compiled HLO: each pays one latency, whatever its tuple holds."""
    text = plan.jit().lower(*args).compile().as_text()
    return len(re.findall(r" (?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                          text))


def test_cpu_pricing_all_reduces_what_gpu_pricing_scatters_and_gathers():
    """The same step priced as XLA:CPU compiles it (no all-gather combiner: each gather pays its
    own latency) reduces the gradients whole and updates replicated over "data": no gathers, and
    the compiled program holds fewer collectives than the GPU-priced plan's (5 against 17,
    measured; a compiled step estimate of 104 against 213 us)."""
    plan, args = _megatron_mlp_step("h100")
    gpu, _ = _megatron_mlp_step(H100_GPU)
    assert "all-gather" not in plan.cost.count(), plan.explain()
    assert _collective_ops(plan, *args) < _collective_ops(gpu, *args)
    check_plan(plan, *args, rtol=1e-4)
    assert_hlo_matches(plan, *args)


def test_all_reduced_gradients_of_a_tensor_parallel_step_match_compiled():
    """The Megatron MLP step priced as XLA:CPU compiles it: the weight gradients are all-reduced
    whole over "data". XLA:CPU combines the four all-reduces into one after the last gradient,
    whose results are new buffers: four partial gradients and four reduced live together, and
    the updates run after it (0.87 while each reduced gradient was born at its own step)."""
    plan, args = _megatron_mlp_step("h100")
    r = plan.cost.memory.total / plan.compiled_memory(*args)
    assert LOW <= r <= HIGH, r


def test_library_reduction_holds_a_shared_literal_broadcast():
    """XLA:CPU's library fusion takes a relu into the pooling's reduction but not the broadcast
    of its 0.0, which the relu's gradient also reads: that broadcast is a full-size buffer from
    the start; the pooling's 1/4 likewise. A multiply or a literal no other op reads is none."""
    red = Eq("reduce_sum", (0,), (1,), {"axes": (2, 4)})
    relu = Eq("max", (0, Literal(0.0, np.dtype(np.float32))), (2,))
    assert fusion.ynn_literal_broadcast(relu)
    assert not fusion.ynn_literal_broadcast(Eq("max", (0, 1), (2,)))  # type: ignore[arg-type]
    assert not fusion.ynn_literal_broadcast(Eq("mul", (0, Literal(0.25, np.dtype(np.float32))), (2,)))  # type: ignore[arg-type]
    assert fusion.ynn_literal_broadcast(Eq("mul", (0, Literal(0.25, np.dtype(np.float32))), (2,)), down=True)  # type: ignore[arg-type]
    assert not fusion.ynn_literal_broadcast(red)  # type: ignore[arg-type]


def test_conv_net_adam_step_estimate_matches_compiled():
    """The expert benchmark's conv net training step on a 2x4 mesh, planned freely: the relus'
    0.0 and the first pooling's 1/4 are broadcast buffers the library reductions read (written
    at the start), and the reversed kernels the backward convolutions read are written
    transposed early and held until then. Within the band of the compiled figure (0.934
    without them)."""
    make_mesh, workloads = _experts("common.make_mesh", "misc.workloads")

    w = next(w for w in workloads() if w.name.startswith("ConvNet train"))
    mesh = make_mesh((2, 4))
    prob = w.build(mesh)
    plan = shardsat.saturate_and_extract(prob.fn, mesh, *prob.args, profile="h100",
                                         state_argnums=prob.state_argnums, memory_limit=None)
    r = plan.cost.memory.total / plan.compiled_memory(*prob.args)
    assert LOW <= r <= HIGH, r


def test_donated_weight_updated_in_place_keeps_its_buffer():
    """The expert benchmark's Soft-MoE training step on 8 devices, planned freely: the input
    gradient's dot reads each expert weight after nothing orders it before the weight's
    update, so XLA copies the weight for that dot (a transposed copy) while the in-place update
    reads the parameter itself: the parameter's buffer is busy until the update and holds no
    temporaries. Within the band of the compiled figure (0.934 when the copy freed it)."""
    make_mesh, workloads = _experts("common.make_mesh", "misc.workloads")

    w = next(w for w in workloads() if w.name.startswith("SoftMoE train"))
    mesh = make_mesh((8,))
    prob = w.build(mesh)
    plan = shardsat.saturate_and_extract(prob.fn, mesh, *prob.args, profile="h100",
                                         state_argnums=prob.state_argnums, memory_limit=None)
    r = plan.cost.memory.total / plan.compiled_memory(*prob.args)
    assert LOW <= r <= HIGH, r


def _moe_step(w, w2, x, gs):
    def loss(w, w2, x):
        h = jax.nn.gelu(jax.lax.ragged_dot(x, w, gs))
        return jnp.mean(jax.lax.ragged_dot(h, w2, gs) ** 2)

    g = jax.grad(loss, (0, 1, 2))(w, w2, x)
    return w - 0.1 * g[0], w2 - 0.1 * g[1], g[2]


def test_ragged_dot_expanded_per_group_on_cpu_matches_compiled():
    """jax lowers lax.ragged_dot densely on CPU: each operand with the ragged dimension is
    masked into a (groups, ...) buffer, written as soon as its operand is, and the masks the
    gradients share are one buffer. The estimate was 0.17 of the compiled figure (8 groups'
    copies missing); on a GPU mesh (a grouped product) nothing is added."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    k = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(k[0], (8, 128, 256)) / 20, jax.random.normal(k[1], (8, 256, 128)) / 20,
            jax.random.normal(k[2], (512, 128)), jnp.full((8,), 64, jnp.int32))
    plan = shardsat.saturate_and_extract(_moe_step, mesh, *args, profile="h100")
    r = plan.cost.memory.total / plan.compiled_memory(*args)
    assert LOW <= r <= HIGH, r
    ragged = [e for e in plan.program.equations if e.name == "ragged_dot_general"]
    assert [fusion.dense_ragged_operands(e, "cpu") for e in ragged].count((0, 1)) == 2  # the weight gradients
    assert all(fusion.dense_ragged_operands(e, "gpu") == () for e in ragged)


# (lhs shape, rhs shape, ((lhs contracting, rhs contracting), (lhs batch, rhs batch))): dots whose
# operand copies were probed on XLA:CPU; the copies are all of the compiled program's temps
DOTS = [
    ((8, 128, 256), (512, 256), (((2,), (1,)), ((), ()))),  # dx = g . w^T: the transpose folds
    ((1, 512, 1024), (8, 1, 32, 512), (((1,), (3,)), ((0,), (1,)))),  # one expert's weight: both copied
    ((8, 512, 1024), (8, 8, 32, 512), (((1,), (3,)), ((0,), (1,)))),  # eight experts: the rhs only
    ((8, 512, 1024), (8, 512, 256), (((1,), (1,)), ((0,), (0,)))),  # canonical: none
    ((1, 1024, 512), (8, 1, 32, 512), (((2,), (3,)), ((0,), (1,)))),  # lhs in order: the rhs only
    ((8, 512, 1024), (512, 256), (((1,), (0,)), ((), ()))),  # two free dimensions around the contraction
    ((4, 128, 8, 64), (4, 128, 8, 64), (((3,), (3,)), ((0, 2), (0, 2)))),  # batch not leading: both
    ((1, 128, 1, 64), (1, 128, 1, 64), (((3,), (3,)), ((0, 2), (0, 2)))),  # ... of size 1: the rhs only
    ((1, 4, 512, 1024), (8, 1, 4, 32, 512), (((2,), (4,)), ((0, 1), (1, 2)))),  # one batch dimension of size 1
    ((8, 1, 32, 512), (1, 512, 1024), (((3,), (1,)), ((1,), (0,)))),  # moves of size-1 dimensions are bitcasts
    ((512, 1024, 8), (8, 512, 8, 32), (((0,), (1,)), ((2,), (0,)))),  # batch last: copied
]


@pytest.mark.parametrize("lhs,rhs,dn", DOTS, ids=[f"{a}x{b}" for a, b, _ in DOTS])
def test_dot_operand_copies_match_compiled(lhs, rhs, dn):
    """fusion.transposed_operands names the operands XLA:CPU copies into another order (its
    DotDecomposer, with the transposes it folds back into the dot), from the shard shapes: a
    dot's temps here are exactly those copies."""
    x, y = (jax.ShapeDtypeStruct(s, jnp.float32) for s in (lhs, rhs))
    temp = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dn)).lower(x, y).compile().memory_analysis().temp_size_in_bytes
    copied = fusion.transposed_operands(Eq("dot_general", (0, 1), (2,), {"dimension_numbers": dn}), (lhs, rhs))
    assert temp == sum(4 * int(np.prod((lhs, rhs)[pos])) for pos in copied)


def test_expert_weights_split_one_per_device_are_copied_transposed():
    """The expert benchmark's Soft-MoE forward with the experts split over all 8 devices (one
    per device): XLA copies each expert weight transposed at the start, as the expert's batch
    dimension of size 1 hides the transpose from the dot (0.683 of the compiled figure when not
    counted); in training the weight's forward and backward dots share the copy."""
    make_mesh, build_soft_moe = _experts("common.make_mesh", "misc.build_soft_moe")

    mesh = make_mesh((8,))
    for train, t in ((False, 512), (True, 256)):
        prob = build_soft_moe(8, t, 512, 8, 32, 1024, train, mesh)
        plan = shardsat.saturate_and_extract(prob.fn, mesh, *prob.args, profile="h100", memory_limit=None,
                                             state_argnums=prob.state_argnums, in_shardings=prob.experts["EP(all)"])
        r = plan.cost.memory.total / plan.compiled_memory(*prob.args)
        assert LOW <= r <= HIGH, (train, r)


def test_a_chain_of_collectives_on_a_gradient_starts_after_the_gradient():
    """A data-parallel Adam step pinned on 2x2x2: each weight gradient is reduce-scattered and
    then all-gathered, and no reader reads the scattered middle of that chain. Its all-gathered
    end used to be dated from the start of the program (the middle's birth was unknown), so
    four 16 MiB gradients were live throughout: 1.271 of the compiled figure."""
    mlp, make_mesh = _experts("mlp", "common.make_mesh")

    mesh = make_mesh((2, 2, 2))
    prob = mlp.build(1024, 4096, 4, 2048, True, mesh)
    plan = shardsat.saturate_and_extract(prob.fn, mesh, *prob.args, profile="h100", memory_limit=None,
                                         state_argnums=prob.state_argnums, in_shardings=prob.experts["DP"])
    r = plan.cost.memory.total / plan.compiled_memory(*prob.args)
    assert LOW <= r <= HIGH, r


def _expert_plan_ratio(prob: Any, mesh: Any, expert: str | None, rtol: float = 2e-4) -> tuple[Any, float]:
    """Plan an expert-benchmark problem under one expert's pins (None: free); its numbers match
    `jax.jit` on concrete arguments (the state donated); returns the plan and predicted / compiled."""
    pins = None if expert is None else prob.experts[expert]
    plan = shardsat.saturate_and_extract(prob.fn, mesh, *prob.args, profile="h100", memory_limit=None,
                                         state_argnums=prob.state_argnums, in_shardings=pins)
    args = _concrete(prob.args)
    want = jax.jit(prob.fn)(*args)
    got = plan.jit()(*args)  # donates the state
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol / 200), got, want)
    return plan, plan.cost.memory.total / plan.compiled_memory(*prob.args)


def _misc_ratio(name: str, shape: tuple[int, ...], expert: str) -> float:
    """Predicted / compiled of an expert plan of a workload of benchmarks/experts/misc.py (the
    first whose name starts with `name`) on a mesh of `shape`; its numbers checked as above."""
    misc, make_mesh = _experts("misc", "common.make_mesh")
    mesh = make_mesh(shape)
    w = next(w for w in misc.workloads() if w.name.startswith(name))
    return _expert_plan_ratio(w.build(mesh), mesh, expert, rtol=2e-3)[1]


def test_a_reduce_scatter_read_sliced_by_its_gradient_holds_its_whole_buffer():
    """The same step with weights replicated and the Adam state split (weight-update sharding):
    each relu's pre-activation is an input gradient reduce-scattered over "fsdp" (on XLA:CPU an
    all-reduce and a slice), read by the relu and again by its gradient's mask in the backward
    pass. XLA fuses the slice into both, so the whole all-reduced buffer lives until the mask
    is computed. Held for an instant, the estimate was 0.948 of the compiled figure."""
    mlp, make_mesh = _experts("mlp", "common.make_mesh")

    mesh = make_mesh((2, 2, 2))
    plan, r = _expert_plan_ratio(mlp.build(1024, 4096, 4, 2048, True, mesh), mesh, "DP+WUS")
    assert "reduce-scatter" in plan.predicted_collectives()
    assert LOW <= r <= HIGH, r


def _reuse_fixed_by_scan(temps: list[Temp], fixed: list[Allocation]) -> list[Temp]:
    """reuse_fixed as it was: every allocation from the smallest that is large enough, checked
    in full, in order."""
    allocs = sorted((a for a in fixed if a.size > 0), key=lambda a: a.size)
    left = []
    for t in sorted(temps, key=lambda t: (-t.size, t.start)):
        fit = next((a for a in allocs if a.size >= t.size and a.fits(t)), None)
        if fit is None:
            left.append(t)
        else:
            fit.busy.append((t.start, t.end, t.inplace))
    return left


_span = st.tuples(st.integers(0, 20), st.integers(0, 6), st.booleans())


@settings(max_examples=80, deadline=None)
@given(temps=st.lists(st.tuples(st.integers(1, 12), _span, st.booleans()), max_size=60),
       allocs=st.lists(st.tuples(st.integers(0, 12), st.lists(_span, max_size=3)), min_size=10, max_size=40))
@example(temps=[(1, (5, 3, False), False)],  # fits only the last allocation, through its in-place span at 8
         allocs=[(1, [(0, 20, False)])] * 20 + [(1, [(8, 12, True)])])
def test_reuse_fixed_places_each_temporary_where_a_full_scan_does(temps, allocs):
    """reuse_fixed rules allocations out by their longest spans in numpy (a 96-layer GPT step's
    estimate: 8 s -> 0.2 s): it must place every temporary exactly where checking every
    allocation in turn does, with in-place and kept temporaries, in-place spans and more
    allocations than it scans without the test."""
    def made():
        ts = [Temp(size, s, s + d, inplace, tag=k, kept=kept) for k, (size, (s, d, inplace), kept) in enumerate(temps)]
        return ts, [Allocation(size, [(s, s + d, ip) for s, d, ip in busy]) for size, busy in allocs]

    (t1, a1), (t2, a2) = made(), made()
    assert [t.tag for t in reuse_fixed(t1, a1)] == [t.tag for t in _reuse_fixed_by_scan(t2, a2)]
    assert [a.busy for a in a1] == [a.busy for a in a2]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**70), max_size=12))
def test_each_masks_union_of_the_others_is_the_pairwise_one(masks):
    """The combined all-reduce's sinks read each source's union of the others' ancestors, made
    linear (prefix and suffix unions) where it was a pairwise test."""
    expect = [0] * len(masks)
    for i in range(len(masks)):
        for j, m in enumerate(masks):
            if j != i:
                expect[i] |= m
    assert _others(masks) == expect


def test_argument_copies_take_the_buffers_earlier_copies_freed():
    """XLA copies donated arguments one after another at the start; once an argument is copied
    its buffer is free until its new value is written, and a later copy goes there if it dies
    before that. The first copy has no such buffer, nor has a copy that outlives them."""
    allocs = [Allocation(16, [(60, 90, True), (0, 0, False)]), Allocation(16, [(50, 90, True), (0, 0, False)]),
              Allocation(16, [(40, 90, True), (0, 0, False)]), Allocation(8, [(95, 99, False), (0, 0, False)])]
    copies = [Temp(16, 0, 60), Temp(16, 0, 50), Temp(16, 0, 40), Temp(8, 0, 80)]
    left = chain_copies([(c, a, True) for c, a in zip(copies, allocs, strict=True)])
    assert left == [copies[0], copies[3]]  # the 8-byte copy outlives every 16-byte buffer's gap
    assert (1, 50, False) in allocs[0].busy and (1, 40, False) in allocs[0].busy + allocs[1].busy
    # an argument whose new value is gathered does not offer its buffer: XLA's gathers run at
    # times the breadth-first order does not predict
    allocs = [Allocation(16, [(60, 90, True), (0, 0, False)]), Allocation(16, [(50, 90, True), (0, 0, False)])]
    copies = [Temp(16, 0, 60), Temp(16, 0, 50)]
    assert chain_copies([(copies[0], allocs[0], False), (copies[1], allocs[1], True)]) == copies


def test_copied_weights_take_the_buffers_earlier_copies_freed():
    """The MLP Adam step on 8 devices, FSDP: every weight is read after nothing orders the read
    before its update, so XLA copies each (plainly: the update reads the copy too) and puts
    the second and third copies in the first and second weights' freed buffers. Counting
    every copy as a temporary gave 1.048 of the compiled figure; the estimate is now XLA's to
    the MiB."""
    mlp, make_mesh = _experts("mlp", "common.make_mesh")

    mesh = make_mesh((8,))
    _, r = _expert_plan_ratio(mlp.build(1024, 4096, 4, 2048, True, mesh), mesh, "FSDP")
    assert abs(r - 1) < 0.01, r


def test_copies_do_not_take_the_buffers_of_weights_gathered_after_their_update():
    """The same step with the update split and each new weight gathered (DP+WUS): XLA:CPU
    gathers one new weight amid the backward pass and two at its end, while two copies are read
    to the end, so both stay in its heap. The breadth-first order put each copy in a weight's
    freed buffer: 0.932 of the compiled total, the estimate low, so a memory limit accepted
    what does not fit. Now 1.078 (the DP plan, which gathers some weights, 1.043: XLA chains
    its copies there, as for FSDP, but the model cannot tell when)."""
    mlp, make_mesh = _experts("mlp", "common.make_mesh")

    mesh = make_mesh((8,))
    _, r = _expert_plan_ratio(mlp.build(1024, 4096, 4, 2048, True, mesh), mesh, "DP+WUS")
    assert LOW <= r <= HIGH, r


@pytest.mark.parametrize("shape", [(8,), (2, 4)])
def test_a_weight_whose_input_gradient_reads_a_slice_of_it_is_copied(shape):
    """The MLP Adam step with its weights replicated and the update split (DP+WUS): the plan's
    second weight is read by its input gradient's product as a slice (the product's result
    split; on 2x4 sliced over both axes, one hop each), which nothing orders before the
    weight's update, so XLA copies it first, as it copies the later weights read whole. A slice
    read in place was not counted as a read of the argument, and the estimate left that copy
    out: the copies are now XLA's."""
    mlp, make_mesh = _experts("mlp", "common.make_mesh")

    mesh = make_mesh(shape)
    prob = mlp.build(1024, 4096, 4, 2048, True, mesh)
    plan, _ = _expert_plan_ratio(prob, mesh, "DP+WUS")
    want = plan.compiled_argument_copies(*prob.args)
    assert "args[0][0][1]" in want
    assert sorted(plan.cost.memory.copied) == want


def test_a_late_read_the_combined_gradient_reduction_waits_for_needs_no_copy():
    """The expert benchmark's tied-embedding step, data parallel on 8: XLA:CPU combines the four
    weight gradients' all-reduces into one, which waits for every input gradient's product but
    the first layer's (read only by the embedding's gradient). Every update waits for that
    reduction, so copy insertion finds each weight's late read ordered before its update but
    the first layer's first weight's: the one weight XLA copies. Ordered only through the
    first wave of reductions (the loss's), the model copied all four."""
    misc, make_mesh = _experts("misc", "common.make_mesh")

    mesh = make_mesh((8,))
    prob = next(w for w in misc.workloads() if w.name.startswith("TiedEmb train")).build(mesh)
    plan, _ = _expert_plan_ratio(prob, mesh, "DP", rtol=2e-3)
    want = plan.compiled_argument_copies(*prob.args)
    assert want == ["args[0][0]['layers'][0]['w1']"]
    assert sorted(plan.cost.memory.copied) == want


def test_a_scale_read_where_its_fused_product_is_computed_again_is_copied():
    """The expert benchmark's GPT step, DP+Megatron on 8: the layer norms' scales and the second
    MLP biases feed cheap ops (`x * scale`, `h + b`) that XLA fuses into their readers and
    computes again in the backward pass, reading the donated parameter there, after nothing
    orders the read before its update: XLA copies each. The model dated the read where the op
    is in the program (the forward pass) and copied none of them."""
    (transformer,) = _experts("transformer")
    make_mesh = _experts("common.make_mesh")[0]

    mesh = make_mesh((8,))
    prob = next(w for w in transformer.workloads() if w.name.startswith("gpt")).build(mesh)
    plan, _ = _expert_plan_ratio(prob, mesh, "DP+Megatron", rtol=2e-3)
    want = plan.compiled_argument_copies(*prob.args)
    assert any("scale" in p for p in want) and any("b2" in p for p in want)
    assert sorted(plan.cost.memory.copied) == want


def test_weights_gathered_in_two_hops_hold_one_middle_at_a_time():
    """Six FSDP+TP weights on 2x2x2 that the plan gathers whole in two hops at the start (over
    (data, fsdp), then over model): XLA frees each half once its next hop is made, so the start
    holds every whole weight and about one half. Every half used to be counted beside every
    whole weight: 1.255 of the compiled figure."""
    mlp, make_mesh = _experts("mlp", "common.make_mesh")

    mesh = make_mesh((2, 2, 2))
    prob = mlp.build(512, 512, 6, 4096, False, mesh)
    for name in ("FSDP+TP", "DP+FSDP+TP"):
        plan = shardsat.saturate_and_extract(prob.fn, mesh, *prob.args, profile="h100", memory_limit=None,
                                             in_shardings=prob.experts[name])
        r = plan.cost.memory.total / plan.compiled_memory(*prob.args)
        assert LOW <= r <= HIGH, (name, r)


def test_a_cheap_sum_stored_for_a_library_reduction_is_recomputed_by_its_fused_readers():
    """The expert benchmark's GPT step on 2x4, planned freely: the token embedding is looked up
    split by feature and gathered whole; its sum with the positions is stored for the layer
    norm's library reduction, and XLA duplicates that cheap add into each reader that fuses it
    (the norm's centring, the residual add, the norm's gradient), each slicing the whole
    gathered buffer, which so lives until the first norm's gradient. Read from the stored sum
    by every reader, the estimate was 0.932 of the compiled figure."""
    transformer, make_mesh = _experts("transformer", "common.make_mesh")

    mesh = make_mesh((2, 4))
    _, r = _expert_plan_ratio(transformer.build("gpt", mesh), mesh, None, rtol=2e-3)
    assert LOW <= r <= HIGH, r


def _group_norm(x: jax.Array, groups: int = 8) -> jax.Array:
    b, h, w, c = x.shape
    y = x.reshape(b, h, w, groups, c // groups)
    m, v = y.mean((1, 2, 4), keepdims=True), y.var((1, 2, 4), keepdims=True)
    return ((y - m) * jax.lax.rsqrt(v + 1e-5)).reshape(b, h, w, c)


def _conv(x: jax.Array, w: jax.Array, stride: int = 1) -> jax.Array:
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _unet_step(p: dict[str, jax.Array], x: jax.Array) -> dict[str, jax.Array]:
    def loss(p: dict[str, jax.Array]) -> jax.Array:
        h = jax.nn.silu(_group_norm(_conv(x, p["c1"])))
        h = jax.nn.silu(_group_norm(_conv(h, p["c2"], 2)))
        h = jnp.repeat(jnp.repeat(h, 2, 1), 2, 2)
        return jnp.mean((_conv(h, p["c3"]) - x) ** 2)
    return jax.tree.map(lambda a, g: a - 0.01 * g, p, jax.grad(loss)(p))


def test_a_group_norms_centred_values_are_stored_for_the_variances_library_reduction():
    """A U-Net-like step with group norms on 2x4: the variance's library reduction takes the
    square in and reads the centred values `y - mean` (merged with the normalisation's own) as
    a buffer, while the normalisation and its gradient compute them again from the
    convolution's output, which so lives into the backward pass. Fused everywhere, the
    estimate was 0.847 of the compiled figure."""
    ks = jax.random.split(jax.random.key(0), 4)
    p = {"c1": jax.random.normal(ks[0], (3, 3, 16, 64)) * 0.1, "c2": jax.random.normal(ks[1], (3, 3, 64, 64)) * 0.05,
         "c3": jax.random.normal(ks[2], (3, 3, 64, 16)) * 0.05}
    x = jax.random.normal(ks[3], (16, 32, 32, 16))
    plan = shardsat.saturate_and_extract(_unet_step, jax.make_mesh((2, 4), ("data", "model")), p, x,
                                         memory_limit=None)
    got, want = plan.jit()(p, x), jax.jit(_unet_step)(p, x)
    for k in p:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=1e-6)
    r = plan.cost.memory.total / plan.compiled_memory(p, x)
    assert LOW <= r <= HIGH, r


@pytest.mark.parametrize("shape", [(2, 4), (2, 2, 2), (1, 8)])
def test_a_batch_norms_backward_holds_the_masks_products_beside_the_forward_values(shape):
    """A ResNet step with batch norms (benchmarks/probe_models.py). XLA computes the relu's
    mask again inside each fusion that reads it (`compare_select`, `select_multiply`,
    `multiply_multiply`, the feeds of the norm's gradient reductions), so breadth first all
    three are ready together and run before the library kernels that read them, while the
    forward's centred and normalised values live. The model ordered them one after another
    (0.933 on all three meshes): a reader that computes a duplicated value again now waits for
    its operands only, and a fused equation is placed with its reader's kernel."""
    _probe_in_band("batchnorm_resnet_train", shape)


def test_a_looked_up_gradient_is_scattered_into_the_tied_products_gradient():
    """The expert benchmark's tied-embedding step, data parallel on 2x4: the table's gradient
    is `x + scatter-add(zeros, tokens, dx)`, the unembedding product's gradient plus the
    lookup's. XLA's simplifier scatters into `x` itself: no table of zeros (16 MiB a device,
    written at the start) and no scatter result beside the sum. Counted, the estimate was
    1.130 of the compiled figure."""
    r = _misc_ratio("TiedEmb train", (2, 4), "DP")
    assert LOW <= r <= HIGH, r


def _embedding_xent_sgd(p, tok, y):
    """An untied embedding's SGD step on softmax cross entropy by take_along_axis: the logits'
    gradient is a scatter-add of the labels' rows, negated and summed by log_softmax's
    backward pass."""
    def loss(p):
        h = p["emb"][tok].reshape(-1, p["emb"].shape[1])
        logp = jax.nn.log_softmax(h @ p["out"], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y.reshape(-1)[:, None], 1))
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))


def test_a_negation_a_sum_reduces_is_no_buffer():
    """XLA's simplifier makes `sum(-g)` `-sum(g)`: the YNNPACK sum reads the scattered gradient
    `g` (a buffer anyway) and the negation is of the reduced row sums. Storing the negated
    logits-sized gradient as well gave 1.173 of compiled on 4x2 (1.197 at vocabulary 32000,
    1024 tokens)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    p = {"emb": jax.ShapeDtypeStruct((8192, 128), jnp.float32), "out": jax.ShapeDtypeStruct((128, 8192), jnp.float32)}
    tok = jax.ShapeDtypeStruct((8, 64), jnp.int32)
    plan = shardsat.saturate_and_extract(_embedding_xent_sgd, mesh, p, tok, tok, memory_limit=None, state_argnums=(0,))
    r = plan.cost.memory.total / plan.compiled_memory(p, tok, tok)
    assert LOW <= r <= HIGH, r


def test_the_heap_packs_largest_first_and_keeps_the_holes_that_leaves():
    """XLA places temporaries largest first, each in the smallest hole that fits it over its
    whole life. A 3-byte buffer at t=4 pushes the 2-byte one living over t=3..4 above it; the
    1-byte hole left below that one at t=3 is too small for a third 2-byte buffer, so the heap
    is 7 bytes although at most 6 are live at once."""
    temps = [Temp(3, 4, 4), Temp(2, 2, 3), Temp(2, 3, 3), Temp(2, 3, 4)]
    assert heap_peak(temps)[0] == 6
    assert packed_heap(temps) == 7
    assert packed_heap([Temp(4, 0, 1), Temp(4, 2, 3), Temp(2, 1, 2)]) == 6  # no hole: the live peak


def test_interleaved_logits_sized_buffers_leave_holes_in_the_heap():
    """The expert benchmark's tied-embedding step, vocabulary-parallel over "model" with data
    parallelism on 4x2: 156 MiB are live at most at once, the model's and XLA's alike, but four
    32 MiB logits-sized buffers with interleaved lives leave holes in XLA's packing, which
    allocates 188 MiB. Summing the live buffers, the estimate was 0.904 of the compiled figure."""
    r = _misc_ratio("TiedEmb train", (4, 2), "VocabPar(tp)+DP")
    assert LOW <= r <= HIGH, r


def test_a_weight_gathered_along_a_minor_dimension_is_copied_slice_by_slice():
    """The expert benchmark's Soft-MoE training step with the experts over all 8 devices of 2x4:
    an expert weight split over its second dimension is gathered whole (the raw gathered buffer)
    and then sliced by the first. XLA fuses the copy into the minor order with the slice, so
    only the slice is written, never a whole transposed copy beside the raw buffer. Counted
    whole, the chain held 7.5 MiB where XLA holds 4.5: 1.118 of the compiled figure."""
    r = _misc_ratio("SoftMoE train", (2, 4), "EP(all)")
    assert LOW <= r <= HIGH, r


def test_an_all_to_all_read_later_receives_its_pieces_after_its_slices_are_made():
    """The expert benchmark's tied-embedding step, vocabulary-parallel over all 8 devices of
    2x2x2: the logits are resharded twice by all-to-all, once through a slice. XLA makes both
    collectives' slices while the logits live, then runs the collectives, whose pieces arrive
    after the slices exist, one collective after the other, before either is read. Counting
    one all-to-all's pieces beside the other's slices and the chain's whole middle in one
    instant, the estimate was 1.128 of the compiled figure."""
    r = _misc_ratio("TiedEmb train", (2, 2, 2), "VocabPar(all)+DP")
    assert LOW <= r <= HIGH, r


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4)])
def test_a_gathered_weight_read_transposed_is_freed_once_copied(shape):
    """A GPT AdamW step, FSDP: each attention weight is all-gathered at the start (along a minor
    dimension on 2x2x2, along its first on 2x4) and read in another order by its forward and
    backward products. XLA copies the gathered buffer once, into that order, and both products
    read the copy. Held until the backward product beside its copy, the gathered weights were
    counted twice: 1.118 of the compiled figure on 2x2x2, and 1.108 on 2x4 once the layer
    norms' centred values were buffers."""
    transformer, make_mesh = _experts("transformer", "common.make_mesh")

    mesh = make_mesh(shape)
    _, r = _expert_plan_ratio(transformer.build("gpt", mesh), mesh, "FSDP", rtol=2e-3)
    assert LOW <= r <= HIGH, r


def test_combined_reductions_of_fused_gradients_start_when_the_gradients_are_made():
    """A llama AdamW step, DP+FSDP+TP on 2x2x2: XLA:CPU combines the gradients' reduce-scatters
    into one all-reduce per group of axes. Where a gradient is fused into its producer (no
    stored buffer), the combined all-reduce's whole result was dated from the program's start,
    so twelve of them were live at the peak: 1.179 of the compiled figure."""
    transformer, make_mesh = _experts("transformer", "common.make_mesh")

    mesh = make_mesh((2, 2, 2))
    prob = transformer.build("llama", mesh)
    plan = shardsat.saturate_and_extract(prob.fn, mesh, *prob.args, profile="h100", memory_limit=None,
                                         state_argnums=prob.state_argnums, in_shardings=prob.experts["DP+FSDP+TP"])
    r = plan.cost.memory.total / plan.compiled_memory(*prob.args)
    assert LOW <= r <= HIGH, r


def _selective_scan_step(p: dict[str, Any], x: jax.Array) -> tuple[dict[str, Any], jax.Array]:
    """A Mamba-like selective scan (lax.associative_scan over the sequence) and an SGD step."""
    def forward(p):
        dt = jax.nn.softplus(x @ p["wdt"])
        a = jnp.exp(dt[..., None] * -jnp.exp(p["a_log"]))
        bx = dt[..., None] * (x @ p["wb"])[:, :, None, :] * x[..., None]

        def combine(left, right):
            return right[0] * left[0], right[0] * left[1] + right[1]
        _, h = jax.lax.associative_scan(combine, (a, bx), axis=1)
        return jnp.mean(jnp.einsum("bldn,bln->bld", h, x @ p["wc"]) ** 2)

    loss, g = jax.value_and_grad(forward)(p)
    return jax.tree.map(lambda w, d: w - 0.01 * d, p, g), loss


def test_associative_scan_levels_are_buffers():
    """lax.associative_scan slices each level of its tree out of the one before: a kernel fusing
    them would compute the low levels once per path (2**depth), past XLA's allowed duplication
    (15), and each pad or concatenation of the down-sweep is computed once or stored. The levels
    are buffers; the estimate counted them fused, 0.43 of the compiled figure. (The forward
    alone is still low, 0.59: XLA stores levels the duplication count leaves fused.)"""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    ks = jax.random.split(jax.random.key(0), 5)
    d, n = 64, 16
    p = {"a_log": jnp.log(jnp.arange(1, n + 1, dtype=jnp.float32))[None, :].repeat(d, 0),
         "wdt": jax.random.normal(ks[0], (d, d)) / 8, "wb": jax.random.normal(ks[1], (d, n)) / 8,
         "wc": jax.random.normal(ks[2], (d, n)) / 8}
    x = jax.random.normal(ks[3], (8, 256, d))
    plan = shardsat.saturate_and_extract(_selective_scan_step, mesh, p, x, profile="h100", memory_limit=None)
    np.testing.assert_allclose(plan.jit()(p, x)[1], jax.jit(_selective_scan_step)(p, x)[1], rtol=1e-4)
    r = plan.cost.memory.total / plan.compiled_memory(p, x)
    assert 0.85 <= r <= HIGH, r


def test_concatenation_along_the_minor_dimension_is_a_copy_of_its_own():
    """XLA:CPU does not fuse a concatenation along the minor dimension (it would branch in the
    innermost loop): its operands and its result are buffers. The estimate fused it, 0.61 of
    the compiled figure here; 0.805 with the rule (XLA keeps one more operand-sized buffer)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    k1, k2 = jax.random.split(jax.random.key(0))
    w, x = jax.random.normal(k1, (256, 256)) / 16, jax.random.normal(k2, (8, 2048, 256))

    def f(w, x):
        h = x @ w
        return jnp.concatenate([h, -h], axis=-1) * 2 + 1

    plan = shardsat.saturate_and_extract(f, mesh, w, x, profile="h100", memory_limit=None)
    np.testing.assert_allclose(plan.jit()(w, x), jax.jit(f)(w, x), rtol=1e-5, atol=1e-5)
    r = plan.cost.memory.total / plan.compiled_memory(w, x)
    assert 0.78 <= r <= HIGH, r


def test_a_cumulative_sum_along_a_long_axis_holds_a_blocked_copy():
    """jax lowers cumsum to a reduce-window over the whole axis, which XLA splits into blocks of
    16 (ReduceWindowRewriter): the operand is copied into block order beside the result. The
    estimate had no buffer for it, 0.652 of the compiled figure. In the gradient the reverse
    cumsum's operand is computed into that copy: no buffer of its own there (1.30 if counted)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (16, 2048, 256))

    def f(x):
        return jnp.cumsum(x, axis=1) * 2

    g = jax.grad(lambda x: jnp.sum(jnp.cumsum(x, axis=1) ** 2))
    for fn, rtol in ((f, 1e-4), (g, 1e-3)):
        plan = shardsat.saturate_and_extract(fn, mesh, x, profile="h100", memory_limit=None)
        want = jax.jit(fn)(x)
        np.testing.assert_allclose(plan.jit()(x), want, rtol=rtol, atol=rtol * float(jnp.abs(want).max()))
        r = plan.cost.memory.total / plan.compiled_memory(x)
        assert LOW <= r <= HIGH, r


def test_a_matrix_transpose_folds_into_products_without_batch_dimensions():
    """XLA:CPU folds `w.T` into the dimension numbers of the products reading it
    (TransposeFolding): no buffer of its own; a batched product, or any other reader, keeps it."""
    dot = Eq("dot_general", (0, 1), (2,), {"dimension_numbers": (((2,), (0,)), ((), ()))})
    batched = Eq("dot_general", (0, 1), (2,), {"dimension_numbers": (((2,), (1,)), ((0,), (0,)))})
    t = Eq("transpose", (3,), (1,), {"permutation": (1, 0)})
    assert fusion.folds_into_dots(t, [dot, dot])  # type: ignore[arg-type, list-item]
    assert not fusion.stored(t, [dot], True, False)  # type: ignore[arg-type, list-item]
    assert fusion.stored(t, [dot], True, True)  # type: ignore[arg-type, list-item]  # an output is a buffer
    assert not fusion.folds_into_dots(t, [batched])  # type: ignore[arg-type, list-item]
    assert not fusion.folds_into_dots(t, [dot, Eq("add", (1, 1), (4,))])  # type: ignore[arg-type, list-item]
    t3 = Eq("transpose", (3,), (1,), {"permutation": (0, 2, 1)})
    assert not fusion.folds_into_dots(t3, [dot])  # type: ignore[arg-type, list-item]


def test_a_product_with_several_free_dimensions_keeps_its_buffer_from_its_reader():
    """`x @ w` for a 3-D `x` is a matrix product whose result XLA bitcasts to 3-D; the
    elementwise op reading it has another shape, so it cannot write into it as it dies."""
    dn = (((2,), (0,)), ((), ()))
    assert fusion.flattened_product(Eq("dot_general", (0, 1), (2,), {"dimension_numbers": dn}), (3, 2))  # type: ignore[arg-type]
    assert not fusion.flattened_product(Eq("dot_general", (0, 1), (2,), {"dimension_numbers": (((1,), (0,)), ((), ()))}),  # type: ignore[arg-type]
                                        (2, 2))
    batched = (((2,), (1,)), ((0,), (0,)))
    assert not fusion.flattened_product(Eq("dot_general", (0, 1), (2,), {"dimension_numbers": batched}), (3, 3))  # type: ignore[arg-type]
    made, out = Temp(100, 0, 3), Temp(100, 3, 5, inplace=True)
    share_inplace([made, out])
    assert made.end == 2  # taken over
    kept, out = Temp(100, 0, 3, kept=True), Temp(100, 3, 5, inplace=True)
    share_inplace([kept, out])
    assert kept.end == 3
    alloc = Allocation(100, [(3, 9, True)])
    assert alloc.fits(Temp(100, 0, 3)) and not alloc.fits(Temp(100, 0, 3, kept=True))


@pytest.mark.parametrize("pins", ["free", "pinned"])
def test_a_transposed_weight_read_by_a_3d_product_matches_compiled(pins):
    """`tanh(x @ w.T) * 2` with a 3-D `x` (a linear layer written as in PyTorch): the transpose is
    folded into the product, whose (sliced) weight operand is a buffer, and the product's result
    lives beside the output written from it. The estimate counted a transposed copy XLA does not
    make and shared the product's buffer with the output (pinned: 0.923 of compiled)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    w = jax.random.normal(jax.random.key(0), (4096, 1024)) / 32
    x = jax.random.normal(jax.random.key(1), (16, 64, 1024))

    def f(w, x):
        return jnp.tanh(x @ w.T) * 2

    shardings = None if pins == "free" else (P(), P("data"))
    plan = shardsat.saturate_and_extract(f, mesh, w, x, profile="h100", memory_limit=None, in_shardings=shardings)
    np.testing.assert_allclose(plan.jit()(w, x), jax.jit(f)(w, x), rtol=1e-4, atol=1e-4)
    r = plan.cost.memory.total / plan.compiled_memory(w, x)
    assert LOW <= r <= HIGH, r


def _concrete(args: Any, seed: int = 0) -> Any:
    """Arrays for abstract arguments: small positive floats (an Adam moment's square root stays
    real) and integers that index any axis."""
    leaves, tree = jax.tree.flatten(args)
    rng = np.random.default_rng(seed)  # not jax.random: it compiles a kernel per shape (3 s a GPT step)
    out = [jax.device_put((rng.integers(0, 8, a.shape) if jnp.issubdtype(a.dtype, jnp.integer)
                           else rng.uniform(0.0, 0.1, a.shape)).astype(a.dtype)) for a in leaves]
    return jax.tree.unflatten(tree, out)


def _probe_in_band(name: str, shape: tuple[int, ...], atol: float = 0.0) -> None:
    """Plan a program of benchmarks/memory_probe.py freely on `shape`; its numbers match
    `jax.jit` (to `atol` more, where the program rounds to bfloat16 before a step that
    amplifies it) and its estimate is in the band of compiled."""
    (probe,) = _experts("memory_probe")
    mesh = jax.make_mesh(shape, ("data", "model") if len(shape) == 2 else ("data", "fsdp", "model"))
    fn, abstract = probe.PROGRAMS[name]()
    args = _concrete(abstract)
    plan = shardsat.saturate_and_extract(fn, mesh, *args, memory_limit=None)
    got, want = plan.jit()(*args), jax.jit(fn)(*args)
    jax.tree.map(lambda a, b: _close(a, b, atol), got, want)
    r = plan.cost.memory.total / plan.compiled_memory(*args)
    assert LOW <= r <= HIGH, r


def _close(a: Any, b: Any, atol: float = 0.0) -> None:
    """Equal to float32 rounding, or to bfloat16's (8 bits: a sum split across devices rounds
    its partial sums)."""
    half = jnp.dtype(a.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2e-2 if half else 2e-4, atol=max(atol, 2e-2 if half else 1e-5))


@pytest.mark.parametrize("name,shape", [("softmax_xent_vocab", (2, 2, 2)), ("lstm_train", (1, 8))])
def test_a_minor_gather_holds_one_raw_buffer_beside_its_copies(name, shape):
    """An all-gather of a minor dimension gathers the major one and copies the result into order.
    XLA copies the raw buffers one by one, so the instant they are copied holds every copy and
    the largest raw buffer. Counting the copies alone gave 0.853 of compiled on the cross-entropy
    step (its logits) and 0.816 on the LSTM step."""
    _probe_in_band(name, shape)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_a_value_read_inside_a_loop_lives_until_the_loop_ends(shape):
    """A loop runs its body once per iteration, so what the body reads from outside the loop is
    read until the last iteration: the residuals the forward scan stacks live through the whole
    backward scan, not until the backward body's first read of them. Counted to that read, the
    estimate of a scan over six layers with Adam was 0.946 of compiled on 2x4, 0.918 on 1x8."""
    _probe_in_band("scan_layers_train", shape)


def test_a_value_resharded_into_a_loop_is_a_buffer():
    """A scanned weight the body reads in another layout is resharded before the loop (a slice
    of the whole stack passed in the loop's state, held through it); the estimate had the slice
    fused into the body's reader, 0.912 of compiled for the rematerialised scan on 2x2x2."""
    _probe_in_band("scan_remat_train", (2, 2, 2))


def test_reductions_in_a_loops_body_are_combined_there_alone():
    """XLA combines all-reduces within one computation: a reduction in a cond's branch inside a
    scan's body is not combined with those of the entry or of the other branch. Combined across
    computations, the estimate held the branch's reduce-scatter sources to a common instant:
    1.198 of compiled for a scan of alternating tanh / relu layers on 2x4."""
    _probe_in_band("cond_in_scan", (2, 4))


def test_random_bits_hold_both_counter_words():
    """Dropout's random bits are threefry2x32 over two counter words per element, which jax runs
    as a rolled loop on CPU: the two words, and at the draw two new ones beside them. The
    estimate counted the bits alone, 0.375 of compiled for dropout on a 1024x4096 activation."""
    _probe_in_band("dropout_mlp_train", (2, 4))


def test_rbg_bits_are_the_generators_output_alone():
    """An rbg key draws with XLA's RngBitGenerator, which holds no threefry counter words: the
    estimate counted four words per element anyway, 2.68 of compiled for dropout on 2x4."""
    _probe_in_band("dropout_mlp_rbg", (2, 4))


def test_threefry_not_partitionable_holds_one_word_per_element():
    """With jax_threefry_partitionable off, jax hashes half as many counters, each into two
    words: one word per element held, one more at the draw (the estimate counted the
    partitionable draw's two and two: 1.73 of compiled for dropout on 2x4)."""
    with jax.threefry_partitionable(False):
        _probe_in_band("dropout_mlp_train", (2, 4))


@pytest.mark.parametrize("name,atol", [("bf16_mlp_adam", 2.5e-3), ("bf16_params_sgd", 0.0)])
def test_half_precision_products_hold_float32_buffers_on_cpu(name, atol):
    """XLA:CPU has no bfloat16 products: it computes them in float32, converting the operands
    (in their producers, or a copy of an argument) and the results. Counted at bfloat16 size,
    the estimate was 0.733 of compiled for a mixed-precision MLP step with Adam, and 0.533 for
    an SGD step on bfloat16 weights, both on 2x4. (Adam's first step moves each weight by
    +-lr = 1e-3, whose sign a bfloat16 rounding of a gradient near zero can flip: 2.5e-3.)"""
    _probe_in_band(name, (2, 4), atol)


def test_a_buffer_is_not_shared_with_a_user_of_another_element_type():
    """XLA shares an operand's buffer with its user only where both have one shape, element type
    included: an int8 product's s32 result is not overwritten by its f32 epilogue, though both
    are 4 bytes per element. Counted as shared (in the output's buffer), the estimate was 0.866
    of compiled for a quantised product on 2x4."""
    _probe_in_band("int8_matmul", (2, 4))


def test_a_minor_gather_read_where_it_is_made_is_copied_before_its_reader():
    """The GNN step on 2x2x2: the second layer's gathered node features are all-gathered along a
    minor dimension for the product that reads them at once. XLA gathers raw, copies, frees the
    raw buffer and then runs the product, whose result is resharded by a chain of its own. The
    copy was dated an instant after its reader, beside that chain, with the raw buffer again
    (1.265 of compiled); made in the first half of the reader's instant it is in the band, and
    the raw buffer never meets the product's result (dropout and bf16 steps on 2x4 stay in)."""
    _probe_in_band("gnn_step", (2, 2, 2))


def test_weights_gathered_at_the_start_are_all_copied_before_the_first_product():
    """The six-layer MLP forward under Megatron pins on 8 devices: every other weight is gathered
    along a minor dimension at the start. XLA gathers all of them raw, copies all, and only then
    runs the first product, whose result meets every copy. The first product reads its copy at
    once, but unlike a value made by an equation (the GNN step above), made in the first half of
    that instant alone it missed the other copies (0.887 of compiled)."""
    mlp, make_mesh = _experts("mlp", "common.make_mesh")

    mesh = make_mesh((8,))
    _, r = _expert_plan_ratio(mlp.build(512, 512, 6, 4096, False, mesh), mesh, "Megatron")
    assert LOW <= r <= HIGH, r


def test_a_gathered_sequence_read_by_products_is_copied_once():
    """Sequence parallelism on 1x8 (Megatron pins): the normed activation is all-gathered along
    the sequence (a minor dimension) and read by the three QKV products, which all want it in
    one other order. XLA copies the raw gathered buffer straight into that order: one copy, not
    the gather's copy and then the products' (1.231 of compiled with both counted)."""
    (classic,) = _experts("workloads")
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    w = classic.transformer(seq=128)
    args = _concrete(w.args)
    plan = shardsat.saturate_and_extract(w.fn, mesh, *args, in_shardings=w.megatron(w.args[0], mesh),
                                         memory_limit=None, profile="h100")
    np.testing.assert_allclose(plan.jit()(*args), jax.jit(w.fn)(*args), rtol=2e-4, atol=1e-5)
    r = plan.cost.memory.total / plan.compiled_memory(*args)
    assert LOW <= r <= HIGH, r


def test_a_mask_read_through_a_slice_is_a_buffer_from_when_it_is_made():
    """GPT step, FSDP+TP on 4x2: the loss multiplies the log-probabilities by the one-hot labels
    read in another layout (a slice). XLA's simplifier makes `convert(b) * x` a select only where
    it sees the convert, so here the multiply stays, the library reduction takes it in, and the
    sliced one-hot is a buffer from the start (it reads only the targets) to the loss. Counted
    as the product at the loss alone, the estimate was 0.901 of compiled."""
    transformer, make_mesh = _experts("transformer", "common.make_mesh")
    mesh = make_mesh((4, 2))
    prob = transformer.build("gpt", mesh)
    args = _concrete(prob.args)
    plan = shardsat.saturate_and_extract(prob.fn, mesh, *args, state_argnums=prob.state_argnums, profile="h100",
                                         memory_limit=None, in_shardings=prob.experts["FSDP+TP"])
    want = jax.jit(prob.fn)(*args)
    got = plan.jit()(*_concrete(prob.args))  # the same values: the plan donates the state it is given
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5), got, want)
    r = plan.cost.memory.total / plan.compiled_memory(*prob.args)
    assert LOW <= r <= HIGH, r


def _resharded(kind: str, mesh: Any) -> tuple[Any, Any, Any]:
    """(fn, in sharding, out sharding): an array moved by one all-to-all over the model axis
    (pinned by sharding constraints), then read elementwise, by a product or by a reduction."""
    S = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
    wsc = jax.lax.with_sharding_constraint
    if kind == "computed_source_read_elementwise":
        return lambda x: jnp.sin(wsc(x * 2, S(None, "model"))), S("model", None), S(None, "model")
    if kind == "argument_read_by_a_product":
        return (lambda x: wsc(x, S(("data", "model"), None)) @ jnp.ones((x.shape[1], 256)),
                S("data", "model"), S(("data", "model"), None))
    return (lambda x: jnp.sum(jnp.exp(wsc(x, S(("data", "model"), None))), 1),
            S("data", "model"), S(("data", "model")))


@pytest.mark.parametrize("kind", ["computed_source_read_elementwise", "argument_read_by_a_product",
                                  "argument_read_by_a_reduction"])
def test_an_all_to_all_holds_its_source_slices_beside_its_pieces(kind):
    """XLA:CPU runs an array all-to-all as a tuple one: the source is copied into one slice per
    device (a computed source is computed straight into them), the pieces arrive as separate
    buffers and their readers concatenate them. Counted as the result alone, these estimates
    were 0.80, 0.67 and 0.67 of compiled: the slices were missing, and the output allocation
    held the whole result where XLA fits one slice in it."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    fn, ins, out = _resharded(kind, mesh)
    x = jax.random.uniform(jax.random.key(0), (2048, 2048))
    plan = shardsat.saturate_and_extract(fn, mesh, x, in_shardings=(ins,), out_shardings=out, memory_limit=None)
    np.testing.assert_allclose(plan.jit()(x), jax.jit(fn)(x), rtol=1e-4, atol=1e-4)
    assert any(c.kind == "all-to-all" for c in plan.cost.collectives), plan.cost.collectives
    r = plan.cost.memory.total / plan.compiled_memory(x)
    assert LOW <= r <= HIGH, r


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_logits_moved_by_an_all_to_all_hold_their_slices(shape):
    """The cross-entropy probe step on 2x4 and 1x8: the logits (a product's result, read again
    later) move from vocabulary to batch shards for the max by an all-to-all, whose source
    slices live beside the logits and the pieces: 0.836 and 0.806 of compiled without them."""
    _probe_in_band("softmax_xent_vocab", shape)


def test_transposed_logits_sent_by_an_all_to_all_are_sliced_beside_the_logits_gather():
    """The CLIP contrastive probe step on 2x4: the logits are all-gathered along their minor
    dimension for one cross-entropy's max and, transposed, sent by an all-to-all for the
    other's. The transpose is kept only for that max, which reads the pieces: XLA computes it
    inside the slicing fusions, run as soon as the logits exist, so the slices and the pieces
    live beside the raw gathered buffer and its copy. Sliced where the transpose sat in the
    program, after the first max, the estimate was 0.914 of compiled."""
    _probe_in_band("clip_contrastive", (2, 4))


def test_a_loops_stacked_output_is_a_buffer_from_the_start():
    """A scan's stacked output is a loop carry initialised by a broadcast of zeros, which reads
    nothing: XLA's breadth-first schedule makes it first, so it lives beside a sort computed
    before the loop. Counted from the loop's start, the estimate was 0.785 of compiled."""
    def f(x, w, v):
        t = jnp.sort(x @ w, axis=1)

        def body(c, _):
            c = jnp.sin(c) + 1.0
            return c, jnp.outer(c, v)
        c, ys = jax.lax.scan(body, t[:, 0] + t[:, -1], None, length=8)
        return jnp.sum(ys ** 2) + jnp.sum(c)

    x, w, v = _concrete((jax.ShapeDtypeStruct((2048, 512), jnp.float32), jax.ShapeDtypeStruct((512, 8192), jnp.float32),
                         jax.ShapeDtypeStruct((1024,), jnp.float32)))
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    plan = shardsat.saturate_and_extract(f, mesh, x, w, v, memory_limit=None)
    np.testing.assert_allclose(plan.jit()(x, w, v), jax.jit(f)(x, w, v), rtol=1e-4)
    r = plan.cost.memory.total / plan.compiled_memory(x, w, v)
    assert LOW <= r <= HIGH, r


def test_a_chain_of_all_to_alls_runs_hop_by_hop():
    """A tied-embedding training step on 2x2x2 with FSDP weights: the logits (vocabulary split
    over data and fsdp) reach batch shards for the max in three hops made in one instant: an
    all-to-all, a slice, an all-to-all. The first hop's source was never read there and its
    slices, pieces and concatenation were not counted (0.753 of compiled); every hop's buffers
    counted together gave 1.16; XLA runs the hops one by one, freeing each."""
    make_mesh, misc = _experts("common.make_mesh", "misc")
    mesh = make_mesh((2, 2, 2))
    prob = misc.build_emb(32768, 256, 1024, 1, 8, 128, mesh)
    args = _concrete(prob.args)
    want = jax.jit(prob.fn)(*args)
    plan = shardsat.saturate_and_extract(prob.fn, mesh, *args, profile="h100", state_argnums=prob.state_argnums,
                                         memory_limit=None, in_shardings=prob.experts["FSDP"])
    got = plan.jit()(*jax.tree.map(jnp.copy, args))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5), got, want)
    r = plan.cost.memory.total / plan.compiled_memory(*prob.args)
    assert LOW <= r <= HIGH, r


def test_a_reduce_scatter_holds_its_whole_buffer_on_cpu_only(monkeypatch):
    """XLA:CPU runs a reduce-scatter as an all-reduce of the whole buffer and a slice, so the
    estimate holds that buffer (it matches the compiled figure here); XLA:GPU and TPU have a
    native reduce-scatter, and a plan for a GPU mesh does not count it. The same plan, priced
    as if its devices were GPUs, is smaller by exactly the whole buffer."""
    import dataclasses

    from shardsat.egraph import layout

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x, w = jax.random.normal(jax.random.key(0), (2048, 1024)), jax.random.normal(jax.random.key(1), (1024, 2048))
    f = lambda x, w: jnp.sin(x @ w)  # noqa: E731
    kw = dict(in_shardings=(P(None, "data"), P("data", None)), out_shardings=P("data", "model"),
              memory_limit=None, profile="h100")
    cpu = shardsat.saturate_and_extract(f, mesh, x, w, **kw)
    np.testing.assert_allclose(cpu.jit()(x, w), jax.jit(f)(x, w), rtol=1e-4, atol=1e-4)
    assert cpu.predicted_collectives() == {"reduce-scatter": 1}
    r = cpu.cost.memory.total / cpu.compiled_memory(x, w)
    assert LOW <= r <= HIGH, r
    from_mesh = layout.MeshAxes.from_mesh
    monkeypatch.setattr(layout.MeshAxes, "from_mesh",
                        staticmethod(lambda m: dataclasses.replace(from_mesh(m), platform="gpu")))
    gpu = shardsat.saturate_and_extract(f, mesh, x, w, **kw)
    assert gpu.predicted_collectives() == {"reduce-scatter": 1}
    assert cpu.cost.memory.total - gpu.cost.memory.total == 2048 * 2048 * 4 // 4  # the partial sum's shard


def test_slices_of_slices_are_one_slice():
    """top_k and a sort of a replicated matrix on 2x2x2, the sort's operand split over all three
    axes: the plan slices the matrix in three local hops, which XLA composes into one slice of
    the argument (no hop is a buffer of its own). Every hop counted as a buffer gave 1.55."""
    _probe_in_band("topk_sort", (2, 2, 2))


@pytest.mark.parametrize("name,shape", [("conv_fwd", (2, 4)), ("attention_fwd", (2, 2, 2))])
def test_a_library_fusion_holds_no_temporaries(name, shape):
    """XLA:CPU grows a YNNPACK fusion from a large reduction through both convolutions of a conv
    net's forward pass (and its mean), or through attention's softmax and both products: the
    compiled program has no temporaries at all. Counting the conv outputs and the scores as
    buffers gave 3.37 and 1.44 of compiled."""
    _probe_in_band(name, shape)


def _node(kind: str, large: bool = True) -> library.Node:
    return library.Node(kind, large)


def test_a_library_fusion_grows_only_through_values_it_alone_reads():
    """Hand-made orders (positions, operands, users) for library.fused_inside: a dot, an exp and
    a sum (a chain: all but the sum's root inside); the exp also read by a later op (it stays a
    buffer, and so does the dot under it); the sum small (no fusion); an unsupported op (a
    select) between the dot and the sum; and a program output in the chain."""
    def run(nodes, operands, boundary=frozenset()):
        users = [[u for u, ops in enumerate(operands) if t in ops] for t in range(len(nodes))]
        fusions = library.fused_inside(nodes, operands, users, [None] * len(nodes), lambda t: t in boundary)
        return {t for ms, root in fusions for t in ms if t != root}

    dot, op, red = _node("dot"), _node("op"), _node("reduce")
    assert run([dot, op, red], [[], [0], [1]]) == {0, 1}
    assert run([dot, op, red, op], [[], [0], [1], [1]]) == set()
    assert run([dot, op, _node("reduce", large=False)], [[], [0], [1]]) == set()
    assert run([dot, _node(""), op, red], [[], [0], [1], [2]]) == {2}
    assert run([dot, op, red], [[], [0], [1]], boundary={0}) == {1}
    # down: the reduction's only reader (a divide, as in a mean) becomes the root
    assert run([dot, op, red, op], [[], [0], [1], [2]]) == {0, 1, 2}
    # a reduction read by a product (its own fusion, taken in going down), then a second chain
    # made earlier: the merged fusion's id is not given to the second one (it was, and the
    # first fusion was lost)
    assert run([dot, op, red, red, dot], [[], [0], [1], [], [3]]) == {0, 1, 3}


def test_library_products_exclude_what_ynnpack_does_not_run():
    """library.classify: a product whose left operand contracts a leading dimension (a weight
    gradient), a matrix-vector product and an NCHW convolution are not YNNPACK's; a [1024, 512]
    x [512, 1024] product and a 32-to-64-feature NHWC convolution are."""
    from jax import lax

    def node(fn, *shapes):
        jaxpr = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).jaxpr
        e = jaxpr.eqns[-1]
        eq = Eq(e.primitive.name, (0, 1), (2,), dict(e.params))
        return library.classify(eq, shapes, ["float32"] * 2, tuple(e.outvars[0].aval.shape), "float32", 8).kind

    assert node(lambda a, b: a @ b, (1024, 512), (512, 1024)) == "dot"
    assert node(lambda a, b: jnp.einsum("bi,bj->ij", a, b), (1024, 512), (1024, 512)) == ""
    assert node(lambda a, b: a @ b, (1024, 512), (512,)) == ""
    nhwc = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME",  # noqa: E731
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))
    nchw = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME")  # noqa: E731
    assert node(nhwc, (8, 32, 32, 32), (3, 3, 32, 64)) == "dot"
    assert node(nchw, (8, 32, 32, 32), (64, 32, 3, 3)) == ""


def test_library_fusions_are_cpu_only(monkeypatch):
    """GPU and TPU have no YNNPACK: the conv net's forward pass priced for GPU devices holds the
    first convolution's output (the ReLU writes into it), which XLA:CPU keeps inside its fusion."""
    import dataclasses

    from shardsat.egraph import layout

    (probe,) = _experts("memory_probe")
    fn, args = probe.PROGRAMS["conv_fwd"]()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    cpu = shardsat.saturate_and_extract(fn, mesh, *args, memory_limit=None)
    from_mesh = layout.MeshAxes.from_mesh
    monkeypatch.setattr(layout.MeshAxes, "from_mesh",
                        staticmethod(lambda m: dataclasses.replace(from_mesh(m), platform="gpu")))
    gpu = shardsat.saturate_and_extract(fn, mesh, *args, memory_limit=None)
    assert cpu.cost.memory.activations_peak == 0
    assert gpu.cost.memory.activations_peak >= 64 * 64 * 64 * 64 * 4 // 8  # conv1's output shard


def _attention(dtype: Any) -> tuple[Any, tuple[jax.Array, ...]]:
    k = jax.random.split(jax.random.key(0), 3)
    args = tuple(jax.random.normal(k[i], (8, 8, 512, 64)).astype(dtype) for i in range(3))

    def f(q, kk, v):
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, kk) / 8, -1), v)
    return f, args


def test_a_bf16_library_fusion_holds_no_temporaries():
    """bf16 attention on 2x4: XLA:CPU runs the bf16 products in f32 inside the one fusion and
    the compiled program has no temporaries, as in f32. Without bf16 in the fusion the estimate
    held the scores (1.42 of compiled)."""
    f, args = _attention(jnp.bfloat16)
    plan = shardsat.saturate_and_extract(f, jax.make_mesh((2, 4), ("data", "model")), *args, memory_limit=None)
    np.testing.assert_allclose(np.asarray(plan.jit()(*args), np.float32), np.asarray(jax.jit(f)(*args), np.float32),
                               rtol=2e-2, atol=2e-2)
    r = plan.cost.memory.total / plan.compiled_memory(*args)
    assert LOW <= r <= HIGH, r


def test_a_plan_that_splits_a_dimension_down_to_one_keeps_the_fusions_buffers():
    """Attention with the heads split over all 8 devices: one head per device, and XLA drops
    that dimension from its products with reshapes it lays out as copies, which split the
    library fusion (its compiled program holds the scores twice, 16 MiB). The plan's estimate
    keeps the program's buffers there (the scores, 8 MiB), not the fusion's none: a known low
    estimate, but not the 0 the fusion alone would give."""
    f, args = _attention(jnp.float32)
    heads = P(None, ("data", "model"))
    plan = shardsat.saturate_and_extract(f, jax.make_mesh((2, 4), ("data", "model")), *args, memory_limit=None,
                                         in_shardings=(heads,) * 3)
    np.testing.assert_allclose(plan.jit()(*args), jax.jit(f)(*args), rtol=2e-4, atol=1e-5)
    assert plan.cost.memory.activations_peak >= 8 * 8 * 512 * 512 * 4 // 8  # the scores' shard


def _gelu_step(w: jax.Array, x: jax.Array) -> jax.Array:
    return w - 0.1 * jax.grad(lambda w: jnp.mean(jax.nn.gelu(x @ w) ** 2))(w)


def test_an_expensive_op_all_of_whose_readers_are_one_kernel_is_no_buffer():
    """The gelu's tanh is read by several ops of its gradient, all fused into the one kernel that
    writes the gradient: XLA fuses it there (consumers first) instead of storing it, which the
    model did for any expensive op with more than one reader (36 MiB against 28 compiled)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    w = jax.random.normal(jax.random.key(0), (1024, 4096)) * 0.01
    x = jax.random.normal(jax.random.key(1), (4096, 1024))
    plan = shardsat.saturate_and_extract(_gelu_step, mesh, w, x, memory_limit=None)
    np.testing.assert_allclose(plan.jit()(w, x), jax.jit(_gelu_step)(w, x), rtol=1e-5, atol=1e-6)
    r = plan.cost.memory.total / plan.compiled_memory(w, x)
    assert LOW <= r <= HIGH, r


@pytest.mark.parametrize("shape", [(2, 4), (2, 2, 2), (1, 8)])
def test_a_layer_norm_gelu_step_matches_compiled(shape):
    """A layer norm before a gelu layer, trained with Adam (1.40 of compiled on 2x4 and 1x8, 0.96
    on 2x2x2). Where the gradient's kernel holds the gelu's tanh, XLA writes it once and the
    weight gradient's transposed copy reads it; where the input gradient's product reads it
    through a reshape (no library fusion takes it), XLA computes it again in the copy and stores
    the tanh. The library fusion of the input gradient, its gain's gradient and their reduction
    is one instruction of the breadth-first schedule, and reads the normalised input as a buffer.
    The combined all-reduce of both gradients on 1x8 runs after the weight gradient's product."""
    _probe_in_band("layernorm_gelu_train", shape)


def test_dead_code_is_left_out_of_the_schedule():
    """jax.grad computes the loss it never returns; XLA removes that reduction before it
    schedules, and so does the model's timeline."""
    w, x = jnp.ones((64, 128)), jnp.ones((32, 64))
    prog = trace(_gelu_step, (w, x))
    dead = deadcode.dead_equations(prog, lambda v: v)
    names = sorted(e.name for e in prog.equations if id(e) in dead)
    assert names and "reduce_sum" in names and "dot_general" not in names, names


def test_a_loop_carry_read_unordered_with_its_update_is_copied_in_the_body():
    """Three SGD steps in a fori_loop on 1x8: in the loop's body the input gradient's product
    reads the second weight and nothing orders it before the weight's update, which XLA writes
    into the loop state's buffer. Copy insertion copies the old weight as the body starts
    (`copy.10` in the XLA:CPU dump); the first weight, read last by its own update, is not
    copied. Without the copy the estimate was 0.935 of compiled."""
    _probe_in_band("fori_sgd_steps", (1, 8))


def test_a_loop_state_copied_in_the_body_is_free_until_the_new_value_is_written():
    """SGD steps of a four-layer MLP in a fori_loop on 1x8, whose result a loss reads (the
    state is not an output): XLA copies three of the four weights as the body starts and its
    heap reuses their state buffers until the updates write them. Held as well as copied, the
    estimate's temporaries were 13.0 MiB against XLA's 11.5 (1.086 of compiled in total)."""
    (probe,) = _experts("memory_probe")
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    fn, abstract = probe.PROGRAMS["inner_sgd_then_eval"]()
    args = _concrete(abstract)
    plan = shardsat.saturate_and_extract(fn, mesh, *args, memory_limit=None)
    _close(plan.jit()(*args), jax.jit(fn)(*args))
    temp = plan.jit().lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert abs(plan.cost.memory.activations_peak / temp - 1) <= 0.02, (plan.cost.memory.activations_peak, temp)


@pytest.mark.parametrize("shape", [(2, 4), (2, 2, 2)])
def test_a_branch_result_and_what_it_takes_over_live_in_the_conditionals_buffer(shape):
    """A branch's root is the conditional's result buffer, and an elementwise root takes over
    its dying operand: in `(x @ w.T) * 2` XLA:CPU writes the product into the conditional's
    output allocation and scales it there (one `ynn_fusion` and `broadcast_multiply_fusion`
    buffer). Counted beside the conditional's buffer, the product and the root read 1.154
    (2x4) and 1.250 (2x2x2) of the compiled figure; XLA's temps are the all-to-all's pieces."""
    def f(w, x, flag):
        return jax.lax.cond(flag > 0, lambda x: jnp.tanh(x @ w), lambda x: (x @ w.T) * 2, x)

    _branch_plan_matches_compiled(f, shape, 0)


def _branch_plan_matches_compiled(f: Any, shape: tuple[int, ...], index: int) -> None:
    """Plan `f(w, x, index)` (w 1024x1024, x 4096x1024) freely on `shape`: its numbers match
    jax.jit's, its temps XLA's (to 64 KiB) and its total is in the band of compiled."""
    mesh = jax.make_mesh(shape, ("data", "model") if len(shape) == 2 else ("data", "fsdp", "model"))
    args = (jax.random.normal(jax.random.key(0), (1024, 1024)) / 32,
            jax.random.normal(jax.random.key(1), (4096, 1024)), jnp.int32(index))
    plan = shardsat.saturate_and_extract(f, mesh, *args, memory_limit=None)
    check_plan(plan, *args, rtol=1e-4)
    ma = plan.jit().lower(*args).compile().memory_analysis()
    assert abs(plan.cost.memory.activations_peak - ma.temp_size_in_bytes) <= 2**16
    r = plan.cost.memory.total / plan.compiled_memory(*args)
    assert LOW <= r <= HIGH, r


def test_memory_peak_reads_both_peaks(tmp_path):
    """benchmarks/memory_peak.py, the side-by-side view of the two peaks: XLA's temp heap read
    from a dump is memory_analysis()'s temp size, and the values live at its peak are the
    product held for the second one (2 MiB); the estimate's peak rebuilt from a plan is the
    plan's own figure."""
    (mp,) = _experts("memory_peak")
    x, w = jnp.ones((512, 256)), jnp.ones((256, 1024))
    compiled = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T).lower(x, w).compile(compiler_options={
        "xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "^$"})
    peak = mp.xla_peak(tmp_path)
    assert peak.heap == compiled.memory_analysis().temp_size_in_bytes
    assert peak.live == peak.heap  # no holes here: the product and the tanh written into it
    assert any(v.shape.startswith("f32[512,1024]") and v.size == 2**21 for v in peak.values)

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    plan = shardsat.saturate_and_extract(lambda x, w: jnp.tanh(x @ w) @ w.T, mesh, x, w, memory_limit=None)
    check_plan(plan, x, w, rtol=1e-4)
    est, where, rows = mp.model_peak(plan)
    assert est == plan.cost.memory.activations_peak and "position" in where
    assert sum(size for size, _ in rows) <= est


def test_a_branch_returning_an_operand_in_another_layout_holds_the_resharded_copy():
    """`lax.switch` whose third branch returns its operand: on 1x8 the plan keeps `x`
    replicated and the conditional's result split, so that branch returns `x` sliced. XLA:CPU
    slices it before the conditional and holds the slice until the conditional ends (its
    operand tuple), as it does the weight's slices the other branches read. The model read no
    operand of the conditional's merge, so the slice was missing: 0.920 of the compiled
    figure."""
    def f(w, x, i):
        return jax.lax.switch(i, [lambda x: jnp.tanh(x @ w), lambda x: (x @ w.T) * 2, lambda x: x], x)

    _branch_plan_matches_compiled(f, (1, 8), 2)


@pytest.mark.xfail(strict=True, reason="known high estimate (1.111): two argument all-to-alls at the start; XLA runs "
                   "one after the other, freeing the first's slices before the second's pieces arrive; the model "
                   "holds both at once (sequencing them in chains.py read 0.889)")
def test_two_argument_all_to_alls_before_a_conditional_run_one_after_the_other():
    """A cond with two results on 2x4 (benchmarks/memory_probe.py): both arguments are
    resharded by all-to-alls before the conditional (benchmarks/memory_peak.py shows XLA's
    heap at 5.5 MiB, the estimate's at 7.0)."""
    _probe_in_band("cond_two_results", (2, 4))


def test_an_embedding_steps_input_gradient_runs_before_the_weight_gradient():
    """An embedding lookup feeding a product, SGD, on 2x2x2 (benchmarks/memory_probe.py): XLA
    runs the input gradient's product before the weight gradient's (which waits for its
    operand's transposed copy), so the gathered activations die early in XLA; the model's
    order was the other way round and read 0.894 of compiled."""
    _probe_in_band("embed_scatter_train", (2, 2, 2))


def test_an_all_to_alls_pieces_read_by_two_products_are_assembled_twice():
    """A top-2 MoE step on 2x4 (benchmarks/probe_models.py): `copy_bitcast_fusion.3` and
    `concatenate_bitcast_fusion.1`, 4 MiB each, with the pieces at XLA's peak. XLA assembles
    an all-to-all's pieces twice, a transposed copy for the first product and, beside it, a
    concatenation for a later one; the pieces die there. The estimate read 0.926 until fused
    equations were placed with their readers' kernels (0.975), and 0.919 once the relu the
    all-to-all sends was no buffer (XLA computes it in the slices) while the pieces, held until
    the second product, fitted in output allocations where one 4 MiB buffer does not."""
    _probe_in_band("topk_moe_train", (2, 4))
