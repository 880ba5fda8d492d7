"""The weight a layer's output projection reads right after its attention, for the L2 prefetch (kernels/prefetch.py).

vLLM hands an attention impl only its `Attention` module. A module-registration hook, installed by the plugin in
every vLLM process before a model is built, remembers each Attention module's parent (the model's attention block:
`self_attn` of Llama, `self_attention` of ChatGLM); the output projection is that parent's one `RowParallelLinear`
child (`o_proj`, `dense`, `out_proj` by model). Where there is not exactly one, or its weight is not a plain
floating-point matrix (a quantized checkpoint), nothing is prefetched and the reason is logged once.
"""

from __future__ import annotations

import logging
import weakref

import torch

# vLLM's log stream carries the "vllm" namespace only (core.py's ACTIVE line goes the same way)
logger = logging.getLogger("vllm.locks")

_PARENT_ATTR = "_locks_parent"
_installed = False
# layer name -> the projection module's name inside its parent, for every layer whose projection was found in this
# process (its weight may still be declined: vLLM's CPU linear layers keep theirs packed, with an empty `weight`)
RESOLVED: dict[str, str] = {}
_declined: set[str] = set()
_announced: set[str] = set()


def install() -> None:
    """Remember the parent of every vLLM Attention module registered from now on (idempotent)."""
    global _installed
    if not _installed:
        torch.nn.modules.module.register_module_module_registration_hook(_remember_parent)
        _installed = True


def _remember_parent(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    if submodule is not None and _is_attention(submodule):
        object.__setattr__(submodule, _PARENT_ATTR, weakref.ref(module))  # plain attribute: no submodule cycle


def _is_attention(module: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.attention.attention import Attention  # noqa: PLC0415 - vLLM processes only
    except ImportError:
        return False
    return isinstance(module, Attention)


def projection_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    """The weight of the output projection that follows `layer` (a vLLM Attention module), or None (logged once
    per reason)."""
    from vllm.model_executor.layers.linear import RowParallelLinear  # noqa: PLC0415

    layer_name = getattr(layer, "layer_name", type(layer).__name__)
    parent_ref = getattr(layer, _PARENT_ATTR, None)
    parent = parent_ref() if parent_ref is not None else None
    if parent is None:
        return decline("the attention module's parent is unknown (the plugin's hook was not installed before the "
                        "model was built)")
    found = [(name, child) for name, child in parent.named_children() if isinstance(child, RowParallelLinear)]
    if len(found) != 1:
        return decline(f"{type(parent).__name__} has {len(found)} RowParallelLinear children, not one")
    name, projection = found[0]
    RESOLVED[layer_name] = name
    weight = getattr(projection, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point or weight.dim() != 2:
        shown = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        return decline(f"{type(parent).__name__}.{name}.weight is {shown}, not a floating-point matrix (a quantized or packed layer)")
    return weight


def announce(layer: torch.nn.Module, weight: torch.Tensor, mode: str) -> None:
    """Log once per projection name and mode that its weight is prefetched."""
    line = f"{RESOLVED.get(getattr(layer, 'layer_name', ''), 'the projection')} ({mode})"
    if line not in _announced:
        _announced.add(line)
        logger.info("Locks: prefetching each layer's output projection %s into L2 after its score kernel: %.1f MiB",
                    line, weight.numel() * weight.element_size() / 2**20)


def decline(why: str) -> None:
    """Log once why this process prefetches no output projection (for a layer that asked)."""
    if why not in _declined:
        _declined.add(why)
        logger.info("Locks: no output-projection prefetch: %s", why)
