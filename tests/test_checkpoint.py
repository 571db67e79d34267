"""Checkpoints: safetensors save/load round trips, FP8 (dequantized and kept), errors naming the tensor,
sharded placement, HF transformers reading what djax writes, and Orbax round trips."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import djax
from djax.checkpoint import CheckpointError, load_checkpoint, save_pretrained
from djax.config import preset
from djax.models import model_module
from djax.orbax_io import restore_params, save_params
from djax.params import flatten_names, is_param
from djax.quant import QArray, quantize
from djax.safetensors_io import SafetensorsFile, save_file
from djax.step import forward
from tests.cpu_devices import run_on_cpu_devices

# Every V4 layer kind (SWA, CSA with an indexer keeping 4, HCA), a hash layer and mHC, in 3 layers.
V4 = preset("tiny-v4", num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1)
V3 = preset("tiny-v3")


def random_params(cfg, seed: int) -> dict:
    """Fresh random weights for the declared tree: 1-D ~ base + N(0, 0.2), matrices ~ N(0, 1 / fan-in)."""
    rng = np.random.default_rng(seed)

    def draw(p):
        dtype = jnp.dtype(p.dtype if p.dtype is not None else cfg.dtype)
        if jnp.issubdtype(dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, p.high, p.shape), dtype)
        if len(p.shape) == 1:
            return jnp.asarray((p.init == "ones") + 0.2 * rng.standard_normal(p.shape), dtype)
        return jnp.asarray(rng.standard_normal(p.shape) * p.shape[-1] ** -0.5, dtype)

    return jax.tree.map(draw, model_module(cfg).declare(cfg), is_leaf=is_param)


def assert_same(got, want):
    """Same tree, same dtypes, bit-equal values (QArray leaves included)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (jax.tree_util.keystr(path), g.dtype, w.dtype)
        np.testing.assert_array_equal(
            np.asarray(g, np.float32), np.asarray(w, np.float32), jax.tree_util.keystr(path)
        )


