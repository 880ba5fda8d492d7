"""Triton kernels of Locks; each names its torch reference and is tested against it (TRITON_INTERPRET=1 on CPU)."""
