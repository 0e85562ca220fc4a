"""Teach shardsat a primitive it does not know, check the rule, and plan a model that uses it.

A fused RMSNorm made with jax.extend: normalising over the feature dimension `d` needs all of
`d` on one device, so `d` is a need-replication factor; batch and sequence shard freely.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

import shardsat
from shardsat.testing import RuleCheckError, check_plan, check_rule

rms_norm_p = Primitive("example_rms_norm")


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


rms_norm_p.def_impl(_rms_norm)
rms_norm_p.def_abstract_eval(lambda x, scale: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(rms_norm_p, mlir.lower_fun(_rms_norm, multiple_results=False))


def model(p, x):
    h = rms_norm_p.bind(x, p["scale"])
    return jnp.tanh(h @ p["w1"]) @ p["w2"]


def main() -> None:
    # A wrong rule (d declared pass-through) is caught with a small counterexample.
    wrong = shardsat.register_signature(rms_norm_p, "b s d, d -> b s d")
    try:
        check_rule(wrong, max_examples=4, max_strategies=4, meshes=((2, 4),), sizes=(2, 8))
    except RuleCheckError as e:
        print("wrong rule caught:", str(e).splitlines()[1].strip()[:120])
    # The right rule passes and is what the planner uses.
    rule = shardsat.register_signature(rms_norm_p, "b s d, d -> b s d", need_replication_factors=("d",))
    check_rule(rule, max_examples=4, max_strategies=4, meshes=((2, 4),), sizes=(2, 8))
    print("rule checked:", rule.spec, "need replication:", sorted(rule.need_replication))

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    k = jax.random.split(jax.random.key(0), 4)
    p = {"scale": jnp.ones(256), "w1": jax.random.normal(k[0], (256, 1024)) * 0.05,
         "w2": jax.random.normal(k[1], (1024, 256)) * 0.05}
    x = jax.random.normal(k[2], (16, 32, 256))
    plan = shardsat.saturate_and_extract(model, mesh, p, x, profile="h100")
    check_plan(plan, p, x)
    print("plan matches the unsharded model;", plan)


if __name__ == "__main__":
    main()
