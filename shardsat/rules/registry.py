"""The signature registry: for each primitive a builder, a listed reason it is unsupported, or
nothing (unknown). Three outcomes kept apart, as in Shardy's op_sharding_rule_registry."""

from __future__ import annotations

from . import primitives as p

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
        "rev": p.rev,
        "sort": p.sort,
        "top_k": p.top_k,
        "split": p.split,
        "clamp": p.clamp,
        "bitcast_convert_type": p.bitcast_convert_type,
        # PRNG key plumbing and bit generation: every device draws the same (replicated) bits,
        # which consumers slice for free. Correct everywhere; sharded generation is future work.
        "random_bits": p.replicated,
        "random_seed": p.replicated,
        "random_wrap": p.replicated,
        "random_unwrap": p.replicated,
        "random_split": p.replicated,
        "random_fold_in": p.replicated,
    }
)

# Deliberately unsupported, with the reason given to the user.
UNSUPPORTED: dict[str, str] = {
    "while": "loops are not partitioned yet; its body would need a loop-invariant layout",
    "cond": "branches are not partitioned yet",
    "scan": "scans are not partitioned yet; unroll the loop or use fallback='replicate'",
    "shard_map": "the function is already manually partitioned",
    "xla_pmap": "pmap is already manually partitioned",
    "custom_partitioning": "custom_partitioning rules are not read yet; register a signature",
    "pure_callback": "host callbacks run on one device",
    "io_callback": "host callbacks run on one device",
    "debug_callback": "host callbacks run on one device",
    "rng_bit_generator": "stateful RNG is not partitioned yet",
    "gather": "gather sharding rules are not implemented yet",
    "scatter": "scatter sharding rules are not implemented yet",
    "scatter-add": "scatter sharding rules are not implemented yet",
    "scatter_add": "scatter sharding rules are not implemented yet",
    "conv_general_dilated": "convolution sharding rules are not implemented yet",
    "reduce_window_sum": "windowed reductions are not implemented yet",
    "reduce_window_max": "windowed reductions are not implemented yet",
    "reduce_window": "windowed reductions are not implemented yet",
    "select_and_scatter_add": "windowed reductions are not implemented yet",
    "select_and_gather_add": "windowed reductions are not implemented yet",
}


def register(name: str, builder: p.Builder) -> None:
    """Register (or replace) the signature builder of a primitive."""
    SIGNATURES[name] = builder
    UNSUPPORTED.pop(name, None)
