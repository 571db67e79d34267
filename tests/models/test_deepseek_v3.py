"""DeepSeek-V3: forward equals HF transformers, absorbed cached decode equals forward, grouped MoE equals dense."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.checkpoint import load_checkpoint
from djax.config import preset
from djax.models import deepseek_v3 as v3
from djax.params import is_param

CFG = preset("tiny-v3")


def _close(got, want, what: str):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all() and np.isfinite(want).all(), what
    err, ref = np.abs(got - want).max(), np.abs(want).max()
    worst = np.unravel_index(np.abs(got - want).argmax(), got.shape)
    assert err <= 1e-4 * ref, f"{what}: max abs err {err:.3g} vs max |ref| {ref:.3g} at {worst}"


def _random_params(seed: int = 0):
    """Fresh random weights for the declared tree: norms ~ 1 + N(0, 0.2), router bias ~ N(0, 0.2), matrices ~ 1/sqrt(fan-in)."""
    rng = np.random.default_rng(seed)

    def draw(p):
        if len(p.shape) == 1:
            base = 1.0 if p.init == "ones" else 0.0
            return jnp.asarray(base + 0.2 * rng.standard_normal(p.shape), jnp.float32)
        return jnp.asarray(rng.standard_normal(p.shape) * p.shape[-1] ** -0.5, jnp.float32)

    return jax.tree.map(draw, v3.declare(CFG), is_leaf=is_param)


# ---- HF reference -------------------------------------------------------------------------------------
def _hf_model(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = CFG.to_hf()
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_cfg)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "e_score_correction_bias" in name:
                # Non-zero, of both signs, so the biased choice differs from the unbiased one and a dropped
                # group's expert would win if dropped groups were masked with 0 instead of -inf.
                t.copy_(torch.rand(t.shape, generator=g) * 1.5 - 1.0)
            elif t.ndim == 1:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    model.save_pretrained(tmp_path)
    return torch, model


def _load_hf(path) -> dict:
    """The HF save_pretrained directory through djax's own checkpoint loader (config round trip included)."""
    config, params = load_checkpoint(path, progress=False)
    assert config == CFG
    return params


def test_canonical_names():
    cases = {
        "model.embed_tokens.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight",
        "model.layers.0.self_attn.q_a_proj.weight": "layers.0.attn.wq_a.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": "layers.0.attn.wkv_a.weight",
        "model.layers.0.mlp.down_proj.weight": "layers.0.ffn.w2.weight",
        "model.layers.3.mlp.experts.5.gate_proj.weight": "layers.3.ffn.experts.5.w1",
        "model.layers.3.mlp.gate.e_score_correction_bias": "layers.3.ffn.gate.bias",
        "model.layers.3.mlp.shared_experts.up_proj.weight": "layers.3.ffn.shared_experts.w3.weight",
        "model.layers.3.self_attn.o_proj.weight_scale_inv": "layers.3.attn.wo.weight.scale",
        "layers.3.ffn.experts.5.w1.weight": "layers.3.ffn.experts.5.w1",
        "layers.3.attn.wkv_b.weight": "layers.3.attn.wkv_b.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq": None,
        "model.layers.2.eh_proj.weight": None,
    }
    for hf, want in cases.items():
        assert v3.canonical_name(hf) == want, hf
    assert v3.canonical_name("model.layers.3.self_attn.q_a_proj.weight", CFG) is None  # MTP layer of tiny-v3


def test_forward_matches_hf(tmp_path):
    torch, model = _hf_model(tmp_path)
    params = _load_hf(tmp_path)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    fwd = jax.jit(v3.forward, static_argnames=("cfg",))
    _close(fwd(params, jnp.asarray(tokens), cfg=CFG), want, "forward vs HF")
    # The router bias and the group limit both change the choice here, so the comparison covers them.
    unbiased = jax.tree.map(lambda x: x, params)
    for lp in unbiased["layers"][CFG.first_k_dense_replace :]:
        lp["ffn"]["gate"]["bias"] = jnp.zeros_like(lp["ffn"]["gate"]["bias"])
    for other, cfg in ((unbiased, CFG), (params, CFG.replace(n_group=1))):
        with pytest.raises(AssertionError):
            _close(fwd(other, jnp.asarray(tokens), cfg=cfg), want, "must differ")


def test_decode_matches_forward():
    params = _random_params(1)
    t, lengths = 52, np.array([3, 8])
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, t)))
    want = np.asarray(jax.jit(v3.forward, static_argnames=("cfg",))(params, tokens, cfg=CFG))
    prompt = tokens[:, : lengths.max()]
    logits, state = jax.jit(v3.prefill, static_argnames=("cfg", "max_len"))(
        params, prompt, jnp.asarray(lengths), cfg=CFG, max_len=64
    )
    _close(logits, want[np.arange(2), lengths - 1], "prefill")
    step = jax.jit(v3.decode_step, static_argnames=("cfg",))
    rows = np.arange(2)
    for j in range(t - lengths.max()):  # 44 steps; each row feeds its own next token
        pos = lengths + j
        logits, state = step(params, tokens[rows, pos], state, cfg=CFG)
        _close(logits, want[rows, pos], f"decode step {j}")
    np.testing.assert_array_equal(state["lengths"], lengths + t - lengths.max())


def test_moe_grouped_matches_dense():
    params = _random_params(2)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 16)))
    fwd = jax.jit(v3.forward, static_argnames=("cfg", "moe_impl"))
    _close(
        fwd(params, tokens, cfg=CFG, moe_impl="grouped"),
        fwd(params, tokens, cfg=CFG, moe_impl="dense"),
        "moe",
    )
