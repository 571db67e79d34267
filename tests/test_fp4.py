"""FP4 (e2m1, per-32 UE8M0 scales): the format against an explicit decode, packing round trips, FP4
`QArray`s (indexing, bytes), and checkpoints whose routed experts stay packed and run like dequantized."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import djax
from djax import fp4
from djax.models import deepseek_v4 as v4
from djax.models import moe
from djax.params import flatten_names, unflatten_names
from djax.quant import E8M0, FP4, QArray, dense, from_fp4
from djax.safetensors_io import SafetensorsFile, save_file
from tests.test_checkpoint import random_params

# The smallest V4.1 (quick to compile; the routed experts are what these tests are about): one
# sliding-window MoE layer with 8 experts (w1, w3 [8, 32, 64], w2 [8, 64, 32]), one mHC stream,
# float32, no compression, Engram or drafter.
SMALL = djax.preset(
    "tiny-v41",
    num_hidden_layers=1,
    compress_ratios=(0,),
    kv_source_layer_ids=(),
    index_source_layer_ids=(),
    candidate_source_layer_id=-1,
    engram_layer_ids=(),
    engram_num_embeddings=(),
    dspark_target_layer_ids=(),
    num_nextn_predict_layers=0,
    replay_keep_tokens=0,
    hc_mult=1,
)
EXPERT = re.compile(r"\.experts\.w[123]$")


def _decode_one(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def _bits(x) -> np.ndarray:
    """f32 bit patterns: equality that tells -0.0 from +0.0."""
    return np.asarray(x, np.float32).view(np.uint32)


def test_e2m1_table_is_the_format():
    assert [_decode_one(c) for c in range(16)] == fp4.E2M1_TABLE.tolist()


def test_dequantize_matches_explicit_decode():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 5, 48), dtype=np.uint8)  # [experts, out, in / 2]
    scale = rng.integers(120, 135, (3, 5, 3), dtype=np.uint8)
    got = np.asarray(fp4.dequantize_fp4(packed.view(np.int8), scale, np.float32))
    want = np.zeros((3, 5, 96), np.float32)
    for idx in np.ndindex(3, 5, 48):
        lo, hi = packed[idx] & 15, packed[idx] >> 4
        s = 2.0 ** (int(scale[idx[0], idx[1], idx[2] // 16]) - 127)
        want[idx[0], idx[1], 2 * idx[2]] = _decode_one(lo) * s
        want[idx[0], idx[1], 2 * idx[2] + 1] = _decode_one(hi) * s
    np.testing.assert_array_equal(got, want)


def test_quantize_round_trip_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    packed, scale = fp4.quantize_fp4(w)
    back = np.asarray(fp4.dequantize_fp4(packed, scale, np.float32))
    step = 2.0 ** (scale.astype(np.float32) - 127)  # one unit at the largest e2m1 spacing is 2 * scale
    err = np.abs(back - w).reshape(4, 2, 32).max(-1)
    assert (err <= step + 1e-7).all()


def test_pack_unpack_and_quantize_are_exact_on_representable_values():
    """Random codes (all 16, -0.0 included) times a random power of two per group survive
    pack -> unpack and quantize -> dequantize bit for bit (signed zeros too)."""
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, (3, 5, 96)).astype(np.uint8)
    codes[0, 0, :16] = np.arange(16)
    codes[..., ::32] = rng.choice([7, 15], codes[..., ::32].shape)  # |6| in every group: scale is exact
    assert set(np.unique(codes)) == set(range(16))
    np.testing.assert_array_equal(_bits(fp4.unpack_e2m1(fp4.pack_e2m1(codes))), _bits(fp4.E2M1_TABLE[codes]))

    exps = rng.integers(-20, 20, (3, 5, 3))
    w = fp4.E2M1_TABLE[codes] * np.repeat(2.0**exps, 32, axis=-1).astype(np.float32)
    packed, scale = fp4.quantize_fp4(w)
    np.testing.assert_array_equal(scale.astype(int) - 127, exps)
    np.testing.assert_array_equal(packed, fp4.pack_e2m1(codes))
    np.testing.assert_array_equal(_bits(fp4.dequantize_fp4(packed, scale, jnp.float32)), _bits(w))


@pytest.mark.parametrize("scale_dtype", ["u8", "e8m0", "f32", "bf16"])
def test_fp4_qarray_index_equals_dequantize_then_index(scale_dtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 8, 64)).astype(np.float32)
    packed, e8 = fp4.quantize_fp4(w)
    scale = {
        "u8": e8,
        "e8m0": e8.view(ml_dtypes.float8_e8m0fnu),
        "f32": 2.0 ** (e8.astype(np.float32) - 127),
        "bf16": (2.0 ** (e8.astype(np.float32) - 127)).astype(ml_dtypes.bfloat16),
    }[scale_dtype]
    q = from_fp4(jnp.asarray(packed.view(np.int8)), jnp.asarray(scale))
    assert q.is_fp4 and q.shape == (6, 8, 64) and q.dtype == FP4 and q.ndim == 3
    assert q.scale.dtype == (E8M0 if scale_dtype in ("u8", "e8m0") else jnp.dtype(scale.dtype))
    full = np.asarray(dense(q, jnp.float32))
    np.testing.assert_array_equal(full, np.asarray(fp4.dequantize_fp4(packed, e8, jnp.float32)))
    idx = jnp.asarray(rng.integers(0, 6, (5, 2)))  # [tokens, top-k], as experts_gather indexes
    gathered = jax.jit(lambda q, i: dense(q[i], jnp.float32))(q, idx)
    np.testing.assert_array_equal(np.asarray(gathered), full[np.asarray(idx)])
    np.testing.assert_array_equal(np.asarray(dense(q[2], jnp.float32)), full[2])
    np.testing.assert_array_equal(np.asarray(dense(q[1:4], jnp.float32)), full[1:4])
    with pytest.raises(IndexError, match="leading dims"):
        q[0, 1]
    with pytest.raises(ValueError, match="FP4 scale shape"):
        from_fp4(packed, e8[..., :1])


@pytest.mark.parametrize("impl", ["gather", "batched", "ragged", "dense"])
def test_routed_experts_on_fp4_equal_dequantized(impl):
    """Every routed-expert implementation gives the same output on kept FP4 weights as on their
    dequantized values: dequantizing is exact in float32 (e2m1 x power of two), so bit-equal."""
    rng = np.random.default_rng(4)
    e, f, d, n, k = 8, 32, 64, 12, 2
    shapes = ((e, f, d), (e, d, f), (e, f, d))
    ws = [
        from_fp4(*map(jnp.asarray, fp4.quantize_fp4(rng.standard_normal(s).astype(np.float32))))
        for s in shapes
    ]
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    idx = jnp.asarray(np.argsort(rng.standard_normal((n, e)), -1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    fn = jax.jit(partial(getattr(moe, f"experts_{impl}"), limit=10.0))
    got = fn(x, weights, idx, *ws)
    want = fn(x, weights, idx, *(dense(w, jnp.float32) for w in ws))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- checkpoints ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp4_checkpoint(tmp_path_factory):
    """SMALL's random params with every routed expert as an FP4 QArray, saved by `save_pretrained`."""
    flat = flatten_names(random_params(SMALL, 5))
    for name in [n for n in flat if EXPERT.search(n)]:
        flat[name] = from_fp4(*map(jnp.asarray, fp4.quantize_fp4(np.asarray(flat[name]))))
    params = unflatten_names(flat, v4.declare(SMALL))
    path = tmp_path_factory.mktemp("fp4")
    djax.save_pretrained(params, SMALL, path)
    return params, path


