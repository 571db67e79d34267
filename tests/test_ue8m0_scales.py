"""UE8M0 (power-of-two) FP8 scales, as DeepSeek's V3.1-on and V4 checkpoints hold them (`"scale_fmt":
"ue8m0"`): the weights' quantization, the activations' (power-of-two 1x128 scales for such weights), and
checkpoints and Orbax keeping them; each against numpy written from the rule (frexp, not the bit trick the
code uses). What the model does with them: `layers.linear` in tests/models/test_fp8_projections.py, the
routed experts in tests/kernels/test_moe_experts_fp8.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from djax.checkpoint import CheckpointError, load_checkpoint, quantize_projections, save_pretrained
from djax.config import preset
from djax.kernels.fp8_gemm_ref import quantize_act
from djax.orbax_io import restore_params, save_params
from djax.params import flatten_names, init_params, unflatten_names
from djax.quant import E8M0, QArray, has_ue8m0_scales, pow2_ceil, quantize
from djax.safetensors_io import SafetensorsFile
from tests.fp8_numpy import act_scales
from tests.fp8_numpy import pow2_ceil as np_pow2_ceil

E4M3 = ml_dtypes.float8_e4m3fn


def _rows(seed: int, m: int, k: int) -> np.ndarray:
    """Rows whose 128-column groups span ten orders of magnitude, an all-zero group, and a group whose max is
    exactly 448 x 2^-3 (its scale is a power of two already and must not be rounded up)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32) * np.logspace(-6, 4, k, dtype=np.float32)
    x[0, :128] = 0.0
    x[1, :128] = np.clip(x[1, :128], -1, 1) * 0.5
    x[1, 7] = 56.0  # 448 / 8
    return x


def test_pow2_ceil_is_the_next_power_of_two():
    s = np.abs(np.random.default_rng(0).standard_normal(1000)).astype(np.float32) * 1e-3
    s[:4] = [1.0, 2.0**-20, 0.75, 3.0]
    want = np_pow2_ceil(s)
    np.testing.assert_array_equal(pow2_ceil(s), want)
    np.testing.assert_array_equal(np.asarray(pow2_ceil(jnp.asarray(s))), want)
    assert list(want[:4]) == [1.0, 2.0**-20, 1.0, 4.0]


def test_quantize_act_ue8m0_is_deepseeks_rule():
    """Scale = the next power of two over max(amax, 1e-4) x float32(1 / 448); x / scale rounded to e4m3 (exact
    division, so bit for bit); a partial last group (k 300) has its own scale."""
    x = _rows(1, 5, 300)
    q, s = quantize_act(jnp.asarray(x), ue8m0=True)
    groups = np.pad(x, [(0, 0), (0, 84)]).reshape(5, 3, 128)
    want_s = act_scales(groups, ue8m0=True)
    amax = np.abs(groups).max(-1)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    assert np.asarray(s)[1, 0] == 0.125  # amax 56 = 448 / 8: already a power of two
    assert np.asarray(s)[0, 0] == np_pow2_ceil(np.float32(1e-4) * np.float32(1 / 448))  # the floor
    want_q = (np.pad(x, [(0, 0), (0, 84)]) / np.repeat(want_s, 128, -1))[:, :300].astype(E4M3)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    ratio = amax / want_s
    assert (ratio[amax > 1e-4] >= 224).all() and (ratio <= 448).all()
    # the float rule differs: amax / 448 exactly
    _, s_float = quantize_act(jnp.asarray(x))
    assert not np.array_equal(np.asarray(s_float), want_s)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jnp"])
def test_quantize_weights_ue8m0(xp):
    """Block scales are float8_e8m0fnu powers of two over each block's amax / 448; values are w / scale in
    e4m3; numpy (checkpoint writing) and jnp agree."""
    w = _rows(2, 300, 260).T.copy() * 1e-3  # [260, 300]: partial blocks both ways
    q = quantize(xp.asarray(w), (128, 128), "ue8m0")
    assert jnp.dtype(q.scale.dtype) == E8M0 and has_ue8m0_scales(q)
    blocks = np.pad(w, [(0, 124), (0, 84)]).reshape(3, 128, 3, 128)
    amax = np.maximum(np.abs(blocks).max((1, 3)), np.float32(1e-12)).astype(np.float32)
    want_s = np_pow2_ceil(amax * np.float32(1 / 448))
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float64), want_s)
    full = np.repeat(np.repeat(want_s, 128, 0), 128, 1)[:260, :300]
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), (w / full).astype(E4M3).view(np.uint8))
    assert not has_ue8m0_scales(quantize(xp.asarray(w)))
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize(xp.asarray(w), (128, 128), "e4m3")


