"""The Locks backend on CUDA: FlashAttention (FA3) subclasses, selected with attention_backend="CUSTOM".

Backend = static facts (name, block size 16, decoder only, FA3's KV layout); builder = FA3's
metadata plus the Locks step; impl = FA3 for prefill and sliding-window layers, Locks for decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from ..config import PAGE_SIZE
from .core import LocksBuilderMixin, LocksImplMixin, LocksStep
from .settings import per_request_enabled, settings_from_vllm_config


@dataclass
class LocksMetadata(FlashAttentionMetadata):
    locks: LocksStep | None = None


class LocksBuilder(LocksBuilderMixin, FlashAttentionMetadataBuilder):
    locks_metadata_cls = LocksMetadata
    # Decode graphs only: mixed batches run eagerly (stock FA3 for their prefill rows).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # Our step derives block ids from the block table: never reuse metadata across groups.
    supports_update_block_table: bool = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # Key-reading scorers and per-request selection group rows on the host (quality runs): no graphs at all.
        if settings_from_vllm_config(vllm_config).reads_keys or per_request_enabled(vllm_config):
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._locks_init(kv_cache_spec, layer_names, vllm_config, device, "cuda/FA3")


class LocksImpl(LocksImplMixin, FlashAttentionImpl):
    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_cache, value_cache = kv_cache.unbind(1)  # NHD: [num_blocks, 16, Hkv, d]
        return key_cache, value_cache

    def _stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        return FlashAttentionImpl.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)


class LocksBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # Attention looks the name up in AttentionBackendEnum

    @staticmethod
    def get_impl_cls() -> type[LocksImpl]:
        return LocksImpl

    @staticmethod
    def get_builder_cls() -> type[LocksBuilder]:
        return LocksBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return [PAGE_SIZE]  # pure: FA's version reads the current vllm config

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False
