"""The engine's device step: one jitted call per scheduler step over every slot, the store donated.

Store layout, and the cost of paging:
  store["slots"]["layers"][l]  per running slot: the layer's sliding-window ring and pending compressor
      rings; beside "layers", the model's other per-row state (Engram's token history)
  store["pages"][l]  [num_pages, block_size / m, k] pools of compressed entries (and indexer keys)
  store["snaps"]  store["slots"]'s tree, [num_snapshots, ...] copies of slot state at block ends (prefix hits)
  store["counts"], store["prompt_mask"]  [slots, vocab] for the penalties
  store["expert_counts"]  (count_experts) int32[layers, experts] router choices so far, replicated
On a mesh (`store_shardings`) the per-slot leaves ("slots", "counts", "prompt_mask") are sharded on
"dp" along the slot axis; "pages" and "snaps" are replicated, since any slot may own any page or
snapshot (the gather and the write-back then exchange rows between dp groups).
The step gathers each row's pages into a contiguous pool (the model's `extend` reads [b, cap, k]),
runs `extend` on the chunk, writes back only the pages the chunk touched, and samples. The gather
copies each row's whole pool every step, O(slots x pages_per_seq x block_size / m x k) per
compressed layer: about as many bytes as attention then reads from it (HCA reads all of it, CSA's
indexer scores all of it), so paging roughly doubles the pool traffic of a step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from djax.config import ModelConfig
from djax.engine_sampling import RowSampling, sample_rows
from djax.models import model_module


def init_store(cfg: ModelConfig, ec) -> dict:
    """The device store for resolved engine config ec (see the module docstring)."""
    tmpl = model_module(cfg).init_state(cfg, ec.max_num_seqs, ec.block_size)
    layers, pages = [], []
    for st in tmpl["layers"]:
        layers.append({k: v for k, v in st.items() if not k.endswith("pool")})
        pages.append(
            {k: jnp.zeros((ec.num_pages, *v.shape[1:]), v.dtype) for k, v in st.items() if k.endswith("pool")}
        )
    # The per-row state beside the layers' (Engram's token history) is slot state like theirs.
    slots = {"layers": layers, **{k: v for k, v in tmpl.items() if k not in ("layers", "lengths")}}
    n = max(1, ec.num_snapshots)  # kept with caching off too: the same compiled step serves both
    s, v = ec.max_num_seqs, cfg.vocab_size
    store = {
        "slots": slots,
        "pages": pages,
        "snaps": jax.tree.map(lambda x: jnp.zeros((n, *x.shape[1:]), x.dtype), slots),
        "counts": jnp.zeros((s, v), jnp.int32),
        "prompt_mask": jnp.zeros((s, v), bool),
    }
    if ec.count_experts:
        store["expert_counts"] = jnp.zeros((cfg.num_hidden_layers, cfg.n_routed_experts), jnp.int32)
    return store


ROW_KEYS = ("slots", "counts", "prompt_mask")  # store entries with the slot axis first


def row_sharding(mesh: Mesh) -> NamedSharding:
    """Arrays with the slot axis first: on "dp" along it (replicated when dp is 1 or absent)."""
    return NamedSharding(mesh, PartitionSpec("dp") if mesh.shape.get("dp", 1) > 1 else PartitionSpec())


def store_shardings(store: dict, mesh: Mesh) -> dict:
    """NamedShardings for a store (arrays or shapes): ROW_KEYS on "dp" along axis 0, the rest replicated."""
    row, rep = row_sharding(mesh), NamedSharding(mesh, PartitionSpec())
    return {k: jax.tree.map(lambda _, k=k: row if k in ROW_KEYS else rep, v) for k, v in store.items()}


def init_store_on(cfg: ModelConfig, ec, mesh: Mesh) -> dict:
    """`init_store` allocated in place on the mesh, laid out by `store_shardings` (never whole on one device)."""
    shapes = jax.eval_shape(lambda: init_store(cfg, ec))
    return jax.jit(lambda: init_store(cfg, ec), out_shardings=store_shardings(shapes, mesh))()


def _rows(mask: jax.Array, x: jax.Array) -> jax.Array:
    return mask.reshape(-1, *([1] * (x.ndim - 1)))


def _step(
    params, store, prev_tok, arrays: dict, sampling: RowSampling, cfg, block_size, num_logprobs, moe_impl
):
    """One scheduler step over every slot (row r = slot r). arrays: the Plan's fields plus reset bool[S] and
    num_prompt int32[S]. Returns (tokens int32[S], logprob f32[S], top ids int32[S, n], top logprobs, store)."""
    model = model_module(cfg)
    tokens, lengths, valid = arrays["tokens"], arrays["lengths"], arrays["valid"]
    page_table, restore, save = arrays["page_table"], arrays["restore"], arrays["save"]
    S, c = tokens.shape
    P, B = page_table.shape[1], block_size
    tokens = tokens.at[:, 0].set(jnp.where(arrays["from_prev"], prev_tok, tokens[:, 0]))

    def load(cur, snap):
        return jnp.where(_rows(restore >= 0, cur), snap[jnp.maximum(restore, 0)], cur)

    slots = jax.tree.map(load, store["slots"], store["snaps"])
    extra = {k: v for k, v in slots.items() if k != "layers"}
    if "expert_counts" in store:  # the model adds the valid tokens' router choices
        extra["expert_counts"] = store["expert_counts"]
    layers = []
    for sl, pg in zip(slots["layers"], store["pages"]):
        st = dict(sl)
        for k, pool in pg.items():
            g = pool[page_table]  # [S, P, E, k]
            st[k] = g.reshape(S, P * g.shape[2], *g.shape[3:])
        layers.append(st)
    h, new = model.extend(
        params, tokens, {"layers": layers, "lengths": lengths, **extra}, cfg, valid, moe_impl
    )

    # write back the pages holding positions lengths .. lengths + valid - 1
    rel = lengths[:, None] // B + jnp.arange(c // B + 2)  # [S, w]
    ok = (rel <= ((lengths + valid - 1) // B)[:, None]) & (valid[:, None] > 0) & (rel < P)
    rel = jnp.minimum(rel, P - 1)
    num_pages = jax.tree.leaves(store["pages"])[0].shape[0] if jax.tree.leaves(store["pages"]) else 0
    dest = jnp.where(ok, jnp.take_along_axis(page_table, rel, axis=1), num_pages)
    pages = []
    for st, pg in zip(new["layers"], store["pages"]):
        out = {}
        for k, pool in pg.items():
            g = st[k].reshape(S, P, *pool.shape[1:])
            vals = jnp.take_along_axis(g, rel.reshape(*rel.shape, *([1] * (g.ndim - 2))), axis=1)
            out[k] = pool.at[dest].set(vals, mode="drop")
        pages.append(out)
    slots = {
        "layers": [{k: st[k] for k in sl} for st, sl in zip(new["layers"], store["slots"]["layers"])],
        **{k: new[k] for k in store["slots"] if k != "layers"},
    }

    def keep(sn, cur):  # copy the rows asked for into their snapshot slots
        return sn.at[jnp.where(save >= 0, save, sn.shape[0])].set(cur, mode="drop")

    snaps = jax.tree.map(keep, store["snaps"], slots)

    # penalty bookkeeping from the fed tokens: prompt positions mark the mask, output positions count
    reset = arrays["reset"]
    counts = jnp.where(reset[:, None], 0, store["counts"])
    mask = jnp.where(reset[:, None], False, store["prompt_mask"])
    pos = lengths[:, None] + jnp.arange(c)
    fed = jnp.arange(c)[None] < valid[:, None]
    is_prompt = pos < arrays["num_prompt"][:, None]
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], (S, c))
    mask = mask.at[rows, tokens].max(fed & is_prompt)
    counts = counts.at[rows, tokens].add((fed & ~is_prompt).astype(jnp.int32))

    last = h[jnp.arange(S), jnp.maximum(valid - 1, 0)]  # [S, n, d]
    logits = model.logits_from_hidden(params, last, cfg)
    tok, lp, top_ids, top_lp = sample_rows(logits, counts, mask, sampling, num_logprobs)
    out = {"slots": slots, "pages": pages, "snaps": snaps, "counts": counts, "prompt_mask": mask}
    if "expert_counts" in new:
        out["expert_counts"] = new["expert_counts"]
    return tok, lp, top_ids, top_lp, out


_STATIC = ("cfg", "block_size", "num_logprobs", "moe_impl")
engine_step = jax.jit(_step, static_argnames=_STATIC, donate_argnames=("store",))


@functools.cache
def sharded_step(cfg: ModelConfig, ec, mesh: Mesh):
    """`engine_step` for resolved engine config ec on a mesh. Its outputs are pinned to the layout of its inputs
    (`store_shardings`, the per-slot outputs on "dp"): equal input shardings then reuse one compiled program
    per width, and the donated store's buffers are reused. Cached per (cfg, ec, mesh)."""
    shapes = jax.eval_shape(lambda: init_store(cfg, ec))
    row = row_sharding(mesh)
    out = (row, row, row, row, store_shardings(shapes, mesh))
    return jax.jit(_step, static_argnames=_STATIC, donate_argnames=("store",), out_shardings=out)
