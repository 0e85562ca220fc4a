"""The signature registry: for each primitive a builder, a listed reason it is unsupported, or
nothing (unknown). Three outcomes kept apart, as in Shardy's op_sharding_rule_registry."""

from __future__ import annotations

from . import indexing as ix
from . import primitives as p
from . import windowed as w

SIGNATURES: dict[str, p.Builder] = {name: p.elementwise for name in p.ELEMENTWISE}
SIGNATURES.update(
    {
        "dot_general": p.dot_general,
        "reduce_sum": p.reduce_sum,
        "reduce_max": p.reduce_other,
        "reduce_min": p.reduce_other,
        "reduce_prod": p.reduce_other,
        "reduce_and": p.reduce_other,
        "reduce_or": p.reduce_other,
        "reduce_xor": p.reduce_other,
        "argmax": p.argminmax,
        "argmin": p.argminmax,
        "cumsum": p.cumulative,
        "cumprod": p.cumulative,
        "cummax": p.cumulative,
        "cummin": p.cumulative,
        "cumlogsumexp": p.cumulative,
        "broadcast_in_dim": p.broadcast_in_dim,
        "transpose": p.transpose,
        "reshape": p.reshape,
        "squeeze": p.squeeze,
        "expand_dims": p.expand_dims,
        "iota": p.iota,
        "slice": p.slice_,
        "pad": p.pad,
        "dynamic_slice": p.dynamic_slice,
        "dynamic_update_slice": p.dynamic_update_slice,
        "concatenate": p.concatenate,
        "stack": p.stack,
        "unstack": p.unstack,
        "tile": p.tile,
        "optimization_barrier": p.optimization_barrier,
        "rev": p.rev,
        "sort": p.sort,
        "top_k": p.top_k,
        "split": p.split,
        "clamp": p.clamp,
        "bitcast_convert_type": p.bitcast_convert_type,
        "reshard": p.elementwise,  # a user's layout pin (rules/apply.py keeps its layout)
        # uninitialised buffers (scan's transpose makes them): any layout, nothing to compute
        "empty": p.elementwise,
        "empty2": p.elementwise,
        # lax.scan plumbing: the body is planned once, between these pseudo-equations
        "scan_slice": p.scan_slice,
        "scan_stack": p.scan_stack,
        "scan_final": p.elementwise,
        "cond_merge": p.cond_merge,
        # PRNG key plumbing and bit generation: every device draws the same (replicated) bits,
        # which consumers slice for free. Correct everywhere; sharded generation is future work.
        "random_bits": p.replicated,
        "random_seed": p.replicated,
        "random_wrap": p.replicated,
        "random_unwrap": p.replicated,
        "random_split": p.replicated,
        "random_fold_in": p.replicated,
        # indexing.py: gather and the scatter family
        "gather": ix.gather,
        **{name: ix.scatter for name in ix.SCATTERS},
        # windowed.py: convolutions and windowed reductions
        "conv_general_dilated": w.conv_general_dilated,
        "reduce_window_sum": w.reduce_window_sum,
        "reduce_window_max": w.reduce_window_other,
        "reduce_window_min": w.reduce_window_other,
        "reduce_window": w.reduce_window_other,
        "select_and_scatter_add": w.select_and_scatter_add,
        "select_and_scatter": w.select_and_scatter,
        "select_and_gather_add": w.select_and_gather_add,
    }
)

# Deliberately unsupported, with the reason given to the user. (custom_partitioning has a rule
# per function, not per primitive: rules/custom.py.)
UNSUPPORTED: dict[str, str] = {
    "while": "a loop with side effects and no results runs as one replicated equation",
    "cond": "a cond with side effects and no results runs as one replicated equation",
    "shard_map": "the function is already manually partitioned",
    "xla_pmap": "pmap is already manually partitioned",
    "rng_bit_generator": "stateful RNG is not partitioned yet",
}
# Host callbacks see whole arrays: their operands and results are replicated by rule (not by
# fallback: there is nothing better to plan for them).
SIGNATURES.update({name: p.replicated for name in ("pure_callback", "io_callback", "debug_callback", "debug_print")})


def register(name: str, builder: p.Builder) -> None:
    """Register (or replace) the signature builder of a primitive."""
    SIGNATURES[name] = builder
    UNSUPPORTED.pop(name, None)
