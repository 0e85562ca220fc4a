"""A fixed-seed slice of the fuzz campaign (fuzz/), run in-process: every program of the slice
must plan and match jax.jit (outcome ok or fallback).

The slice is 21 of seeds 500-527 and three cheap seeds from elsewhere, not the ~100 one would
like, because a program costs 1-18 s in-process on a 2-core box (trace, plan with the layout
families, two compiles, run on 8 simulated devices) and the suite must stay within CI's budget.
The range was picked from a 600-program campaign for its spread (over 90 block kinds, all three
families, training steps, Auto, Explicit and mixed meshes, most failure classes). The seven left
out (506, 516, 520, 521, 523, 524, 525) took 101 s of the range's 170 on such a box; seeds 5, 27
and 555 (14 s) draw most of the block kinds only they drew (depthwise and strided convolutions,
wrap padding, AdamW and hand-written update steps, argsort with take_along_axis, a one-row embedding). What
only the campaign draws now: mixed-precision casts, a raw head, optax's SGD, dilated NCHW
convolutions. `make fuzz` runs the campaign proper (1000 programs in worker processes, with
timeouts) before a change to shardsat/ lands.

Every seed of the slice must pass: the campaign's defect classes found in it (gather over size-1
dims, Explicit meshes under jax.set_mesh, state ties, zero-size reshapes, dropped callbacks,
cond / debug_callback without rules, slow exact extraction) are fixed, each with a regression
test of its own (test_robustness.py, test_control_flow.py, test_validation.py).
"""

from __future__ import annotations

import pytest

from fuzz.builder import Builder
from fuzz.execute import run_case
from fuzz.outcome import PASSING
from fuzz.programs import build, make_program

FIRST_SEED = 500
SLICE_SIZE = 28
SLOW_SEEDS = {506, 516, 520, 521, 523, 524, 525}  # see the module docstring
COVER_SEEDS = (5, 27, 555)  # block kinds only the slow seeds drew
# programs a campaign failed on, kept after their fix: a folded program's stale producer index
# (269, 306: the memory model crashed) and a layout family whose pins leave an output no layout
# (451: NoPlanError from the family's completion) or pins a group its problem pins otherwise (829:
# KeyError releasing it), all found at f9f27ae; a greedy start whose consumers demand pending sums
# of one value over other axes (549: the estimate's start; 464: a pressure restart's), found at 9ba866c
REGRESSION_SEEDS = (269, 306, 451, 829, 464, 549)
SEEDS = [*(s for s in range(FIRST_SEED, FIRST_SEED + SLICE_SIZE) if s not in SLOW_SEEDS), *COVER_SEEDS,
         *REGRESSION_SEEDS]


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_program_plans_and_matches(seed: int) -> None:
    out = run_case(seed)
    assert out.outcome in PASSING, (
        f"fuzz seed {seed} ({out.mesh}; {out.options}): {out.outcome}: {out.reason}\n"
        f"at {out.location or out.phase}; reproduce with: {out.reproducer()}\n{out.detail[-4000:]}"
    )


def test_programs_are_reproducible_from_their_seed() -> None:
    """The same seed gives the same source, options and argument values."""
    import numpy as np

    for seed in (3, 17):
        a, b = make_program(seed), make_program(seed)
        assert a.source == b.source and a.options.summary() == b.options.summary()
        for x, y in zip(a.example_args(), b.example_args(), strict=True):
            for u, v in zip(_leaves(x), _leaves(y), strict=True):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _leaves(tree: object) -> list[object]:
    import jax

    return [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for x in jax.tree.leaves(tree)]


# Block kinds the generator must draw within its first 400 seeds (the brief's list).
REQUIRED_TAGS = {
    "mlp", "swiglu", "geglu", "layer-norm", "rms-norm", "batch-norm", "cross-entropy", "cross-entropy-one-hot",
    "cross-entropy-optax", "attention", "rope", "embed-index", "embed-take", "embed-one-row", "embed-one-hot",
    "moe-topk-scatter-add", "moe-topk-gather", "moe-gather-scatter-max", "moe-switch-capacity", "segment_sum",
    "conv-NHWC", "conv-NCHW", "max-pool-reduce-window", "avg-pool-reduce-window", "cumsum", "sort",
    "argsort-take-along-axis", "where", "split-concatenate", "stack", "reshape-transpose-chain", "scan-layers",
    "scan-layers-dropped-outputs", "vmap", "checkpoint", "cond", "switch", "while-dynamic-trip-count",
    "while-data-dependent", "fori-static", "fori-dynamic", "dropout-random", "debug-callback", "debug-print",
    "int-bool-outputs", "return-none", "return-constants", "return-nested", "dtype-bfloat16", "dtype-float16",
    "train-sgd", "train-adam", "train-adamw", "train-clip_adam", "train-apply_if_finite", "train-multisteps",
    "unrolled-layers", "family-data", "family-image",
    *(f"pad-{m}" for m in ("constant", "edge", "linear_ramp", "maximum", "mean", "median", "minimum", "reflect",
                           "symmetric", "wrap", "empty")),
}


