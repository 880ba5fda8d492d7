"""The summary build: the fp64/fp32 reference (`reference.py`), the packed row format (`packing.py`) and the Triton kernel (`kernel.py`)."""
