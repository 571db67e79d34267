"""Helpers that build HF transformers reference models (random weights) and djax copies of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def randomize_hf(model, seed: int = 0, n_experts: int | None = None) -> None:
    """Give every zero- or one-initialised weight of an HF model random values, so comparisons can fail."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "tid2eid" in name:
                p.copy_(torch.randint(0, n_experts, p.shape, generator=g))
            elif any(
                k in name for k in ("sinks", "position_bias", "base", "e_score_correction_bias", "bias")
            ):
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
            elif "norm" in name and p.ndim == 1 and p.dtype.is_floating_point:
                p.copy_(1 + 0.2 * (torch.rand(p.shape, generator=g) - 0.5))
            elif "scale" in name and p.ndim == 1 and p.dtype.is_floating_point:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def save_hf_v4(config, path: Path, seed: int = 0):
    """A random HF `DeepseekV4ForCausalLM` for a djax config, saved with `save_pretrained` at path."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config.to_hf())).eval()
    randomize_hf(model, seed, config.n_routed_experts)
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.float().numpy()