def test_generator_covers_the_block_kinds() -> None:
    """Drawing programs (no tracing) over 400 seeds meets every block kind at least once."""
    seen: set[str] = set()
    for seed in range(400):
        b: Builder = build(seed)[0]
        seen.update(b.tags)
    assert not REQUIRED_TAGS - seen, f"never drawn: {sorted(REQUIRED_TAGS - seen)}"


def test_compare_flags_wrong_numbers_structure_and_dtypes() -> None:
    """The campaign's comparison (not the planner) is what decides `mismatch`: it must flag a
    1% error in float32, any integer difference, a dtype change and another structure, and
    accept rounding noise and equal NaNs."""
    import numpy as np

    from fuzz.execute import compare

    want = {"f": np.linspace(-1, 1, 8, dtype=np.float32), "i": np.arange(4), "n": np.array([np.nan], np.float32)}
    paths = ["['f']", "['i']", "['n']"]
    assert not compare(want, dict(want), paths, "float32")
    assert not compare(want, {**want, "f": want["f"] * (1 + 1e-6)}, paths, "float32")
    assert compare(want, {**want, "f": want["f"] * 1.01}, paths, "float32")
    assert not compare(want, {**want, "f": want["f"] * 1.01}, paths, "bfloat16")
    assert compare(want, {**want, "i": want["i"] + (want["i"] == 3)}, paths, "float32")
    assert compare(want, {**want, "i": want["i"].astype(np.int8)}, paths, "float32")
    assert compare(want, (want["f"],), paths, "float32")


def test_a_mismatch_within_the_programs_own_conditioning_is_not_a_mismatch() -> None:
    """Rounding-size changes of the inputs move an ill-conditioned program's outputs (sin(1e8 x))
    by O(1): a plan that differs from jax.jit by less than that has no better answer to give.
    A well-conditioned program (2 x) differing as much is still a mismatch. Found in the campaign:
    seeds 582 (gradients of 1e11 through switch-MoE layers) and 814 (jax.jit alone, committed or
    not, gives Adafactor moments 40% apart)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fuzz.execute import _within_conditioning

    case = make_program(3)
    mesh = case.options.mesh()
    x = (jnp.linspace(1.0, 2.0, 64, dtype=jnp.float32),)
    case.example_args = lambda: x  # type: ignore[method-assign]
    case.options.placement = "none"
    case.namespace["program"] = lambda x: jnp.sin(x * 1e8)
    want = jax.jit(case.fn)(*x)
    assert _within_conditioning(case, mesh, want, np.asarray(want) + 0.01, "float32")
    case.namespace["program"] = lambda x: 2 * x
    want = jax.jit(case.fn)(*x)
    assert not _within_conditioning(case, mesh, want, np.asarray(want) * (1 + 1e-3), "float32")
    assert _within_conditioning(case, mesh, want, np.asarray(want), "float32")


def test_a_lower_bound_above_the_plan_is_a_mismatch(monkeypatch) -> None:
    """The campaign checks the plan's report too: a lower bound above the plan's own cost is a
    false claim (extract/splitbound.py's multipliers must keep it below every plan)."""
    import shardsat
    from fuzz import execute

    real = shardsat.saturate_and_extract

    def inflated(*args, **kwargs):
        plan = real(*args, **kwargs)
        plan.report.lower_bound_s = plan.cost.total_s * 1.01
        return plan

    monkeypatch.setattr(execute.shardsat, "saturate_and_extract", inflated)
    out = run_case(FIRST_SEED)
    assert out.outcome == "mismatch" and "lower bound" in out.reason, (out.outcome, out.reason)


@pytest.mark.parametrize("seed", [204, 402])
def test_agreement_prices_keep_the_bound_below_the_plan(seed) -> None:
    """Fuzz seeds 204 (1x8) and 402 (2x2x2) at 49d31b0: a round whose plan already agreed left a
    subgradient of rounding noise (1e-17); Polyak's step divided by its square moved prices
    by 1e7 s and the bound read 1e8 s above a 2 us plan. Noise now counts as agreement and no
    step moves a price by more than the plan's cost (extract/agreement.py)."""
    out = run_case(seed)
    assert out.outcome in PASSING, (out.outcome, out.reason)
