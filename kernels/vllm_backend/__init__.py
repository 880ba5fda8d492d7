"""Out-of-tree vLLM 0.24 attention backend for Locks (registered under the CUSTOM slot)."""
