"""djax: the DeepSeek model family (V4, V3) and its inference engine as pure JAX functions."""

from djax.checkpoint import CheckpointError, load_checkpoint, quantize_projections, save_pretrained
from djax.config import PRESETS, ModelConfig, SamplingParams, preset
from djax.engine import LLM, CompletionOutput, Engine, EngineConfig, RequestOutput, RequestParams
from djax.eplb import (
    ExpertLoad,
    Placement,
    apply_placement,
    expert_counts,
    rebalance,
    rebalance_global,
    rebalance_hierarchical,
)
from djax.evaluate import evaluate
from djax.generate import Batch, Generated, generate
from djax.models.moe import ExpertParallel
from djax.orbax_io import restore_params, save_params
from djax.params import abstract_params, init_params
from djax.plan import plan
from djax.sharding import DEFAULT_RULES, ShardingRules, constrain, make_mesh, param_shardings, shard_params
from djax.step import decode, forward, init_state, prefill

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "ExpertParallel",
    "ExpertLoad",
    "Placement",
    "apply_placement",
    "evaluate",
    "expert_counts",
    "plan",
    "quantize_projections",
    "rebalance",
    "rebalance_global",
    "rebalance_hierarchical",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "LLM",
    "RequestOutput",
    "RequestParams",
    "DEFAULT_RULES",
    "ShardingRules",
    "constrain",
    "make_mesh",
    "param_shardings",
    "shard_params",
    "CheckpointError",
    "Generated",
    "ModelConfig",
    "PRESETS",
    "SamplingParams",
    "abstract_params",
    "decode",
    "forward",
    "generate",
    "init_params",
    "init_state",
    "load_checkpoint",
    "preset",
    "prefill",
    "restore_params",
    "save_params",
    "save_pretrained",
]
