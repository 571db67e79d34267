"""DeepSeek-V4.1 configuration: reading config.json, the full-size declaration and its bytes by category."""

import jax
import pytest

import djax
from djax.config import ModelConfig, preset
from djax.models import deepseek_v4 as v4


def test_full_size_declaration_matches_published_parameter_counts():
    """Per-category counts of the 763.2B checkpoint (less its 0.49B vision tower), derived from its
    tensor headers: routed experts, attention (+ 4 compressors, 8 indexers), Engram, drafter."""
    cfg = preset("deepseek-v4.1-flash")
    abstract = djax.abstract_params(cfg)  # ShapeDtypeStructs only
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    table = v4.bytes_by_category(cfg)
    assert table["experts"]["params"] == 543_581_798_400
    assert table["attention"]["params"] == 5_064_696_320 + 18_352_128 + 43_516_416
    assert table["engram"]["params"] == 196_613_849_600 + 314_654_720
    assert table["drafter"]["params"] == 14_225_362_530
    token_map = cfg.vocab_size  # derived from the tokenizer, not a checkpoint tensor
    assert sum(r["params"] for r in table.values()) - token_map == 763_205_315_794 - 485_268_480
    # FP4 (expert_dtype="fp4"): half a byte a value + one UE8M0 scale byte per 32 values.
    assert table["experts"]["bytes"] == 543_581_798_400 // 2 + 543_581_798_400 // 32


def test_full_size_layout():
    cfg = preset("deepseek-v4.1-flash")
    assert [cfg.kv_source(i) for i in (0, 1, 2, 7, 8, 19, 20, 39)] == [None, None, 2, 2, 8, 14, 20, 20]
    assert [cfg.index_source(i) for i in (3, 20, 23, 24, 27, 36, 39)] == [2, 20, 20, 24, 24, 36, 36]
    tree = v4.declare(cfg)
    assert "compressor" in tree["layers"][2]["attn"] and "compressor" not in tree["layers"][3]["attn"]
    assert "wgate" not in tree["layers"][20]["attn"]["compressor"]  # ratio 1: one latent per token
    assert "wk" in tree["layers"][20]["attn"]["indexer"] and "wk" not in tree["layers"][24]["attn"]["indexer"]
    assert "hc_head_fn" not in tree and "engram" in tree["layers"][14]
    assert cfg.rms_norm_eps == 1e-20 and cfg.num_hash_layers == 0


def _hf_dict(cfg: ModelConfig) -> dict:
    d = cfg.to_hf()
    d["candidate_source_layer"] = d.pop("candidate_source_layer_id")
    return {"model_type": "deepseek_v41", "text_config": d}


def test_from_hf_round_trip_nested_text_config():
    for name in ("tiny-v41", "deepseek-v4.1-flash"):
        cfg = preset(name)
        d = _hf_dict(cfg)
        assert (
            len(d["text_config"]["compress_ratios"]) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        )
        assert ModelConfig.from_hf(d) == cfg
    d = _hf_dict(preset("tiny-v41"))
    d["text_config"].pop("replay_keep_tokens")
    assert ModelConfig.from_hf(d).replay_keep_tokens == 140  # bounded replay on by default


def test_refuses_bad_sharing_layouts():
    cfg = preset("tiny-v41")
    with pytest.raises(ValueError, match="0, 1 or 2"):
        cfg.replace(compress_ratios=(0, 4, 4, 1, 1, 1))
    with pytest.raises(ValueError, match="no KV source"):
        cfg.replace(kv_source_layer_ids=(3,))
    with pytest.raises(ValueError, match="index source"):
        cfg.replace(index_source_layer_ids=(3, 5))
