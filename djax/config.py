"""Static configuration: ModelConfig (one per checkpoint) and SamplingParams; frozen, hashable, jit-static."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SHARED = "shared_compressed_attention"  # V4.1: ratio 1 / 2 entries computed by KV-source layers only
V4_FAMILY = ("deepseek_v4", "deepseek_v41")
CSA_RATIO = 4  # the only ratio with overlapping windows and an indexer


@dataclass(frozen=True)
class ModelConfig:
    """One model of the DeepSeek family. Field names follow DeepSeek's config.json.

    `compress_ratios[i]` is 0 for a sliding-window-only layer, 4 (CSA: overlapping windows and a
    lightning indexer) or 128 (HCA) for a compressed layer. The first `num_hash_layers` MoE layers
    route by a frozen token -> expert table. `dtype` is the dtype of the big weights and of the
    activations; norms, mHC and router biases stay float32 as in the reference.
    """

    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    # How the Sinkhorn loop compiles, not part of the model (config.json leaves it out): None unrolls
    # it on GPUs only, False keeps it rolled (training: see `mhc.sinkhorn`).
    hc_sinkhorn_unroll: bool | None = None
    hc_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # How the checkpoint stores routed experts: "fp4" (packed e2m1, per-32 UE8M0 scales; V4.1) or
    # None (the config dtype / FP8 like the other matrices). DeepSeek's config.json field; it only
    # sizes memory plans, the loader reads each tensor's own dtype.
    expert_dtype: str | None = None
    num_hash_layers: int = 3
    num_nextn_predict_layers: int = 1
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN (compressed layers for V4, every layer for V3); factor 1 / None means plain RoPE.
    rope_factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    # DeepSeek-V3 (MLA with a latent KV cache, sigmoid group-limited routing, dense first layers).
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    intermediate_size: int = 18432
    first_k_dense_replace: int = 3
    n_group: int = 8
    topk_group: int = 4
    # DeepSeek-V4.1: cross-layer compressed KV, two-level indexer, deferred mHC, Engram, DSpark.
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    # SWA bounded replay: prefill runs the layers after the last KV source over only the last
    # `replay_keep_tokens` tokens of a prompt (0 = off). V4.1 configs default to 140 = 128 + 12.
    replay_keep_tokens: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.model_type not in (*V4_FAMILY, "deepseek_v3"):
            raise ValueError(f"unsupported model_type {self.model_type!r}")
        if self.model_type == "deepseek_v41":
            _check_v41(self)
        if self.model_type == "deepseek_v4":
            if len(self.compress_ratios) != self.num_hidden_layers:
                raise ValueError(
                    f"compress_ratios has {len(self.compress_ratios)} entries, "
                    f"num_hidden_layers is {self.num_hidden_layers}"
                )
            bad = [r for r in self.compress_ratios if r < 0 or r == 1 or r == 2]
            if bad:
                raise ValueError(f"compress_ratios must be 0, 4 (CSA) or >= 3 (HCA); got {bad}")
            if self.head_dim * self.num_attention_heads % self.o_groups:
                raise ValueError("num_attention_heads * head_dim must divide into o_groups")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")

    # ---- derived facts -------------------------------------------------------------------------
    @property
    def is_v4(self) -> bool:
        """V4 and V4.1 (one implementation, V4.1 is configuration of it)."""
        return self.model_type in V4_FAMILY

    @property
    def is_v41(self) -> bool:
        return self.model_type == "deepseek_v41"

    def layer_type(self, i: int) -> str:
        """Ratio 4 layers carry overlapping windows and the lightning indexer (CSA), as in DeepSeek's code."""
        r = self.compress_ratios[i]
        if r == 0:
            return SLIDING
        if self.is_v41:
            return SHARED
        return CSA if r == CSA_RATIO else HCA

    def is_hash_layer(self, i: int) -> bool:
        return i < self.num_hash_layers

    def kv_source(self, i: int) -> int | None:
        """V4.1: the layer whose compressed pool layer i reads, the nearest KV source at or below i."""
        below = [s for s in self.kv_source_layer_ids if s <= i]
        return max(below) if below and self.compress_ratios[i] else None

    def index_source(self, i: int) -> int | None:
        """V4.1: the layer whose top-k selection layer i uses, the nearest index source at or below i."""
        below = [s for s in self.index_source_layer_ids if s <= i]
        return max(below) if below and self.compress_ratios[i] else None

    @property
    def last_kv_source(self) -> int:
        return max(self.kv_source_layer_ids, default=-1)

    @property
    def hc_deferred(self) -> bool:
        """V4.1's mHC: each sublayer's mix gives the next sublayer's pre weights; no hc_head tensors."""
        return self.is_v41

    @property
    def q_head_norm(self) -> bool:
        """V4 normalises every query head (weightless RMS norm); V4.1 does not."""
        return self.model_type == "deepseek_v4"

    @property
    def engram_columns(self) -> int:
        """Hashed table rows fetched per token and Engram layer: (n-gram orders) x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def is_dense_layer(self, i: int) -> bool:
        """V3 only: the first layers use a dense MLP instead of MoE."""
        return self.model_type == "deepseek_v3" and i < self.first_k_dense_replace

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.eos_token_id)

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    # ---- reading config.json ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any] | str | Path) -> ModelConfig:
        """Build from an HF / DeepSeek config.json (a dict, or a path to the file or its folder).

        Accepts transformers' spelling (`layer_types`, `compress_rates`, `mlp_layer_types`,
        nested `rope_parameters`) and DeepSeek's (`compress_ratios`, `num_hash_layers`,
        `rope_scaling`). Unknown keys are ignored; a missing required key is an error.
        """
        if not isinstance(cfg, dict):
            p = Path(cfg)
            cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        cfg = dict(cfg.get("text_config", cfg))
        mt = cfg.get("model_type", "deepseek_v4")
        if mt not in (*V4_FAMILY, "deepseek_v3"):
            raise ValueError(
                f"unsupported model_type {mt!r} (djax reads deepseek_v4, deepseek_v41 and deepseek_v3)"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in cfg.items() if k in names and v is not None}
        kw["model_type"] = mt
        eos = cfg.get("eos_token_id")
        kw["eos_token_id"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if "torch_dtype" in cfg and "dtype" not in cfg:
            kw["dtype"] = cfg["torch_dtype"]
        n = cfg["num_hidden_layers"]
        if mt == "deepseek_v41":
            kw.update(_v41_fields(cfg))
        if mt in V4_FAMILY:
            kw.update(_v4_layer_fields(cfg, n))
            kw.update(_rope_fields(cfg.get("rope_parameters", {}).get("compress") or cfg.get("rope_scaling")))
            if "qk_rope_head_dim" not in cfg:
                prf = cfg.get("partial_rotary_factor") or 64 / cfg.get("head_dim", 512)
                kw["qk_rope_head_dim"] = int(cfg.get("head_dim", 512) * prf)
        else:
            kw.update(_rope_fields(cfg.get("rope_scaling") or cfg.get("rope_parameters")))
            kw["compress_ratios"] = ()
            kw["num_hash_layers"] = 0
            kw["head_dim"] = cfg.get("qk_nope_head_dim", 128) + cfg.get("qk_rope_head_dim", 64)
            if cfg.get("q_lora_rank") is None:
                raise ValueError("DeepSeek-V3 configs without q_lora_rank are not supported")
        if kw.get("dtype") not in (None, "bfloat16", "float32", "float16"):
            kw["dtype"] = "bfloat16"
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """The config.json djax writes: DeepSeek's field names, readable by `from_hf` and HF transformers."""
        d = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "hc_sinkhorn_unroll"
        }
        d["eos_token_id"] = list(self.eos_token_id)
        rope = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": self.rope_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
        }
        v41_names = [f.name for f in dataclasses.fields(self)][
            [f.name for f in dataclasses.fields(self)].index("kv_source_layer_ids") : -1
        ]
        if self.is_v41:
            # DeepSeek's own layout: one ratio per layer plus the drafter's (sliding-only) layers.
            d["compress_ratios"] = list(self.compress_ratios) + [0] * self.num_nextn_predict_layers
            for k in _TUPLE_FIELDS:
                d[k] = list(d[k])
            d["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
            if self.rope_factor > 1:
                d["rope_scaling"] = rope
            for k in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
                d.pop(k)
            for k in ("first_k_dense_replace", "n_group", "topk_group", "mscale", "mscale_all_dim"):
                d.pop(k)
        elif self.is_v4:
            for k in v41_names:
                d.pop(k)
            d["compress_ratios"] = list(self.compress_ratios)
            d["layer_types"] = [self.layer_type(i) for i in range(self.num_hidden_layers)]
            hca = sorted({r for r in self.compress_ratios if r and r != CSA_RATIO})
            if len(hca) > 1:
                raise ValueError(f"HF's layout holds one HCA ratio, this config has {hca}")
            d["compress_rates"] = {CSA: CSA_RATIO, HCA: hca[0] if hca else 128}
            d["mlp_layer_types"] = [
                "hash_moe" if self.is_hash_layer(i) else "moe" for i in range(self.num_hidden_layers)
            ]
            d["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
            if self.rope_factor > 1:
                d["rope_scaling"] = rope
            for k in (
                "kv_lora_rank",
                "qk_nope_head_dim",
                "v_head_dim",
                "intermediate_size",
                "first_k_dense_replace",
                "n_group",
                "topk_group",
                "mscale",
                "mscale_all_dim",
            ):
                d.pop(k)
        else:
            for k in v41_names:
                d.pop(k)
            rope.update(mscale=self.mscale, mscale_all_dim=self.mscale_all_dim)
            d["rope_scaling"] = rope if self.rope_factor > 1 else None
            for k in (
                "compress_ratios",
                "o_lora_rank",
                "o_groups",
                "sliding_window",
                "index_n_heads",
                "index_head_dim",
                "index_topk",
                "hc_mult",
                "hc_sinkhorn_iters",
                "hc_eps",
                "compress_rope_theta",
                "swiglu_limit",
                "num_hash_layers",
                "head_dim",
            ):
                d.pop(k)
            d["topk_method"] = "noaux_tc"
            d["num_key_value_heads"] = self.num_attention_heads
        for k in ("rope_factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            d.pop(k, None)
        arch = "DeepseekV41ForCausalLM" if self.is_v41 else "DeepseekV4ForCausalLM"
        d["architectures"] = [arch if self.is_v4 else "DeepseekV3ForCausalLM"]
        return d


_TUPLE_FIELDS = (
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "engram_layer_ids",
    "engram_num_embeddings",
    "dspark_target_layer_ids",
)


def _v41_fields(cfg: dict) -> dict:
    """V4.1's extra fields; its MoE has no hash layers, its bounded replay is on unless set."""
    out = {k: tuple(int(v) for v in cfg[k]) for k in _TUPLE_FIELDS if cfg.get(k) is not None}
    if cfg.get("candidate_source_layer") is not None and cfg.get("candidate_source_layer_id") is None:
        out["candidate_source_layer_id"] = int(cfg["candidate_source_layer"])
    if cfg.get("engram_pad_token_id") is not None and cfg.get("engram_pad_id") is None:
        out["engram_pad_id"] = int(cfg["engram_pad_token_id"])
    out["num_hash_layers"] = 0
    out.setdefault("replay_keep_tokens", int(cfg.get("replay_keep_tokens", 140)))
    return out


def _check_v41(c: ModelConfig) -> None:
    """Refuse V4.1 configs whose sharing layout djax cannot run faithfully."""
    n = c.num_hidden_layers
    if len(c.compress_ratios) != n:
        raise ValueError(f"compress_ratios has {len(c.compress_ratios)} entries for {n} layers")
    bad = [r for r in c.compress_ratios if r not in (0, 1, 2)]
    if bad:
        raise ValueError(f"deepseek_v41 compress_ratios must be 0, 1 or 2; got {bad}")
    if c.num_hash_layers:
        raise ValueError("deepseek_v41 has no hash-routed layers")
    for s in c.kv_source_layer_ids:
        if not c.compress_ratios[s]:
            raise ValueError(f"KV source layer {s} has compress ratio 0")
        if s not in c.index_source_layer_ids:
            raise ValueError(f"KV source layer {s} must also be an index source (it owns the index keys)")
    for i in range(n):
        if not c.compress_ratios[i]:
            continue
        src, isrc = c.kv_source(i), c.index_source(i)
        if src is None or isrc is None:
            raise ValueError(f"compressed layer {i} has no KV source or index source at or below it")
        if c.compress_ratios[i] != c.compress_ratios[src] or c.kv_source(isrc) != src:
            raise ValueError(f"layer {i} disagrees with its KV source {src} (ratio or index source)")
    cs = c.candidate_source_layer_id
    if cs >= 0:
        if cs not in c.index_source_layer_ids or c.candidate_block_size < 1 or c.candidate_topk_blocks < 1:
            raise ValueError("candidate_source_layer_id must be an index source with blocks set")
    if len(c.engram_num_embeddings) != len(c.engram_layer_ids):
        raise ValueError("engram_num_embeddings needs one entry per Engram layer")
    if c.replay_keep_tokens and c.replay_keep_tokens < c.sliding_window:
        raise ValueError("replay_keep_tokens must be 0 (off) or at least sliding_window")


def _v4_layer_fields(cfg: dict, n: int) -> dict:
    out = {}
    if cfg.get("compress_ratios") is not None:
        ratios = list(cfg["compress_ratios"])
    elif cfg.get("layer_types") is not None:
        rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
        for legacy, key in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if cfg.get(legacy) is not None:
                rates[key] = cfg[legacy]
        rates[SLIDING] = 0
        if rates.get(CSA, CSA_RATIO) != CSA_RATIO:
            raise ValueError(
                f"CSA layers with compress rate {rates[CSA]} are not supported (only {CSA_RATIO})"
            )
        unknown = [t for t in cfg["layer_types"] if t not in rates]
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}")
        ratios = [rates[t] for t in cfg["layer_types"]]
    else:
        raise ValueError("a deepseek_v4 config needs compress_ratios or layer_types")
    # DeepSeek's own list can carry extra entries for the MTP layers: keep the main stack's.
    if len(ratios) < n:
        raise ValueError(f"compress_ratios has {len(ratios)} entries for {n} layers")
    out["compress_ratios"] = tuple(int(r) for r in ratios[:n])
    if cfg.get("mlp_layer_types") is not None:
        types = list(cfg["mlp_layer_types"])[:n]
        k = sum(t == "hash_moe" for t in types)
        if types[:k] != ["hash_moe"] * k:
            raise ValueError("hash_moe layers must come first in mlp_layer_types")
        out["num_hash_layers"] = k
    return out


def _rope_fields(rope: dict | None) -> dict:
    if not rope:
        return {"rope_factor": 1.0}
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in ("yarn", "default", "deepseek_yarn"):
        raise ValueError(f"unsupported rope type {rtype!r}")
    if rtype == "default":
        return {"rope_factor": 1.0}
    out = {"rope_factor": float(rope.get("factor", 1.0))}
    for src, dst in (
        ("original_max_position_embeddings", "original_max_position_embeddings"),
        ("beta_fast", "beta_fast"),
        ("beta_slow", "beta_slow"),
        ("mscale", "mscale"),
        ("mscale_all_dim", "mscale_all_dim"),
    ):
        if rope.get(src) is not None:
            out[dst] = rope[src]
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How `generate` picks tokens. temperature 0 means greedy; top_k 0 and top_p 1 mean no cut."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ---- presets ---------------------------------------------------------------------------------
def _v4_flash_ratios(n: int = 43) -> tuple[int, ...]:
    return tuple([0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, n)])


def _v41_flash() -> ModelConfig:
    """DeepSeek-V4.1-Flash as its config.json describes it (text model; 3 DSpark layers)."""
    return ModelConfig(
        model_type="deepseek_v41",
        hidden_size=5120,
        num_hidden_layers=40,
        q_lora_rank=1280,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer_id=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
        index_n_heads=32,
        n_routed_experts=384,
        moe_intermediate_size=2304,
        expert_dtype="fp4",
        num_hash_layers=0,
        num_nextn_predict_layers=3,
        rms_norm_eps=1e-20,
        engram_layer_ids=(1, 14),
        engram_num_embeddings=(384006168, 384016682),
        engram_compressed_vocab_size=99092,
        dspark_block_size=5,
        dspark_noise_token_id=128799,
        dspark_target_layer_ids=(37, 38, 39),
        dspark_markov_rank=256,
        dspark_n_routed_experts=128,
        dspark_num_experts_per_tok=3,
        replay_keep_tokens=140,
    )


PRESETS: dict[str, ModelConfig] = {
    "deepseek-v4.1-flash": _v41_flash(),
    # Every V4.1 feature at toy size: ratios 2 and 1, two KV sources with readers, a candidate source
    # feeding a later index source, Engram at two layers, a 3-layer drafter on layers 4 and 5.
    "tiny-v41": ModelConfig(
        model_type="deepseek_v41",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_lora_rank=16,
        o_groups=2,
        sliding_window=8,
        compress_ratios=(0, 2, 2, 1, 1, 1),
        kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3, 5),
        candidate_source_layer_id=3,
        candidate_topk_blocks=3,
        candidate_block_size=4,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=6,
        hc_mult=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_hash_layers=0,
        num_nextn_predict_layers=3,
        rope_factor=4.0,
        original_max_position_embeddings=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-20,
        engram_layer_ids=(1, 3),
        engram_num_embeddings=(152, 220),
        engram_max_ngram_size=3,
        engram_n_heads=2,
        engram_head_dim=8,
        engram_vocab_size=31,
        engram_compressed_vocab_size=300,
        dspark_block_size=4,
        dspark_noise_token_id=511,
        dspark_target_layer_ids=(4, 5),
        dspark_markov_rank=8,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
        replay_keep_tokens=12,
        dtype="float32",
    ),
    "deepseek-v4-flash": ModelConfig(compress_ratios=_v4_flash_ratios()),
    "deepseek-v3": ModelConfig(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        head_dim=192,
        qk_rope_head_dim=64,
        q_lora_rank=1536,
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
        rope_theta=10000.0,
        rope_factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
        max_position_embeddings=163840,
        eos_token_id=(1,),
        num_hash_layers=0,
    ),
    # Tiny sizes for tests and the CPU demo: every layer type, hash layers, mHC, YaRN.
    "tiny-v4": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_lora_rank=16,
        o_groups=2,
        sliding_window=8,
        compress_ratios=(0, 4, 16, 4, 16),
        # Enough indexer heads that a relu-zero tie between scores (all heads negative) is rare.
        index_n_heads=16,
        index_head_dim=16,
        index_topk=4,
        hc_mult=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_hash_layers=2,
        rope_factor=4.0,
        original_max_position_embeddings=64,
        max_position_embeddings=4096,
        dtype="float32",
    ),
    "tiny-v3": ModelConfig(
        model_type="deepseek_v3",
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        q_lora_rank=32,
        kv_lora_rank=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        first_k_dense_replace=1,
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
        rope_factor=4.0,
        original_max_position_embeddings=64,
        mscale=1.0,
        mscale_all_dim=1.0,
        max_position_embeddings=4096,
        num_hash_layers=0,
        dtype="float32",
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named config (`deepseek-v4-flash`, `deepseek-v4.1-flash`, `deepseek-v3`, `tiny-v4`, `tiny-v41`,
    `tiny-v3`) with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


__all__ = [
    "ModelConfig",
    "SamplingParams",
    "PRESETS",
    "preset",
    "SLIDING",
    "CSA",
    "HCA",
    "SHARED",
    "CSA_RATIO",
]
