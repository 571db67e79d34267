"""Mixture of experts: routing (sqrtsoftplus / sigmoid / softmax scores, selection-only bias, hash tables,
group-limited choice) and the routed experts as a sorted grouped GEMM, with a dense slow twin."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from djax.config import ModelConfig
from djax.models.layers import linear, swiglu, swiglu_act, takes_fp8_grouped, top_k
from djax.quant import dense


def _score(logits: jax.Array, func: str) -> jax.Array:
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "sigmoid":
        return jax.nn.sigmoid(logits)
    if func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"unknown scoring_func {func!r}")


def route(
    x: jax.Array,
    gate: dict,
    cfg: ModelConfig,
    token_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pick experts per token. x: [n, d]. Returns weights f32[n, k] and expert ids int32[n, k].

    The bias (`gate['bias']`) only steers the choice; weights come from the unbiased scores. Hash
    layers (`gate['tid2eid']`, int[vocab, k]) take the choice from the token id instead.
    """
    logits = linear(x, gate["weight"]).astype(jnp.float32)  # f32[n, e]
    scores = _score(logits, cfg.scoring_func)
    k = cfg.num_experts_per_tok
    if "tid2eid" in gate:
        if token_ids is None:
            raise ValueError("hash-routed MoE layers need the token ids")
        idx = gate["tid2eid"][token_ids].astype(jnp.int32)
    else:
        choice = scores + gate["bias"].astype(jnp.float32) if "bias" in gate else scores
        if cfg.model_type == "deepseek_v3" and cfg.n_group > 1:
            n, e = choice.shape
            grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
            group_score = top_k(grouped, 2)[0].sum(-1)  # [n, groups]
            _, keep = top_k(group_score, cfg.topk_group)
            group_mask = jnp.any(keep[:, :, None] == jnp.arange(cfg.n_group), axis=1)  # [n, n_group]
            choice = jnp.where(jnp.repeat(group_mask, e // cfg.n_group, axis=1), choice, -jnp.inf)
        _, idx = top_k(choice, k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.is_v4 or cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, idx


_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def _ragged(xs: jax.Array, w, sizes: jax.Array) -> jax.Array:
    """xs [m, i] (rows grouped by expert) times each group's w[e] [o, i] (torch layout, no transpose): [m, o]."""
    return jax.lax.ragged_dot_general(xs, dense(w, xs.dtype), sizes, _RAGGED)


def experts_ragged(x, weights, idx, w1, w2, w3, limit: float) -> jax.Array:
    """Routed experts as one grouped GEMM over token copies sorted by expert (`ragged_dot_general`).

    x: [n, d]; weights f32[n, k]; idx int32[n, k]; w1, w3: [e, f, d]; w2: [e, d, f]. Returns [n, d].
    """
    n, d = x.shape
    e, k = w1.shape[0], idx.shape[1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    xs = x[tok]  # [n*k, d], expert-contiguous
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    h = swiglu_act(_ragged(xs, w1, sizes), _ragged(xs, w3, sizes), limit)
    out = _ragged(h, w2, sizes)  # [n*k, d]
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
    return jnp.zeros((n, d), out.dtype).at[tok].add(out)


def experts_gather(x, weights, idx, w1, w2, w3, limit: float) -> jax.Array:
    """Few tokens (decode): gather each (token, choice)'s expert matrices; reads only the experts chosen."""
    dt = x.dtype
    g1, g3, g2 = dense(w1[idx], dt), dense(w3[idx], dt), dense(w2[idx], dt)  # [n, k, f, d], [n, k, d, f]
    h = swiglu_act(jnp.einsum("nd,nkfd->nkf", x, g1), jnp.einsum("nd,nkfd->nkf", x, g3), limit)
    out = jnp.einsum("nkf,nkdf->nkd", h, g2)
    return jnp.einsum("nkd,nk->nd", out, weights.astype(dt))


def experts_batched(x, weights, idx, w1, w2, w3, limit: float) -> jax.Array:
    """Every expert on every token as three batched GEMMs, combined by the routing weights.

    Reads each expert once: near the memory floor when most experts are touched (decode at large
    batch), wasteful in FLOPs for long prefills.
    """
    dt = x.dtype
    e = w1.shape[0]
    combine = jnp.zeros((x.shape[0], e), jnp.float32).at[jnp.arange(x.shape[0])[:, None], idx].add(weights)
    h = swiglu_act(
        jnp.einsum("nd,efd->enf", x, dense(w1, dt)), jnp.einsum("nd,efd->enf", x, dense(w3, dt)), limit
    )
    # Two steps: one einsum over three operands lets XLA transpose all of w2 on every call.
    out = jnp.einsum("enf,edf->end", h, dense(w2, dt))
    return jnp.einsum("end,ne->nd", out, combine.astype(dt))


def experts_triton(x, weights, idx, w1, w2, w3, limit: float) -> jax.Array:
    """The grouped GEMM kernels (djax.kernels.moe_experts, CUDA): picks sorted into BLOCK_M-aligned expert
    groups, fused gate/up SwiGLU, down projection, weighted combine. Reads each touched expert once."""
    from djax.kernels.moe_experts import moe_experts_triton

    return moe_experts_triton(x, weights, idx, w1, w2, w3, limit)


def experts_fp8(x, weights, idx, w1, w2, w3, limit: float, impl: str = "auto") -> jax.Array:
    """FP8 experts in DeepGEMM's layout read as stored by the block-scaled grouped GEMMs
    (`djax.kernels.moe_experts.moe_experts_fp8`; impl as `grouped_contiguous`'s: "auto" the Triton kernels on
    CUDA, TileLang's grouped GEMMs over 128-row groups from 24 picks an expert (prefill), the jnp spec
    elsewhere; "triton", "ref", "interpret", or "tilelang"), the activations
    quantized 1x128 as in DeepSeek's inference. On the H200 at V4-Flash's expert shapes 22-138x faster than
    making the stack dense on use at decode and 4.9x at 4,096 tokens (bench_kernels' moe_fp8 section,
    kernels_h200_moe_fp8_fused_default.json)."""
    from djax.kernels.moe_experts import moe_experts_fp8  # here: the kernel modules import Triton

    return moe_experts_fp8(x, weights, idx, w1, w2, w3, limit, impl)


def experts_grouped(x, weights, idx, w1, w2, w3, limit: float, fp8: str | None = None) -> jax.Array:
    """The fast path, chosen by the (static) shapes and the backend. On CUDA the Triton grouped GEMMs at
    every size (for FP8 weights that `takes_fp8_grouped`, the FP8 ones: `experts_fp8`, TileLang's grouped GEMMs
    from 24 picks an expert; FP4 experts with
    UE8M0 scales, V4.1's, are read as stored by the bf16 ones, which decode each tile): they read each
    touched expert once, while XLA lowers `ragged_dot` densely there (every expert on every row) and the
    gather path writes a copy of every (token, choice)'s matrices (on the H200 it made a 32-row decode step
    2.3x slower than a 128-row one). Elsewhere gather for a few tokens, all experts batched for a
    decode-sized batch and the grouped ragged GEMM for prefill (and so for float32 on CUDA too).
    `fp8` (a decode step's impl for FP8 weights, as `moe_with_counts`): FP8 experts take `experts_fp8` with
    it on any backend."""
    from djax.kernels.dispatch import has_triton, on_cuda

    n, k, e = x.shape[0], idx.shape[1], w1.shape[0]
    d, f = x.shape[1], w1.shape[1]
    fp8_weights = all(takes_fp8_grouped(w) for w in (w1, w2, w3))
    if fp8 is not None and fp8_weights:
        return experts_fp8(x, weights, idx, w1, w2, w3, limit, fp8)
    # Whole GEMM tiles only, and bf16: the kernels' tiles are sized for 2-byte operands (float32 ones need
    # more shared memory than an H200 block may have).
    if on_cuda() and has_triton() and d % 128 == 0 and f % 128 == 0 and x.dtype == jnp.bfloat16:
        if fp8_weights:  # "auto": Triton's, or TileLang's GEMMs at prefill (`moe_experts.tilelang_takes`)
            return experts_fp8(x, weights, idx, w1, w2, w3, limit, "auto")
        return experts_triton(x, weights, idx, w1, w2, w3, limit)
    if n * k <= e:
        return experts_gather(x, weights, idx, w1, w2, w3, limit)
    if n <= 256:
        return experts_batched(x, weights, idx, w1, w2, w3, limit)
    return experts_ragged(x, weights, idx, w1, w2, w3, limit)


def experts_dense(x, weights, idx, w1, w2, w3, limit: float) -> jax.Array:
    """Slow twin of `experts_grouped`: every expert on every token, masked by the routing."""
    e = w1.shape[0]
    combine = jnp.zeros((x.shape[0], e), jnp.float32).at[jnp.arange(x.shape[0])[:, None], idx].add(weights)

    def one(acc, ei):
        y = swiglu(x, w1[ei], w2[ei], w3[ei], limit)
        return acc + y * combine[:, ei, None].astype(y.dtype), None

    out, _ = jax.lax.scan(one, jnp.zeros_like(x), jnp.arange(e))
    return out


@dataclass(frozen=True)
class ExpertParallel:
    """Run the routed experts expert-parallel over `mesh` axis "ep" (`moe_ep`); pass it where a moe impl goes.

    Hashable, so it is a static argument of jitted steps like the impl names. Capacity is the full
    token count, so nothing is dropped; `local` is the impl each device runs on its own experts.
    """

    mesh: Mesh
    local: str = "grouped"


def to_physical(idx: jax.Array, experts: dict) -> jax.Array:
    """Logical expert ids int32[n, k] -> physical slots under the placement in `experts` (identity without one).

    A placed layer (`djax.eplb.apply_placement`) carries "log2phy" int32[e, w] (-1 padded) and
    "logcnt" int32[e]. Token t's choice of expert x goes to replica t % logcnt[x]: deterministic,
    and a hot expert's tokens spread evenly over its replicas (which hold identical weights).
    """
    if "log2phy" not in experts:
        return idx
    rep = jnp.arange(idx.shape[0], dtype=jnp.int32)[:, None] % experts["logcnt"][idx]
    return experts["log2phy"][idx, rep]


def moe_with_counts(
    x: jax.Array,
    p: dict,
    cfg: ModelConfig,
    token_ids: jax.Array | None,
    impl: str | ExpertParallel = "grouped",
    valid: jax.Array | None = None,
    fp8: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`moe` plus the router's load: (out [..., d], counts int32[e]) where counts[x] is the number of
    (token, choice) pairs routed to logical expert x among the tokens where `valid` (bool[...]) holds.
    `fp8`: how FP8 weights in DeepGEMM's layout run ("auto", "ref", "triton" or "interpret": an impl both
    `djax.kernels.fp8_gemm` and its `grouped_contiguous` take; or None): the shared
    experts' projections (`layers.linear`; None: made dense on use) and, under impl "grouped", routed experts
    that `takes_fp8_grouped` (passed on to `experts_grouped`, which then takes `experts_fp8`)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    ids = None if token_ids is None else token_ids.reshape(-1)
    weights, idx = route(flat, p["gate"], cfg, ids)
    e = p["gate"]["weight"].shape[0]
    ok = (
        jnp.ones(idx.shape, jnp.int32) if valid is None else jnp.broadcast_to(valid.reshape(-1, 1), idx.shape)
    )
    counts = jnp.zeros((e,), jnp.int32).at[idx].add(ok.astype(jnp.int32))
    ex = p["experts"]
    phys = to_physical(idx, ex)
    impls = {
        "grouped": experts_grouped,
        "gather": experts_gather,
        "batched": experts_batched,
        "ragged": experts_ragged,
        "triton": experts_triton,
        "fp8": experts_fp8,
        "dense": experts_dense,
    }
    limit = cfg.swiglu_limit if cfg.is_v4 else 0.0
    if isinstance(impl, ExpertParallel):
        from djax.models.moe_ep import moe_ep

        routed, _ = moe_ep(
            flat, weights, phys, ex["w1"], ex["w2"], ex["w3"], limit, impl.mesh, None, impl.local
        )
    elif impl == "grouped":
        routed = experts_grouped(flat, weights, phys, ex["w1"], ex["w2"], ex["w3"], limit, fp8)
    elif impl in impls:
        routed = impls[impl](flat, weights, phys, ex["w1"], ex["w2"], ex["w3"], limit)
    else:
        raise ValueError(f"unknown moe impl {impl!r}; choose one of {sorted(impls)} or an ExpertParallel")
    sh = p["shared_experts"]
    shared = swiglu(flat, sh["w1"]["weight"], sh["w2"]["weight"], sh["w3"]["weight"], limit, fp8)
    return (routed + shared).reshape(shape), counts


def moe(
    x: jax.Array,
    p: dict,
    cfg: ModelConfig,
    token_ids: jax.Array | None,
    impl: str | ExpertParallel = "grouped",
) -> jax.Array:
    """Routed experts plus the shared expert. x: [..., d]; token_ids: int[...] (hash layers).

    impl: "grouped" (the fast path for the shapes at hand), "gather", "batched", "ragged", "triton" and
    "fp8" (the CUDA kernels for bf16 and FP8 experts), "dense" (the slow twin: a scan over experts), or an
    `ExpertParallel`. Experts relaid by an EPLB
    placement ([num_physical, ...] weights with "log2phy" / "logcnt") are routed through `to_physical`.
    """
    return moe_with_counts(x, p, cfg, token_ids, impl)[0]