def rewrite(src: Path, dst: Path, edit, config_edit=None) -> Path:
    """Copy a checkpoint dir through edit(name, array) -> {name: array} (empty: drop the tensor)."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_edit(cfg) if config_edit else cfg))
    for file in src.glob("*.safetensors"):
        f = SafetensorsFile(file)
        out = {}
        for name in f.keys():
            out.update(edit(name, np.array(f.get(name))))
        save_file(out, dst / file.name)
    if (src / "model.safetensors.index.json").exists():
        (dst / "model.safetensors.index.json").write_text((src / "model.safetensors.index.json").read_text())
    return dst


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """V4 params and their checkpoint, saved plain (single file) and FP8."""
    params = random_params(V4, 0)
    root = tmp_path_factory.mktemp("ckpt")
    save_pretrained(params, V4, root / "plain")
    save_pretrained(params, V4, root / "fp8", fp8=True)
    return params, root


@pytest.fixture(scope="module")
def tokens():
    # 40 tokens: past the window (8), 10 CSA windows for an indexer keeping 4, 2 HCA windows.
    return jnp.asarray(np.random.default_rng(1).integers(0, V4.vocab_size, (2, 40)))


# ---- safetensors and quantization ----------------------------------------------------------------------
def test_safetensors_round_trip_narrow_dtypes(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    tensors = {
        "f32": x,
        "bf16": x.astype(ml_dtypes.bfloat16),
        "fp8": x.astype(ml_dtypes.float8_e4m3fn),
        "e8m0": (2.0 ** rng.integers(-8, 8, (3,))).astype(ml_dtypes.float8_e8m0fnu),
        "i32": rng.integers(-9, 9, (4,)).astype(np.int32),
        "from_jax": jnp.asarray(x, jnp.bfloat16),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    f = SafetensorsFile(tmp_path / "t.safetensors")
    assert f.dtype("fp8") == "F8_E4M3" and f.dtype("e8m0") == "F8_E8M0" and f.dtype("from_jax") == "BF16"
    for name, want in tensors.items():
        got = f.get(name)
        assert got.dtype == np.dtype(want.dtype), name
        np.testing.assert_array_equal(got.astype(np.float32), np.asarray(want).astype(np.float32), name)
    # The reference reader (numpy backend: no bf16 / FP8) agrees on the plain dtypes.
    from safetensors.numpy import load_file

    save_file({"f32": x, "i32": tensors["i32"]}, tmp_path / "plain.safetensors")
    ref = load_file(tmp_path / "plain.safetensors")
    np.testing.assert_array_equal(ref["f32"], x)
    np.testing.assert_array_equal(ref["i32"], tensors["i32"])


def test_quantize_blocks_and_index():
    w = np.random.default_rng(3).standard_normal((3, 200, 150)).astype(np.float32)
    q = quantize(w, (128, 64))
    on_device = jax.jit(quantize, static_argnums=1)(jnp.asarray(w), (128, 64))
    np.testing.assert_array_equal(np.asarray(on_device.values, np.float32), q.values.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(on_device.scale), q.scale)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == (3, 2, 3) and q.scale.dtype == jnp.float32
    err = np.abs(np.asarray(q.dense(jnp.float32) - w))
    assert err.max() <= 2**-4 * np.abs(np.asarray(w)).max()  # e4m3 keeps 3 mantissa bits
    np.testing.assert_array_equal(np.asarray(q[1].dense(jnp.float32)), np.asarray(q.dense(jnp.float32)[1]))
    with pytest.raises(IndexError):
        q[0, 1]


# ---- save / load ----------------------------------------------------------------------------------------
def test_saved_names_are_deepseeks(v4):
    _, root = v4
    names = set(SafetensorsFile(root / "plain" / "model.safetensors").keys())
    for want in (
        "embed.weight",
        "layers.0.attn.wq_a.weight",
        "layers.0.attn.kv_norm.weight",
        "layers.0.ffn.experts.3.w1.weight",
        "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.0.ffn.gate.tid2eid",
        "layers.1.ffn.gate.bias",
        "hc_head_fn",
        "norm.weight",
        "head.weight",
    ):
        assert want in names, want
    assert not any(re.search(r"experts\.w[123]$", n) for n in names)
    fp8 = SafetensorsFile(root / "fp8" / "model.safetensors")
    assert (
        fp8.dtype("layers.0.attn.wq_a.weight") == "F8_E4M3" and fp8.dtype("layers.0.attn.wq_a.scale") == "F32"
    )
    assert fp8.dtype("layers.0.ffn.experts.3.w2.weight") == "F8_E4M3"
    assert (
        fp8.dtype("embed.weight")
        == fp8.dtype("head.weight")
        == fp8.dtype("layers.0.ffn.gate.weight")
        == "F32"
    )


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v3"])
def test_round_trip_is_exact(tmp_path, name):
    cfg = V4 if name == "tiny-v4" else V3.replace(dtype="bfloat16")
    params = random_params(cfg, 4)
    save_pretrained(params, cfg, tmp_path, max_shard_bytes=64 << 10)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    loaded_cfg, loaded = load_checkpoint(tmp_path, progress=False)
    # V3's config.json has no num_hash_layers and from_hf defaults it to V4's 3 (unused by V3).
    assert loaded_cfg.replace(num_hash_layers=cfg.num_hash_layers) == cfg
    assert_same(loaded, params)
    # A dtype override applies to the big weights only; float32-declared ones stay float32.
    _, up = load_checkpoint(tmp_path, dtype="float32", progress=False)
    assert up["embed"]["weight"].dtype == jnp.float32 and up["norm"]["weight"].dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(up["embed"]["weight"]), np.asarray(params["embed"]["weight"], np.float32)
    )


def test_load_onto_a_sharding(v4):
    params, root = v4
    mesh = jax.make_mesh((1,), ("ep",))
    shardings = jax.tree.map(
        lambda p: jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*(("ep" if a == "experts" else None) for a in p.axes))
        ),
        model_module(V4).declare(V4),
        is_leaf=is_param,
    )
    _, loaded = load_checkpoint(root / "fp8", keep_quantized=True, shardings=shardings, progress=False)
    w1 = loaded["layers"][0]["ffn"]["experts"]["w1"]
    assert isinstance(w1, QArray) and w1.values.sharding == shardings["layers"][0]["ffn"]["experts"]["w1"]
    assert w1.scale.sharding.spec == jax.sharding.PartitionSpec("ep", None, None)
    _, loaded = load_checkpoint(
        root / "plain", shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]), progress=False
    )
    assert_same(loaded, params)


# ---- FP8 ----------------------------------------------------------------------------------------------
def test_fp8_dequantized_and_kept_give_the_same_forward(v4, tokens, tmp_path):
    params, root = v4
    _, deq = load_checkpoint(root / "fp8", progress=False)
    _, kept = load_checkpoint(root / "fp8", keep_quantized=True, progress=False)
    flat_kept, flat_deq, flat_orig = flatten_names(kept), flatten_names(deq), flatten_names(params)
    quantized = [n for n, w in flat_kept.items() if isinstance(w, QArray)]
    assert "layers.0.attn.wq_a.weight" in quantized and "layers.2.ffn.experts.w3" in quantized
    assert "embed.weight" not in quantized and "layers.0.ffn.gate.weight" not in quantized
    for n in quantized:
        q = flat_kept[n]
        assert q.values.dtype == jnp.float8_e4m3fn and q.scale.dtype == jnp.float32 and q.block == (128, 128)
        np.testing.assert_array_equal(np.asarray(q.dense(jnp.float32)), np.asarray(flat_deq[n]), n)
        orig = np.asarray(flat_orig[n])
        assert np.abs(np.asarray(flat_deq[n]) - orig).max() <= 2**-4 * np.abs(orig).max(), n
    # Kept-quantized params save as they are (FP8 + `.scale`) and load back bit-equal.
    save_pretrained(kept, V4, tmp_path)
    assert_same(load_checkpoint(tmp_path, keep_quantized=True, progress=False)[1], kept)
    got = np.asarray(forward(kept, tokens, V4))
    want = np.asarray(forward(deq, tokens, V4))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    # The quantization is real: the FP8 model's logits differ from the float model's.
    assert np.abs(want - np.asarray(forward(params, tokens, V4))).max() > 0


def test_fp8_kept_forward_v3(tmp_path):
    save_pretrained(random_params(V3, 5), V3, tmp_path, fp8=True)
    _, deq = load_checkpoint(tmp_path, progress=False)
    _, kept = load_checkpoint(tmp_path, keep_quantized=True, progress=False)
    assert isinstance(kept["layers"][0]["attn"]["wkv_b"]["weight"], QArray)
    assert isinstance(kept["layers"][1]["ffn"]["experts"]["w2"], QArray)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, V3.vocab_size, (2, 12)))
    want = np.asarray(forward(deq, tokens, V3))
    np.testing.assert_allclose(
        np.asarray(forward(kept, tokens, V3)), want, rtol=0, atol=1e-6 * np.abs(want).max()
    )


def _pow2_fp8(w: np.ndarray, block: tuple[int, int]):
    """HF/DeepSeek-V3.1-style FP8: e4m3 values and power-of-two (e8m0) scales per block."""
    q = quantize(jnp.asarray(w), block)
    scale = 2.0 ** np.ceil(np.log2(np.asarray(q.scale)))
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
    values = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return values, scale.astype(ml_dtypes.float8_e8m0fnu), values.astype(np.float32) * full


def test_fp8_with_weight_scale_inv_and_e8m0_scales(v4, tmp_path):
    _, root = v4
    block, want = (16, 32), {}

    def edit(name, a):
        if a.ndim == 2 and re.search(r"\.(wq_a|wo_b|experts\.\d+\.w2)\.weight$", name):
            values, scale, want[name] = _pow2_fp8(a, block)
            return {name: values, name.removesuffix(".weight") + ".weight_scale_inv": scale}
        return {name: a}

    path = rewrite(
        root / "plain",
        tmp_path / "hf_fp8",
        edit,
        lambda c: {**c, "quantization_config": {"weight_block_size": list(block)}},
    )
    _, deq = load_checkpoint(path, progress=False)
    flat = flatten_names(deq)
    np.testing.assert_array_equal(
        np.asarray(flat["layers.1.attn.wq_a.weight"]), want["layers.1.attn.wq_a.weight"]
    )
    np.testing.assert_array_equal(
        np.asarray(flat["layers.2.ffn.experts.w2"][5]), want["layers.2.ffn.experts.5.w2.weight"]
    )
    _, kept = load_checkpoint(path, keep_quantized=True, progress=False)
    q = flatten_names(kept)["layers.0.attn.wo_b.weight"]
    # E8M0 on disk stays UE8M0 (powers of two), which sets the activations' scale rule (`has_ue8m0_scales`)
    assert isinstance(q, QArray) and q.block == block and q.scale.dtype == ml_dtypes.float8_e8m0fnu
    np.testing.assert_array_equal(np.asarray(q.dense(jnp.float32)), want["layers.0.attn.wo_b.weight"])


# ---- errors ---------------------------------------------------------------------------------------------
def _drop(target):
    return lambda name, a: {} if name == target else {name: a}


def _replace(target, new):
    return lambda name, a: new(name, a) if name == target else {name: a}


ERRORS = {
    "missing": (_drop("layers.1.attn.wq_b.weight"), r"missing tensors: layers\.1\.attn\.wq_b\.weight"),
    "missing expert": (
        _drop("layers.0.ffn.experts.3.w2.weight"),
        r"missing tensors: layers\.0\.ffn\.experts\.3\.w2\.weight",
    ),
    "unexpected": (
        _replace("norm.weight", lambda n, a: {n: a, "layers.0.attn.wq_c.weight": a}),
        r"unexpected tensors: layers\.0\.attn\.wq_c\.weight",
    ),
    "mis-shaped": (
        _replace("layers.2.attn.wkv.weight", lambda n, a: {n: a[:-1]}),
        r"tensor 'layers\.2\.attn\.wkv\.weight' has shape \(31, 64\), expected \(32, 64\)",
    ),
    "mis-shaped expert": (
        _replace("layers.1.ffn.experts.7.w3.weight", lambda n, a: {n: a.T}),
        r"tensor 'layers\.1\.ffn\.experts\.7\.w3\.weight' has shape \(64, 32\), expected \(32, 64\)",
    ),
    "fp8 without scale": (
        _replace("layers.0.attn.wq_a.weight", lambda n, a: {n: a.astype(ml_dtypes.float8_e4m3fn)}),
        r"tensor 'layers\.0\.attn\.wq_a\.weight' is FP8 but has no scale",
    ),
    "scale beside a float tensor": (
        _replace("head.weight", lambda n, a: {n: a, "head.scale": np.ones((4, 1), np.float32)}),
        r"scale 'head\.scale' sits beside 'head\.weight', which is not FP8",
    ),
    "bad scale shape": (
        _replace(
            "layers.0.attn.wq_a.weight",
            lambda n, a: {
                n: a.astype(ml_dtypes.float8_e4m3fn),
                "layers.0.attn.wq_a.scale": np.ones((2, 1), np.float32),
            },
        ),
        r"scale 'layers\.0\.attn\.wq_a\.scale' has shape \(2, 1\), expected \(1, 1\)",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_name_the_tensor(v4, tmp_path, case):
    _, root = v4
    edit, message = ERRORS[case]
    path = rewrite(root / "plain", tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, progress=False)


def test_save_refuses_params_of_another_config(v4, tmp_path):
    params, _ = v4
    with pytest.raises(CheckpointError, match=r"embed\.weight' has shape"):
        save_pretrained(params, V4.replace(vocab_size=256), tmp_path)
    with pytest.raises(CheckpointError, match=r"missing weights: layers\.3\."):
        save_pretrained(params, V4.replace(num_hidden_layers=4, compress_ratios=(0, 4, 16, 4)), tmp_path)


# ---- several devices (a subprocess, so the fake CPU devices exist before jax starts) --------------------
SHARDED = textwrap.dedent(
    """
    import sys, tempfile
    import jax, numpy as np
    from djax.checkpoint import load_checkpoint
    from djax.config import preset
    from djax.orbax_io import restore_params, save_params
    from djax.quant import QArray
    from djax.sharding import ShardingRules, make_mesh, param_shardings

    assert len(jax.devices()) == 4
    cfg = preset("tiny-v4", num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1)
    mesh = make_mesh(ep=2, tp=2)
    shardings = param_shardings(cfg, mesh, ShardingRules.tensor_parallel(), indivisible="replicate")
    is_q = lambda x: isinstance(x, QArray)

    def check(one, many):
        for a, b, s in zip(jax.tree.leaves(one, is_leaf=is_q), jax.tree.leaves(many, is_leaf=is_q),
                           jax.tree.leaves(shardings)):
            if is_q(a):
                assert b.values.sharding == s and b.scale.sharding.mesh == mesh, (b.values.sharding, s)
                a, b = a.dense(np.float32), b.dense(np.float32)
            else:
                assert b.sharding == s, (b.sharding, s)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    for path, keep in ((sys.argv[1], False), (sys.argv[2], True)):
        _, one = load_checkpoint(path, keep_quantized=keep, progress=False)
        _, many = load_checkpoint(path, keep_quantized=keep, shardings=shardings, progress=False)
        check(one, many)
        orbax_dir = tempfile.mkdtemp() + "/params"
        save_params(many, orbax_dir)
        check(one, restore_params(orbax_dir, cfg, shardings))
    w1 = many["layers"][0]["ffn"]["experts"]["w1"]
    assert len(w1.values.addressable_shards) == 4 and w1.values.addressable_shards[0].data.shape == (4, 16, 64)
    print("ok")
    """
)


def test_load_sharded_over_four_devices(v4):
    _, root = v4
    out = run_on_cpu_devices(SHARDED, 4, str(root / "plain"), str(root / "fp8"), timeout=300)
    assert out.strip() == "ok", out


# ---- HF transformers reads what djax writes -------------------------------------------------------------
def test_hf_transformers_loads_djax_checkpoint(v4, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params, root = v4
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(root / "plain", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor(np.asarray(tokens))).logits.float().numpy()
    out = np.asarray(forward(params, tokens, V4))
    err, scale = np.abs(out - ref).max(), np.abs(ref).max()
    assert err <= 1e-4 * scale, (err, scale)


# ---- Orbax --------------------------------------------------------------------------------------------
def test_orbax_round_trip(v4, tmp_path):
    params, root = v4
    save_params(params, tmp_path / "plain")
    assert_same(restore_params(tmp_path / "plain", V4), params)
    _, kept = load_checkpoint(root / "fp8", keep_quantized=True, progress=False)
    save_params(kept, tmp_path / "kept")
    restored = restore_params(
        tmp_path / "kept", V4, shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0])
    )
    assert isinstance(restored["layers"][1]["attn"]["wq_b"]["weight"], QArray)
    assert_same(restored, kept)
    with pytest.raises(
        CheckpointError, match=r"weight 'embed\.weight' has shape \(512, 64\), expected \(256, 64\)"
    ):
        restore_params(tmp_path / "plain", V4.replace(vocab_size=256))


def test_fp4_experts_are_dequantized_on_load(tmp_path):
    """V4.1's routed experts on disk as packed e2m1 codes with per-32 UE8M0 scales load as their dense values."""
    from djax.fp4 import dequantize_fp4, quantize_fp4
    from djax.safetensors_io import SafetensorsFile

    cfg = djax.preset("tiny-v41")
    params = djax.init_params(cfg, jax.random.key(11))
    djax.save_pretrained(params, cfg, tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    expected = {}
    for f in files:
        src = SafetensorsFile(f)
        tensors = {k: np.array(src.get(k)) for k in src.keys()}
        for k in [k for k in tensors if re.search(r"\.experts\.\d+\.w[123]\.weight$", k)]:
            packed, scale = quantize_fp4(tensors[k].astype(np.float32))
            tensors[k], tensors[k.removesuffix(".weight") + ".scale"] = packed, scale
            expected[k] = np.asarray(dequantize_fp4(packed, scale, jnp.float32))
        del src
        save_file(tensors, f)
    assert expected
    loaded_cfg, loaded = djax.load_checkpoint(tmp_path, progress=False)
    assert loaded_cfg == cfg
    flat = flatten_names(loaded)
    for k, want in expected.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(w[123])\.weight$", k)
        got = np.asarray(flat[f"{m[1]}.{m[3]}"][int(m[2])], np.float32)
        np.testing.assert_array_equal(got, want.astype(jnp.dtype(cfg.dtype)).astype(np.float32))
    _, kept = djax.load_checkpoint(tmp_path, keep_quantized=True, progress=False)  # more in test_fp4.py
    for k in expected:
        m = re.match(r"(.*\.experts)\.\d+\.(w[123])\.weight$", k)
        assert flatten_names(kept)[f"{m[1]}.{m[2]}"].is_fp4


def test_fp8_engram_tables_load_dense_when_kept_quantized(tmp_path):
    """A checkpoint may hold V4.1's Engram tables in FP8 beside its projections. The tables are looked up
    by row (on the host where they live there), not multiplied: keep_quantized=True loads them dense, equal
    to their dequantized values, while the projections stay QArray, and the model's logits are those of
    the fully dequantized load."""
    cfg = preset("tiny-v41")
    save_pretrained(djax.init_params(cfg, jax.random.key(3)), cfg, tmp_path / "plain")
    want = {}

    def edit(name, a):
        if a.ndim == 2 and re.search(r"\.(engram\.embed|attn\.wq_a)\.weight$", name):
            values, scale, want[name] = _pow2_fp8(a, (32, 32))
            return {name: values, name.removesuffix(".weight") + ".weight_scale_inv": scale}
        return {name: a}

    quant = {"quantization_config": {"weight_block_size": [32, 32]}}
    path = rewrite(tmp_path / "plain", tmp_path / "fp8", edit, lambda c: {**c, **quant})
    _, kept = load_checkpoint(path, keep_quantized=True, progress=False)
    flat = flatten_names(kept)
    tables = [n for n in want if "engram" in n]
    assert tables and all(isinstance(flat[n], QArray) for n in want if n.endswith("wq_a.weight"))
    for n in tables:
        assert not isinstance(flat[n], QArray), n
        np.testing.assert_array_equal(np.asarray(flat[n], np.float32), want[n].astype(cfg.dtype))
    tok = jax.random.randint(jax.random.key(4), (2, 8), 0, cfg.vocab_size)
    _, dense = load_checkpoint(path, progress=False)
    np.testing.assert_allclose(
        np.asarray(forward(kept, tok, cfg)), np.asarray(forward(dense, tok, cfg)), rtol=1e-5, atol=1e-5
    )
