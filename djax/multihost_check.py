"""Multi-host smoke check: one sharded `forward` over a mesh spanning every process, checked against one device.

Run one copy per process (host), each with the same coordinator address and its own process id:

    python -m djax.multihost_check --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
    python -m djax.multihost_check --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1

Every process builds the same random tiny model (fixed seed), `jax.distributed.initialize`s, lays a
global ("dp", "ep", "tp") mesh over all devices of all processes (default: ep = all devices, so the
expert `all_to_all` crosses hosts), shards the weights and the batch, and runs `djax.forward`. Each
process then gathers the logits and compares them with a `forward` on its own first device alone.
Prints one line per process ("multihost ok ..." or "multihost MISMATCH ...") and exits 0 or 1.

On CPU (`--cpu-devices N` fakes N devices per process) the collectives go through gloo.
"""

from __future__ import annotations

import argparse
import os
import sys


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m djax.multihost_check", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--coordinator", required=True, help="host:port of process 0, reachable from every process"
    )
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument(
        "--cpu-devices", type=int, default=0, help="run on CPU with this many fake devices per process"
    )
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size; ep = devices / (dp * tp)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--preset", default="tiny-v4")
    ap.add_argument("--layers", type=int, default=2, help="keep only the first N layers (compile time)")
    ap.add_argument("--tol", type=float, default=1e-5, help="max error relative to the largest logit")
    ap.add_argument("--timeout", type=int, default=120, help="seconds to wait for the other processes")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    if a.cpu_devices:
        # Must precede the first jax import: the CPU device count is read when the backend starts.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.cpu_devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import djax
    from djax.params import init_params_host

    jax.config.update("jax_default_matmul_precision", "highest")
    if a.cpu_devices:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
    jax.distributed.initialize(
        coordinator_address=a.coordinator,
        num_processes=a.num_processes,
        process_id=a.process_id,
        initialization_timeout=a.timeout,
    )
    n = jax.device_count()
    if n % (a.dp * a.tp):
        raise SystemExit(f"{n} devices do not split into dp={a.dp} x tp={a.tp}")
    ep = n // (a.dp * a.tp)
    base = djax.preset(a.preset)
    layers = min(a.layers, base.num_hidden_layers)
    cfg = base.replace(
        num_hidden_layers=layers,
        compress_ratios=base.compress_ratios[:layers],
        num_hash_layers=min(base.num_hash_layers, layers),
    )
    # The same seed on every process: identical host values, so device_put onto the global mesh agrees.
    params = init_params_host(cfg, 0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2 * a.dp * ep, 16)).astype(np.int32)

    local = jax.local_devices()[0]
    ref = np.asarray(djax.forward(jax.device_put(params, local), jax.device_put(tokens, local), cfg))

    mesh = djax.make_mesh(dp=a.dp, ep=ep, tp=a.tp)
    sharded = djax.shard_params(params, cfg, mesh)
    on_dp = NamedSharding(mesh, P("dp"))
    toks = jax.make_array_from_callback(tokens.shape, on_dp, lambda idx: tokens[idx])
    got = djax.forward(sharded, toks, cfg, mesh=mesh)
    got = np.asarray(multihost_utils.process_allgather(got, tiled=True))
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    ok = bool(np.isfinite(err) and err <= a.tol)
    word = "ok" if ok else "MISMATCH"
    print(
        f"multihost {word} process {jax.process_index()}/{jax.process_count()} devices {n} "
        f"mesh dp={a.dp} ep={ep} tp={a.tp} err {err:.3g}",
        flush=True,
    )
    multihost_utils.sync_global_devices("djax.multihost_check done")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
