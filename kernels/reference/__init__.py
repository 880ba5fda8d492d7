"""Pure-torch reference of Locks (locks.md). Device-agnostic; fp32/fp64. Fast kernels are tested against it."""
