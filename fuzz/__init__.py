"""shardsat's own fuzz campaign: random realistic JAX programs, planned and checked.

`fuzz.programs.make_program(seed)` builds a program (model code at the jax.numpy / lax / optax
level, composed from the building blocks of `fuzz.blocks`) with example arguments and random
planning options; `fuzz.execute.run_case` plans it, runs the plan and compares it with `jax.jit`;
`python -m fuzz` runs a campaign of them in worker processes and prints outcome counts and the
reproducer of every failure. Importing this package does not import jax: the campaign's parent
process must not (its workers set XLA_FLAGS for 8 simulated CPU devices before they do).
"""
