"""Test set-up: 8 simulated CPU devices (set before jax is imported) and hypothesis profiles."""

import os

# LLVM's optimisation level 0 halves XLA:CPU's compile time, most of many tests' time (a 1-layer
# GPT step: 9.4 -> 4.7 s for two compiles); buffer assignment, and so memory_analysis(), is the
# HLO's and does not change with it (the same bytes to the byte on test_memory's steps)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import jax
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; jax was imported before conftest"
