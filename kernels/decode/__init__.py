"""Sparse paged decode: the reference (`reference.py`) and the Triton split-K kernel with its merge (`kernel.py`)."""
