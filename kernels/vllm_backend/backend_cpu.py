"""The Locks backend on vLLM's CPU platform (tests and CI), opt-in with LOCKS_VLLM_CPU=1.

The CPU platform ignores a requested backend and always resolves CPU_ATTN, so the plugin
overrides that enum member with these subclasses. Prefill and padding run CPU_ATTN's own kernel;
decode rows run the Locks sequence through the reference ops. CPU_ATTN's cache is
[num_blocks, Hkv, block, 2d]; with block_size=16 (ISA "vec16") each (block, head) holds K
transposed ([d, 16]) and then V ([16, d]), which we view as the FA-style [num_blocks, 16, Hkv, d]
without copying. Pass block_size=16; other block sizes pack 16-token pages differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ..config import PAGE_SIZE, ConfigError
from .core import LocksBuilderMixin, LocksImplMixin, LocksStep


@dataclass
class LocksCpuMetadata(CPUAttentionMetadata):
    locks: LocksStep | None = None


def cpu_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU_ATTN cache [NB, Hkv, 16, 2d] (vec16 layout) -> (k, v) views [NB, 16, Hkv, d]."""
    num_blocks, num_kv_heads, block, two_d = kv_cache.shape
    d = two_d // 2
    head_stride, block_stride = block * two_d, num_kv_heads * block * two_d
    offset = kv_cache.storage_offset()
    k = kv_cache.as_strided((num_blocks, block, num_kv_heads, d), (block_stride, 1, head_stride, block), offset)
    v = kv_cache.as_strided((num_blocks, block, num_kv_heads, d), (block_stride, d, head_stride, 1), offset + block * d)
    return k, v


class LocksCpuBuilder(LocksBuilderMixin, CPUAttentionMetadataBuilder):
    locks_metadata_cls = LocksCpuMetadata
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.block_size != PAGE_SIZE or self.isa != "vec16":
            raise ConfigError(
                f"the Locks CPU backend needs block_size={PAGE_SIZE} (got {kv_cache_spec.block_size}, ISA "
                f"{self.isa!r}); pass block_size={PAGE_SIZE} to LLM/EngineArgs"
            )
        self._locks_init(kv_cache_spec, layer_names, vllm_config, device, "cpu/CPU_ATTN")


class LocksCpuImpl(LocksImplMixin, CPUAttentionBackendImpl):
    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kv_views(kv_cache)

    def _stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        return CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)


class LocksCpuBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the enum member this class overrides

    @staticmethod
    def get_impl_cls() -> type[LocksCpuImpl]:
        return LocksCpuImpl

    @staticmethod
    def get_builder_cls() -> type[LocksCpuBuilder]:
        return LocksCpuBuilder
