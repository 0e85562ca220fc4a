"""A small MLP for the command line:

    python -m shardsat plan examples/cli_mlp.py:mlp --mesh data=2,model=4 --html plan.html

The CLI calls `example_args()` for the arguments to plan for; ShapeDtypeStructs are enough, since
planning needs only shapes and dtypes (nothing is allocated).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

D_IN, D_HIDDEN, D_OUT, BATCH = 512, 2048, 512, 64


def mlp(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """Two dense layers with a tanh between them."""
    for i, layer in enumerate(params["layers"]):
        x = x @ layer["w"] + layer["b"]
        if i + 1 < len(params["layers"]):
            x = jnp.tanh(x)
    return x


def example_args() -> tuple[Any, ...]:
    """(params, x) as shapes only: parameters grouped per layer, then the batch."""
    f32 = jnp.float32
    params = {
        "layers": [
            {"w": jax.ShapeDtypeStruct((D_IN, D_HIDDEN), f32), "b": jax.ShapeDtypeStruct((D_HIDDEN,), f32)},
            {"w": jax.ShapeDtypeStruct((D_HIDDEN, D_OUT), f32), "b": jax.ShapeDtypeStruct((D_OUT,), f32)},
        ]
    }
    return params, jax.ShapeDtypeStruct((BATCH, D_IN), f32)
