"""Pallas (Mosaic GPU) kernels for coat-jax, one kernel family per module, each with a jnp
reference beside it. Kernels run on Hopper GPUs; everywhere else the references run."""
