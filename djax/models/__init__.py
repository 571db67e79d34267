"""The DeepSeek model family in pure JAX: one module per architecture, shared blocks beside them."""

from types import ModuleType

from djax.config import ModelConfig


def model_module(config: ModelConfig) -> ModuleType:
    """The module implementing `config.model_type` (declare / forward / prefill / decode_step)."""
    if config.model_type in ("deepseek_v4", "deepseek_v41"):
        from djax.models import deepseek_v4

        return deepseek_v4
    if config.model_type == "deepseek_v3":
        from djax.models import deepseek_v3

        return deepseek_v3
    raise ValueError(f"unsupported model_type {config.model_type!r}")
