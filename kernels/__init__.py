"""The Locks method: torch reference (the specification), Triton kernels, and the vLLM backend."""