@pytest.fixture(scope="module")
def loaded(fp4_checkpoint):
    _, path = fp4_checkpoint
    cfg, kept = djax.load_checkpoint(path, keep_quantized=True, progress=False)
    cfg2, deq = djax.load_checkpoint(path, progress=False)
    assert cfg == cfg2 == SMALL.replace(expert_dtype="fp4")  # save_pretrained says the experts are FP4
    return cfg, kept, deq


def test_kept_fp4_load_is_the_saved_bytes_and_dequantized_load_their_values(fp4_checkpoint, loaded):
    params, path = fp4_checkpoint
    cfg, kept, deq = loaded
    header = SafetensorsFile(path / "model.safetensors")
    assert header.dtype("layers.0.ffn.experts.3.w2.weight") == "U8"
    assert header.dtype("layers.0.ffn.experts.3.w2.scale") == "F8_E8M0"
    want, got_kept, got_deq = flatten_names(params), flatten_names(kept), flatten_names(deq)
    experts = [n for n in want if EXPERT.search(n)]
    assert len(experts) == 3
    kept_bytes = 0
    for name, w in want.items():
        if name in experts:
            q = got_kept[name]
            assert isinstance(q, QArray) and q.is_fp4 and q.shape == w.shape and q.scale.dtype == E8M0
            np.testing.assert_array_equal(np.asarray(q.values), np.asarray(w.values))
            np.testing.assert_array_equal(_bits(q.scale), _bits(w.scale))
            n = int(np.prod(w.shape))
            assert q.values.nbytes + q.scale.nbytes == q.nbytes == n // 2 + n // 32  # 0.53 byte a value
            kept_bytes += q.nbytes
            assert got_deq[name].dtype == jnp.float32
            np.testing.assert_array_equal(_bits(got_deq[name]), _bits(dense(w, jnp.float32)))
        else:
            for got in (got_kept[name], got_deq[name]):
                assert got.dtype == w.dtype
                np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    # The plan's accounting (config.expert_dtype == "fp4") is what the kept load holds.
    assert v4.bytes_by_category(cfg)["experts"]["bytes"] == kept_bytes
    assert v4.bytes_by_category(SMALL)["experts"]["bytes"] == 4 * sum(
        int(np.prod(want[n].shape)) for n in experts
    )


