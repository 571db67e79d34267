"""The offline engine: `LLM.generate` over continuous batching, paged decoder state, a prefix cache and async steps.

Host side here (requests, validation, outputs, the async loop); the device step and the store layout
are in `djax.engine_step`, the queues in `djax.scheduler`, pages and the prefix cache in `djax.paging`.

Prefix hits restore a snapshot of the slot state taken at the end of the hit's last block instead
of recomputing a window tail: with L layers the receptive field of a position grows by one window
per layer, so an exact tail replay needs about L x window tokens (5.5k for V4-Flash), more than
most prompts. A hit therefore recomputes nothing before its end, whatever the prefix length.

With a `mesh` (axes "dp", "ep", "tp" from `djax.make_mesh`) the steps run sharded: params placed by
`djax.shard_params` (or kept as given when already on that mesh, e.g. relaid by
`djax.apply_placement(..., mesh)`), the routed experts expert-parallel when ep > 1, and every
per-slot array (slot state, penalty counts, the plan's rows, sampling settings, sampled tokens)
sharded on "dp" along the slot axis, so max_num_seqs must divide by dp. The paged pools and the
prefix-cache snapshots are replicated on every device (see `djax.engine_step`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from djax.config import ModelConfig
from djax.config import SamplingParams as GenerateSampling
from djax.engine_sampling import RowSampling
from djax.engine_step import engine_step, init_store, init_store_on, row_sharding, sharded_step
from djax.models.moe import ExpertParallel
from djax.scheduler import Plan, Scheduler, Status
from djax.scheduler import Sequence as Seq
from djax.sharding import shard_params

# The embedded default model (HF layout, shipped in the package).
DEFAULT_MODEL = Path(__file__).parent / "assets" / "djax-tiny"

NUM_BANNED = 16  # EOS + stop ids masked while min_tokens is not reached


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. 0 means derived: block_size = lcm of the compress ratios (>= 16); num_pages fills every
    slot to max_model_len; max_num_batched_tokens = 16 per slot; widths = powers of two up to that."""

    max_num_seqs: int = 8
    max_model_len: int = 1024
    block_size: int = 0
    num_pages: int = 0
    max_num_batched_tokens: int = 0
    widths: tuple[int, ...] = ()
    num_snapshots: int = 64
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    max_logprobs: int = 20
    seed: int = 0
    moe_impl: str = "grouped"
    # Count the router's choices per layer and logical expert on the device (V4 family), for EPLB:
    # `Engine.expert_counts()` reads them. Every token fed counts, recomputed ones after preemption too.
    count_experts: bool = False

    def resolve(self, cfg: ModelConfig) -> EngineConfig:
        ratios = [r for r in getattr(cfg, "compress_ratios", ()) if r] or [1]
        block = self.block_size or max(16, math.lcm(*ratios))
        bad = [r for r in ratios if block % r]
        if bad:
            raise ValueError(f"block_size {block} must be a multiple of every compress ratio, not of {bad}")
        pages_per_seq = -(-self.max_model_len // block)
        budget = self.max_num_batched_tokens or 16 * self.max_num_seqs
        if budget < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per slot)")
        widths = self.widths or tuple(2**i for i in range(int(math.log2(budget // self.max_num_seqs)) + 1))
        return dataclasses.replace(
            self,
            block_size=block,
            num_pages=self.num_pages or self.max_num_seqs * pages_per_seq,
            max_num_batched_tokens=budget,
            widths=tuple(sorted(set(widths) | {1})),
        )


@dataclass
class RequestParams:
    """Per-request sampling and stopping (vLLM's names). Checked by the engine, which rejects only the bad request."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    @classmethod
    def of(cls, p) -> RequestParams:
        if p is None:
            return cls()
        if isinstance(p, GenerateSampling):
            return cls(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, ignore_eos=p.ignore_eos)
        if not isinstance(p, cls):
            raise TypeError(f"sampling params must be djax.RequestParams, got {type(p).__name__}")
        return p

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """One prompt's results: `outputs` has n completions; `error` is set (and outputs empty) when rejected."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0


# ---- the engine ----------------------------------------------------------------------------------
def _child_seed(seed: int, i: int) -> int:
    if i == 0:
        return seed
    return int.from_bytes(hashlib.sha1(f"{seed}/{i}".encode()).digest()[:4], "little")


def _on_mesh(params, config: ModelConfig, mesh: Mesh):
    """params on mesh: kept when every array already is (any rules, EPLB-placed included), else `shard_params`."""
    leaves = jax.tree.leaves(params)
    if all(
        isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
        for x in leaves
    ):
        return params
    if any("log2phy" in lp.get("ffn", {}).get("experts", {}) for lp in params.get("layers", [])):
        raise ValueError(
            "these params were relaid by djax.apply_placement without this mesh; "
            "pass mesh=... to apply_placement so the physical experts are placed on it"
        )
    return shard_params(params, config, mesh)


class Engine:
    """Continuous-batching engine over (config, params). `add_request` then `step` until `has_unfinished` is False.

    mesh: run sharded (see the module docstring); None runs on the default device.
    """

    def __init__(
        self,
        config: ModelConfig,
        params,
        engine_config: EngineConfig | None = None,
        tokenizer=None,
        mesh: Mesh | None = None,
    ):
        self.ec = ec = (engine_config or EngineConfig()).resolve(config)
        self.mesh, self.moe_impl = mesh, ec.moe_impl
        if mesh is not None:
            dp = mesh.shape.get("dp", 1)
            if ec.max_num_seqs % dp:
                raise ValueError(f"max_num_seqs={ec.max_num_seqs} must be a multiple of the mesh's dp={dp}")
            params = _on_mesh(params, config, mesh)
            if mesh.shape.get("ep", 1) > 1:
                self.moe_impl = ExpertParallel(mesh, ec.moe_impl)
        if ec.count_experts and not config.is_v4:
            raise ValueError(f"count_experts is implemented for the V4 family, not {config.model_type!r}")
        self.cfg, self.params, self.tokenizer = config, params, tokenizer
        self.sched = Scheduler(
            ec.max_num_seqs,
            ec.num_pages,
            -(-ec.max_model_len // ec.block_size),
            ec.block_size,
            ec.max_num_batched_tokens,
            ec.widths,
            ec.num_snapshots,
            ec.enable_prefix_caching,
        )
        self.store = init_store(config, ec) if mesh is None else init_store_on(config, ec, mesh)
        self._step = engine_step if mesh is None else sharded_step(config, ec, mesh)
        self.prev_tok = self._rows(np.zeros((ec.max_num_seqs,), np.int32))
        self.rng = np.random.default_rng(ec.seed)
        self.requests: dict[int, tuple[RequestOutput, list[Seq], RequestParams]] = {}
        self.owner: dict[int, tuple[int, int]] = {}  # seq_id -> (request_id, index)
        self._ids = 0
        self._pending = None
        self.num_steps = 0
        self.step_widths: list[int] = []
        self.step_time = {"dispatch": 0.0, "readback": 0.0}

    def expert_counts(self, reset: bool = False) -> np.ndarray:
        """Router choices int64[layers, experts] per logical expert since the start or the last reset
        (`EngineConfig(count_experts=True)`), ready for `djax.ExpertLoad.add_counts`. Reading waits for
        the steps in flight; reset after reading (the device counter is int32) to start a new window."""
        if "expert_counts" not in self.store:
            raise ValueError("expert counts are off: EngineConfig(count_experts=True) turns them on")
        counts = np.asarray(jax.device_get(self.store["expert_counts"]), np.int64)
        if reset:
            self.store["expert_counts"] = self.store["expert_counts"] * 0  # keeps its placement
        return counts

    # ---- requests ----
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (the checkpoint's tokenizer.json)")
            return list(self.tokenizer.encode(prompt).ids)
        arr = np.asarray(prompt)
        if arr.size == 0:
            raise ValueError("the prompt is empty")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError("a prompt must be a string or a flat list of integer token ids")
        return [int(t) for t in arr]

    def check(self, ids: list[int], p: RequestParams) -> None:
        """Raise ValueError naming the first problem of one request."""
        v, ec = self.cfg.vocab_size, self.ec
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {v})")

        def is_int(x):
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        if not is_int(p.max_tokens) or p.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {p.max_tokens!r}")
        limit = min(ec.max_model_len, self.cfg.max_position_embeddings)
        if len(ids) + p.max_tokens > limit:
            raise ValueError(
                f"{len(ids)} prompt tokens + max_tokens {p.max_tokens} exceed the context of {limit} tokens"
            )
        if not (
            isinstance(p.temperature, (int, float)) and math.isfinite(p.temperature) and p.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {p.temperature!r}")
        if not is_int(p.top_k) or p.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (or -1: off), got {p.top_k!r}")
        if not (isinstance(p.top_p, (int, float)) and 0 < p.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p!r}")
        if not (isinstance(p.min_p, (int, float)) and 0 <= p.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {p.min_p!r}")
        if not (isinstance(p.repetition_penalty, (int, float)) and 0 < p.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(p, name)
            if not (isinstance(x, (int, float)) and -2 <= x <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {x!r}")
        if p.seed is not None and not (is_int(p.seed) and 0 <= p.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {p.seed!r}")
        if not is_int(p.min_tokens) or not 0 <= p.min_tokens <= p.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {p.min_tokens!r}")
        if any(not is_int(t) or not 0 <= t < v for t in p.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ids in [0, {v}), got {p.stop_token_ids!r}")
        if p.min_tokens and len(p.stop_token_ids) + len(self.cfg.eos_ids) > NUM_BANNED:
            raise ValueError(f"min_tokens holds back at most {NUM_BANNED} EOS and stop ids")
        if p.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if p.logprobs is not None and not (is_int(p.logprobs) and 0 <= p.logprobs <= ec.max_logprobs):
            raise ValueError(f"logprobs must be an integer in [0, {ec.max_logprobs}], got {p.logprobs!r}")
        if not is_int(p.n) or p.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {p.n!r}")
        pages = -(-(len(ids) + p.max_tokens) // ec.block_size)
        if p.n > ec.max_num_seqs or p.n * pages > ec.num_pages:
            raise ValueError(
                f"n={p.n} is too large for the cache ({ec.max_num_seqs} slots, {ec.num_pages} pages of "
                f"{ec.block_size} tokens; each sample needs {pages})"
            )

    def add_request(self, prompt, params: RequestParams | None = None) -> int:
        """Queue one prompt (text or token ids); returns its request id. Raises ValueError for a bad request."""
        p = RequestParams.of(params)
        ids = self._encode(prompt)
        self.check(ids, p)
        rid, self._ids = self._ids, self._ids + 1
        seed = int(self.rng.integers(2**32)) if p.seed is None else int(p.seed)
        out = RequestOutput(rid, ids)
        seqs = []
        for i in range(p.n):
            seq = Seq(
                seq_id=rid * 65536 + i,
                tokens=list(ids),
                num_prompt=len(ids),
                params=p,
                seed=_child_seed(seed, i),
            )
            self.owner[seq.seq_id] = (rid, i)
            seqs.append(seq)
            self.sched.add(seq)
        self.requests[rid] = (out, seqs, p)
        return rid

    def has_unfinished(self) -> bool:
        return self.sched.has_work() or self._pending is not None

    # ---- steps ----
    def _stop_reason(self, seq: Seq) -> str | None:
        p, tok, n = seq.params, seq.tokens[-1], seq.num_output
        if n > p.min_tokens or n == p.max_tokens:
            if (not p.ignore_eos and tok in self.cfg.eos_ids) or tok in p.stop_token_ids:
                return "stop"
            if p.stop and self._stop_cut(seq) is not None:
                return "stop"
        return "length" if n >= p.max_tokens else None

    def _stop_cut(self, seq: Seq) -> int | None:
        text = self.tokenizer.decode(seq.output)
        cuts = [text.find(s) for s in seq.params.stop if s in text]
        return min(cuts) if cuts else None

    def _rows(self, x: np.ndarray) -> jax.Array:
        """A host array whose axis 0 is the slot: on the default device, or on "dp" of the mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, row_sharding(self.mesh))

    def _arrays(self, plan: Plan):
        S = self.ec.max_num_seqs
        samp = RowSampling.empty(S, NUM_BANNED)
        reset = np.zeros(S, bool)
        num_prompt = np.zeros(S, np.int32)
        want_lp = 0
        for r, seq in enumerate(plan.seqs):
            if seq is None:
                continue
            p = seq.params
            num_prompt[r] = seq.num_prompt
            reset[r] = plan.lengths[r] == 0 or plan.restore[r] >= 0
            samp["temperature"][r] = p.temperature
            samp["top_k"][r] = max(p.top_k, 0)
            samp["top_p"][r], samp["min_p"][r] = p.top_p, p.min_p
            samp["repetition_penalty"][r] = p.repetition_penalty
            samp["presence_penalty"][r], samp["frequency_penalty"][r] = (
                p.presence_penalty,
                p.frequency_penalty,
            )
            samp["seed"][r] = seq.seed
            index = plan.lengths[r] + plan.valid[r] - seq.num_prompt  # this token's index in the output
            samp["index"][r] = index
            if index < p.min_tokens:
                ban = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.cfg.eos_ids))
                samp["banned"][r, : len(ban)] = ban
            if p.logprobs is not None and plan.sample[r]:
                want_lp = self.ec.max_logprobs
        arrays = {
            k: self._rows(getattr(plan, k))
            for k in ("tokens", "from_prev", "lengths", "valid", "page_table", "restore", "save")
        }
        arrays["reset"], arrays["num_prompt"] = self._rows(reset), self._rows(num_prompt)
        return arrays, RowSampling(**{k: self._rows(v) for k, v in samp.items()}), want_lp

    def launch(self, plan: Plan, num_logprobs: int | None = None):
        """Send one step to the device; returns (tokens, logprobs, top ids, top logprobs), the store updated."""
        arrays, samp, nlp = self._arrays(plan)
        nlp = nlp if num_logprobs is None else num_logprobs
        *out, self.store = self._step(
            self.params,
            self.store,
            self.prev_tok,
            arrays,
            samp,
            self.cfg,
            self.ec.block_size,
            nlp,
            self.moe_impl,
        )
        return tuple(out)

    def _dispatch(self, plan: Plan):
        t0 = time.perf_counter()
        out = self.launch(plan)
        self.prev_tok = out[0]
        self.num_steps += 1
        self.step_widths.append(plan.width)
        self.step_time["dispatch"] += time.perf_counter() - t0
        return plan, out

    def warmup(self, logprobs: bool = False) -> None:
        """Compile the step for every width with all rows idle (a no-op on the state)."""
        S, P = self.ec.max_num_seqs, -(-self.ec.max_model_len // self.ec.block_size)
        for c in self.ec.widths:
            out = self.launch(Plan.idle(S, c, P), self.ec.max_logprobs if logprobs else 0)
            jax.block_until_ready(out[0])

    def _process(self, pending) -> list[int]:
        """Read back one step's tokens; returns the ids of requests that changed."""
        plan, outs = pending
        t0 = time.perf_counter()
        tok, lp, top_ids, top_lp = (np.asarray(x) for x in outs)
        self.step_time["readback"] += time.perf_counter() - t0
        got = self.sched.postprocess(plan, tok, self._stop_reason)
        rows = {id(s): r for r, s in enumerate(plan.seqs) if s is not None}
        changed = set()
        for seq in got:
            r = rows[id(seq)]
            if seq.params.logprobs is not None:
                entry = {int(seq.tokens[-1]): float(lp[r])}
                for i, l in zip(top_ids[r, : seq.params.logprobs], top_lp[r, : seq.params.logprobs]):
                    entry.setdefault(int(i), float(l))
                seq.logprobs.append(entry)
            changed.add(self.owner[seq.seq_id][0])
        return sorted(changed)

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one step; with async scheduling, read back the previous one after dispatching."""
        plan = self.sched.schedule()
        pending = self._dispatch(plan) if plan is not None else None
        changed = []
        if self.ec.async_scheduling:
            if self._pending is not None:
                changed = self._process(self._pending)
            self._pending = pending
        elif pending is not None:
            changed = self._process(pending)
        if plan is None and self._pending is None and self.sched.has_work() and not changed:
            raise RuntimeError("the scheduler is stuck: no step can run (too few pages for one sequence?)")
        return [self._output(rid) for rid in changed]

    def _output(self, rid: int) -> RequestOutput:
        out, seqs, p = self.requests[rid]
        out.outputs = []
        for i, seq in enumerate(seqs):
            ids = seq.output
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(ids)
                cut = self._stop_cut(seq) if p.stop and seq.finish_reason == "stop" else None
                text = text if cut is None else text[:cut]
            out.outputs.append(
                CompletionOutput(
                    i,
                    list(ids),
                    text,
                    seq.finish_reason,
                    list(seq.logprobs) if p.logprobs is not None else None,
                )
            )
        out.num_cached_tokens = seqs[0].num_cached
        out.finished = all(s.status == Status.FINISHED for s in seqs)
        return out


class LLM:
    """Offline batch generation: `LLM(path_or_(config, params)).generate(prompts, params)`.

    With no model, the embedded default (djax-tiny, DeepSeek-V4.1-Flash at toy size, shipped in the package)
    is loaded. mesh: run the engine's steps sharded over it (`djax.make_mesh`; see the module docstring).
    """

    def __init__(
        self,
        model=None,
        engine_config: EngineConfig | None = None,
        tokenizer=None,
        dtype: str | None = None,
        mesh: Mesh | None = None,
    ):
        if model is None:
            model = DEFAULT_MODEL
        if isinstance(model, (str, Path)):
            from djax.checkpoint import load_checkpoint

            config, params = load_checkpoint(model, dtype=dtype)
            tok_file = Path(model) / "tokenizer.json"
            if tokenizer is None and tok_file.exists():
                tokenizer = str(tok_file)
        else:
            config, params = model
        if isinstance(tokenizer, (str, Path)):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tokenizer))
        self.engine = Engine(config, params, engine_config, tokenizer, mesh)

    def _submit(self, prompts, params) -> list[RequestOutput]:
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        outs = []
        for prompt, p in zip(prompts, plist):
            try:
                rid = self.engine.add_request(prompt, p)
                outs.append(self.engine.requests[rid][0])
            except (ValueError, TypeError) as e:
                outs.append(RequestOutput(-1, [], finished=True, error=str(e)))
        return outs

    def stream(self, prompts, params=None) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (index of the prompt, its output so far) whenever a request gets tokens; rejected ones first."""
        outs = self._submit(prompts, params)
        index = {o.request_id: i for i, o in enumerate(outs) if o.error is None}
        for i, o in enumerate(outs):
            if o.error is not None:
                yield i, o
        while self.engine.has_unfinished():
            for o in self.engine.step():
                yield index[o.request_id], o

    def generate(self, prompts, params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in prompt order. A rejected request has `error` set; the others run to completion."""
        from tqdm.auto import tqdm

        outs = self._submit(prompts, params)
        live = {o.request_id: i for i, o in enumerate(outs) if o.error is None}
        bar = tqdm(total=len(live), desc="generating", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for o in self.engine.step():
                outs[live[o.request_id]] = o
                if o.finished:
                    bar.update(1)
        bar.close()
        return outs


__all__ = ["LLM", "Engine", "EngineConfig", "RequestParams", "RequestOutput", "CompletionOutput"]
