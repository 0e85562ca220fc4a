"""Plan a two-layer MLP on a 2x4 mesh and compare it with hand-written plans.

Run with `make demo`. Uses 8 simulated CPU devices, so it runs anywhere; the predicted times are
for the H100 profile.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import shardsat


def mlp(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def main() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    # Big weights, small batch: a tensor-parallel regime. Planning needs only shapes.
    params = {
        "w1": jax.ShapeDtypeStruct((8192, 32768), jnp.float32),
        "w2": jax.ShapeDtypeStruct((32768, 8192), jnp.float32),
    }
    x = jax.ShapeDtypeStruct((8, 8192), jnp.float32)
    plan = shardsat.saturate_and_extract(mlp, mesh, params, x, profile="h100")
    print(plan.explain())

    # Hand-written baselines, costed by the same model: everything on one device, and data
    # parallel (weights replicated, the batch split over every mesh axis).
    one = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    replicated = shardsat.saturate_and_extract(mlp, one, params, x, profile="h100")
    dp = shardsat.saturate_and_extract(
        mlp, mesh, params, x, profile="h100",
        in_shardings=({"w1": P(), "w2": P()}, P(("data", "model"))),
    )
    print("\nPredicted step time (H100 profile)")
    for name, p in (("shardsat", plan), ("replicated (1 device)", replicated), ("data parallel", dp)):
        print(f"  {name:<22} {p.cost.total_s * 1e6:9.1f} us   {len(p.cost.collectives)} collectives")

    # The same plan runs: small arrays, same structure, checked against the unsharded function.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    small = {"w1": jax.random.normal(k1, (256, 1024)), "w2": jax.random.normal(k2, (1024, 256))}
    xs = jax.random.normal(k3, (8, 256))
    small_plan = shardsat.saturate_and_extract(mlp, mesh, small, xs, profile="h100")
    y = small_plan.jit()(small, xs)
    want = np.asarray(mlp(small, xs))
    err = float(np.max(np.abs(np.asarray(y) - want)) / np.max(np.abs(want)))
    print(f"\nsmall run: output sharded as {y.sharding.spec}, relative error vs unsharded {err:.1e}")


if __name__ == "__main__":
    main()