V4 = preset("tiny-v4", num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1)


def _ue8m0_params():
    return quantize_projections(init_params(V4, jax.random.key(0)), V4, scale_fmt="ue8m0")


def _fp8_names(params) -> list[str]:
    return [n for n, w in flatten_names(params).items() if isinstance(w, QArray)]


def _same_scales(a, b, names) -> bool:
    fa, fb = flatten_names(a), flatten_names(b)
    return all(
        has_ue8m0_scales(fb[n])
        and np.array_equal(
            np.asarray(fa[n].scale.astype(jnp.float32)), np.asarray(fb[n].scale.astype(jnp.float32))
        )
        and np.array_equal(np.asarray(fa[n].values).view(np.uint8), np.asarray(fb[n].values).view(np.uint8))
        for n in names
    )


def test_checkpoint_keeps_ue8m0_scales(tmp_path):
    """Written with F8_E8M0 scales and `"scale_fmt": "ue8m0"`; read back kept quantized, the same codes and
    UE8M0 scales; read dense, the same values as the QArrays made dense."""
    params = _ue8m0_params()
    names = _fp8_names(params)
    assert names and all(has_ue8m0_scales(flatten_names(params)[n]) for n in names)
    save_pretrained(params, V4, tmp_path)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant["scale_fmt"] == "ue8m0"
    f = SafetensorsFile(tmp_path / "model.safetensors")
    assert {f.dtype(k) for k in f.keys() if k.endswith(".scale")} == {"F8_E8M0"}
    _, kept = load_checkpoint(tmp_path, keep_quantized=True, progress=False)
    assert _same_scales(params, kept, names)
    _, dense = load_checkpoint(tmp_path, progress=False)
    for n in names[:5]:
        want = flatten_names(params)[n].dense(jnp.float32)
        np.testing.assert_array_equal(np.asarray(flatten_names(dense)[n]), np.asarray(want))


def test_float_scales_under_ue8m0_config_load_as_ue8m0_or_are_refused(tmp_path):
    """A checkpoint with float32 scales whose config says ue8m0 (V3.1's form): powers of two load as UE8M0;
    one scale that is not a power of two is refused, named; an unknown scale_fmt is refused."""
    params = _ue8m0_params()
    names = _fp8_names(params)
    as_float = {
        n: QArray(w.values, w.scale.astype(jnp.float32), w.block) if n in names else w
        for n, w in flatten_names(params).items()
    }
    as_float = unflatten_names(as_float, params)
    save_pretrained(as_float, V4, tmp_path)
    f = SafetensorsFile(tmp_path / "model.safetensors")
    assert {f.dtype(k) for k in f.keys() if k.endswith(".scale")} == {"F32"}
    cfg_file = tmp_path / "config.json"
    hf = json.loads(cfg_file.read_text())
    assert "scale_fmt" not in hf["quantization_config"]
    hf["quantization_config"]["scale_fmt"] = "ue8m0"
    cfg_file.write_text(json.dumps(hf))
    _, kept = load_checkpoint(tmp_path, keep_quantized=True, progress=False)
    assert _same_scales(params, kept, names)

    # the same files with one scale off a power of two
    bad = flatten_names(as_float)
    victim = names[0]
    w = bad[victim]
    bad[victim] = QArray(w.values, w.scale.at[0, 0].multiply(0.75), w.block)
    save_pretrained(unflatten_names(bad, params), V4, tmp_path)
    cfg_file.write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"not a power of two"):
        load_checkpoint(tmp_path, keep_quantized=True, progress=False)
    hf["quantization_config"]["scale_fmt"] = "e5m2"
    cfg_file.write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="scale_fmt 'e5m2' is not supported"):
        load_checkpoint(tmp_path, progress=False)


def test_orbax_keeps_ue8m0_scales(tmp_path):
    params = _ue8m0_params()
    save_params(params, tmp_path / "ckpt")
    restored = restore_params(tmp_path / "ckpt", V4)
    assert _same_scales(params, restored, _fp8_names(params))
