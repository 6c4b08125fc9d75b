"""Layer 2, ops and optimizer: differentiable FP8 ops (the precision flow) and the plain ops
beside them, the optax transformations with FP8 state and their fused update, and sharding
specs. Builds on the core (layer 0) and the kernels (``pallas_kernels``, layer 1)."""