def test_kept_fp4_generates_like_the_dequantized_load(loaded):
    """Prefill and greedy decode through `djax.generate` give the same tokens (batched experts for the
    prompt, gathered experts per decode step)."""
    cfg, kept, deq = loaded
    prompts = [[5, 9, 17, 3, 250, 11, 40], [7, 8]]
    a = djax.generate(kept, prompts, cfg, max_new_tokens=6)
    b = djax.generate(deq, prompts, cfg, max_new_tokens=6)
    assert a.to_lists() == b.to_lists()


def test_kept_fp4_prefill_and_decode_logits_equal_the_dequantized_load(loaded):
    """Bit-equal logits: in float32 dequantizing is exact, and each matmul sees the same numbers."""
    cfg, kept, deq = loaded

    @jax.jit
    def run(params):
        tokens = jnp.asarray([[5, 9, 17, 3, 250, 11], [7, 8, 0, 0, 0, 0]])
        logits, state = v4.prefill(params, tokens, jnp.asarray([6, 2]), cfg, 12)

        def step(state, tok):
            out, state = v4.decode_step(params, tok, state, cfg)
            return state, out

        _, decoded = jax.lax.scan(step, state, jnp.asarray([[31, 32], [64, 65]]))
        return jnp.concatenate([logits[None], decoded])

    np.testing.assert_array_equal(np.asarray(run(kept)), np.asarray(run(deq)))


def test_fp4_scale_formats_load_alike(fp4_checkpoint, tmp_path):
    """UE8M0 as U8 or F8_E8M0, or the same powers of two as F32 / BF16: all load to the same values."""
    _, path = fp4_checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    src = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(src.get(k)) for k in src.keys()}
    scales = [k for k in tensors if re.search(r"\.experts\.\d+\.w[123]\.scale$", k)]
    as_u8 = {k: tensors[k].view(np.uint8) for k in scales}
    powers = {k: tensors[k].astype(np.float32) for k in scales}
    for fmt in (as_u8, powers, {k: v.astype(ml_dtypes.bfloat16) for k, v in powers.items()}):
        save_file({**tensors, **fmt}, tmp_path / "model.safetensors")
        _, kept = djax.load_checkpoint(tmp_path, keep_quantized=True, progress=False)
        _, deq = djax.load_checkpoint(tmp_path, progress=False)
        w = kept["layers"][0]["ffn"]["experts"]["w3"]
        ref = fp4.dequantize_fp4(w.values[2], as_u8["layers.0.ffn.experts.2.w3.scale"], jnp.float32)
        np.testing.assert_array_equal(np.asarray(dense(w[2], jnp.float32)), np.asarray(ref))
        np.testing.assert_array_equal(
            np.asarray(deq["layers"][0]["ffn"]["experts"]["w3"][2]), np.asarray(ref)
        )
        assert w.scale.dtype == (E8M0 if fmt is as_u8 else jnp.dtype(next(iter(fmt.values())).dtype))


def test_fp4_tensor_of_the_wrong_shape_is_named(fp4_checkpoint, tmp_path):
    _, path = fp4_checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    src = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(src.get(k)) for k in src.keys()}
    bad = "layers.0.ffn.experts.5.w2.weight"
    tensors[bad] = tensors[bad][:, :8]  # [64, 16] packed -> [64, 8]: 16 inputs, the config says 32
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        djax.CheckpointError,
        match=r"FP4 tensor 'layers\.0\.ffn\.experts\.5\.w2\.weight' has shape \(64, 8\), expected \(64, 16\)",
    ):
        djax.load_checkpoint(tmp_path, keep_quantized=True, progress=False)


def test_kept_fp4_loads_onto_shardings(fp4_checkpoint):
    _, path = fp4_checkpoint
    mesh = jax.make_mesh((1, 1, 1), ("dp", "ep", "tp"))
    shardings = djax.param_shardings(SMALL, mesh)
    _, kept = djax.load_checkpoint(path, keep_quantized=True, shardings=shardings, progress=False)
    w1 = kept["layers"][0]["ffn"]["experts"]["w1"]
    assert isinstance(w1, QArray) and w1.is_fp4
    assert w1.values.sharding.spec == shardings["layers"][0]["ffn"]["experts"]["w1"].spec
    placed = djax.shard_params(kept, SMALL, mesh)
    assert placed["layers"][0]["ffn"]["experts"]["w1"].scale.dtype == E8M0


def test_kept_fp4_orbax_round_trip(loaded, tmp_path):
    cfg, kept, _ = loaded
    djax.save_params(kept, tmp_path / "kept")
    restored = djax.restore_params(tmp_path / "kept", cfg)
    for name, w in flatten_names(kept).items():
        got = flatten_names(restored)[name]
        if isinstance(w, QArray):
            assert got.is_fp4 and got.scale.dtype == E8M0 and got.block == w.block
            np.testing.assert_array_equal(np.asarray(got.values), np.asarray(w.values))
            np.testing.assert_array_equal(_bits(got.scale), _bits(w.scale))
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
