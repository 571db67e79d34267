"""Command line: `djax generate`, `djax eval`, `djax plan` (also `python -m djax ...`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

import djax
from djax.engine import DEFAULT_MODEL
from djax.sampling import sample


def default_checkpoint() -> Path:
    """The embedded default model, shipped inside the package (djax-tiny, DeepSeek-V4.1-Flash at toy size)."""
    return DEFAULT_MODEL


def _load(args) -> tuple[djax.ModelConfig, dict, object | None]:
    if args.preset:
        config = djax.preset(args.preset)
        if args.dtype:
            config = config.replace(dtype=args.dtype)
        print(f"random weights for preset {args.preset!r} (the output is noise)", file=sys.stderr)
        return config, djax.init_params(config, jax.random.key(args.seed)), None
    path = Path(args.checkpoint) if args.checkpoint else default_checkpoint()
    config, params = djax.load_checkpoint(path, dtype=args.dtype, progress=False)
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return config, params, tokenizer


def _encode(text: str, config, tokenizer) -> list[int]:
    if tokenizer is not None:
        return tokenizer.encode(text).ids
    # No tokenizer: UTF-8 bytes as token ids, enough to drive a random-weight model.
    return [b % config.vocab_size for b in text.encode()]


def _decode(ids: list[int], tokenizer) -> str:
    if tokenizer is not None:
        return tokenizer.decode(ids)
    return " ".join(map(str, ids))


def cmd_generate(args) -> int:
    config, params, tokenizer = _load(args)
    if args.prompt_ids is not None:
        prompt = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
    else:
        prompt = _encode(args.prompt, config, tokenizer)
    sampling = djax.SamplingParams(args.temperature, args.top_k, args.top_p, ignore_eos=args.ignore_eos)
    batch = djax.Batch.from_lists([prompt], seeds=args.seed)
    from djax.generate import validate

    validate(batch, config, args.max_new_tokens)
    max_len = batch.tokens.shape[1] + args.max_new_tokens
    t0 = time.perf_counter()
    logits, state = djax.prefill(params, batch.tokens, batch.lengths, config, max_len)
    out: list[int] = []
    tok = sample(logits, batch.seeds, jnp.int32(0), sampling)
    eos = set() if args.ignore_eos else set(config.eos_ids)
    bar = tqdm(total=args.max_new_tokens, desc="generating", unit="tok", file=sys.stderr)
    t_second = None  # the first decode step compiles: time the steady state from the second token
    for step in range(1, args.max_new_tokens + 1):
        t = int(tok[0])
        out.append(t)
        bar.update(1)
        if len(out) == 2:
            t_second = time.perf_counter()
        if t in eos or step == args.max_new_tokens:
            break
        logits, state = djax.decode(params, tok, state, config)
        tok = sample(logits, batch.seeds, jnp.int32(step), sampling)
    bar.close()
    elapsed = time.perf_counter() - t0
    result = {
        "prompt_tokens": len(prompt),
        "tokens": out,
        "text": _decode(out, tokenizer),
        "seconds": round(elapsed, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        rate = (len(out) - 2) / max(time.perf_counter() - t_second, 1e-9) if len(out) > 2 else 0.0
        print(f"[{len(out)} tokens in {elapsed:.2f} s, {rate:.1f} tok/s after the second]", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from djax.evaluate import chunk_tokens, evaluate

    config, params, tokenizer = _load(args)
    text = Path(args.file).read_text()
    windows = chunk_tokens(_encode(text, config, tokenizer), args.seq_len)
    if not windows:
        raise ValueError(f"{args.file}: fewer than 2 tokens to score")
    mesh = djax.make_mesh(dp=args.dp, ep=args.ep) if args.dp * args.ep > 1 else None
    t0 = time.perf_counter()
    res = evaluate(params, config, windows, mesh=mesh, batch_size=args.batch_size, seq_len=args.seq_len)
    out = {
        "file": str(args.file),
        "windows": len(windows),
        "seq_len": args.seq_len,
        "total_tokens": res["total_tokens"],
        "total_loglik": res["total_loglik"],
        "perplexity": res["perplexity"],
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if args.per_window:
        out["loglik"] = res["loglik"]
        out["tokens"] = res["tokens"]
    print(json.dumps(out))
    return 0


def cmd_plan(args) -> int:
    from djax.plan import format_table, plan, standard_plans

    if args.preset is None:
        names, rows = standard_plans(context=args.context, batch=args.batch)
    else:
        config = djax.preset(args.preset)
        if args.dtype:
            config = config.replace(dtype=args.dtype)
        devices = args.devices or [8, 16]
        names = [args.preset] * len(devices)
        rows = [
            plan(config, n, ep=args.ep, dp=args.dp, context=args.context, batch=args.batch) for n in devices
        ]
    if args.json:
        print(json.dumps([{"preset": n, **r} for n, r in zip(names, rows, strict=True)]))
    else:
        print(format_table(rows, names))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="djax", description="DeepSeek inference in JAX")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument(
        "--checkpoint",
        help="HF-format directory (config.json, *.safetensors, tokenizer.json); default: the embedded djax-tiny",
    )
    g.add_argument(
        "--preset",
        default=None,
        choices=sorted(djax.PRESETS),
        help="a random-weight model instead of a checkpoint",
    )
    g.add_argument("--prompt", default="def read_file(path):", help="prompt text")
    g.add_argument("--prompt-ids", help="prompt as token ids, e.g. '1 2 3' (overrides --prompt)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the compute dtype")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="log-likelihood and perplexity of a text file")
    e.add_argument(
        "--checkpoint",
        help="HF-format directory (config.json, *.safetensors, tokenizer.json); default: the embedded djax-tiny",
    )
    e.add_argument(
        "--preset", default=None, choices=sorted(djax.PRESETS), help="a random-weight model instead"
    )
    e.add_argument("--file", required=True, help="text file to score")
    e.add_argument(
        "--seq-len", type=int, default=128, help="window length in tokens (non-overlapping windows)"
    )
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--dp", type=int, default=1, help="data-parallel mesh size")
    e.add_argument("--ep", type=int, default=1, help="expert-parallel mesh size")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the compute dtype")
    e.add_argument("--per-window", action="store_true", help="also print each window's log-likelihood")
    e.set_defaults(func=cmd_eval)

    pl = sub.add_parser("plan", help="per-device bytes of weights and decoder state, from abstract shapes")
    pl.add_argument(
        "--preset",
        default=None,
        choices=sorted(djax.PRESETS),
        help="default: V4-Flash and V4.1-Flash at 8 and 16",
    )
    pl.add_argument("--devices", type=int, nargs="+", help="device counts (default: 8 16)")
    pl.add_argument("--ep", type=int, help="expert-parallel size (default: the device count)")
    pl.add_argument("--dp", type=int, help="attention data-parallel size (default: the device count)")
    pl.add_argument("--context", type=int, default=65536, help="tokens per request")
    pl.add_argument("--batch", type=int, default=64, help="concurrent requests in all")
    pl.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the weight and state dtype")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.set_defaults(func=cmd_plan)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, djax.CheckpointError, FileNotFoundError) as e:
        print(f"djax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
