"""The FP8 prefill GEMM as a persistent kernel (`fp8_gemm_persistent.cu`): one CTA per SM walks 128x256 tiles.

Why. At 4096^3 the one-tile-a-CTA default spends about 4.6 us of each tile on work that does not depend on k
(its CTA's start and first stage, the last wgmmas, the store and its wait), 16% of the tile, with the SM's
tensor cores idle (kernels/NOTES.md). Here the ring's loads run on into the next tile and each tile's store
drains under the next tile's k loop. An earlier persistent form (TileLang-written, 2026-12-01/02) tied the
default with a cold L2 and lost 3-4% back to back; it gave every CTA its tiles up front (c, c + CTAs, ...),
while the hardware gives a freed SM the next CTA. `WsTiling(persistent="atomic")` takes each next tile from a
counter in global memory instead; `"static"` keeps the fixed walk (the default where this kernel is).

The kernel keeps the default's k loop (`WsTiling(128, 256, 3, panel=8, scales_ahead=True)` as TileLang lowers
it) and its kernel parameters, so the launch plan (tensor maps for A, B and C; AS and BS as pointers) is the
one TileLang's lowering of that tiling gives; only the grid (one CTA per SM, fewer when there are fewer
tiles) and the shared memory (its own 64 KB of staging beside the ring) differ.

The same kernel carries the grouped contiguous GEMM (MoE prefill, `groups` > 0; the launch plan of TileLang's
grouped program): it walks only the tiles whose first row has a group, listed by each CTA at its start, so
the tiles of padding after the last group cost no turn of the walk (where there are fewer tiles than SMs,
only CTAs that list and exit), and reads each tile's group once instead of in every k block. With
`half_tiles` the second warpgroup idles in a tile whose rows 64-127 are padding, as in
`fp8_gemm_tilelang.with_half_tiles`.
"""

import dataclasses
from pathlib import Path

SOURCE = Path(__file__).with_name("fp8_gemm_persistent.cu")
SCHEDULES = ("static", "atomic")
BLOCK = 128
STAGE_BYTES = 3 * BLOCK * BLOCK  # A's 128 rows and B's two 128-row slices, fp8, per k block
STAGING_BYTES = 2 * 2 * BLOCK * BLOCK  # the bf16 tile (128 x 256) out of its own buffer
CTA_SHARED = 227 * 1024  # what a CTA may have on an H100 or H200
MAX_GROUPS = 0xFFFF  # a group number and its tile row share one int of the grouped walk's list:
MAX_TILE_ROWS = 1 << 14  # 16 bits of group, one of the idle half, 14 of tile row


def shared_bytes(stages: int) -> int:
    return stages * STAGE_BYTES + STAGING_BYTES


def tiles(m: int, n: int) -> int:
    return -(-m // BLOCK) * (n // 256)


def ctas(m: int, n: int) -> int:
    """One CTA per SM of this GPU, fewer when there are fewer tiles."""
    from djax.kernels.dispatch import sm_count

    return min(tiles(m, n), sm_count())


def static_bytes(m: int, groups: int) -> int:
    """The kernel's static shared memory, at most: its barriers and tile slots (under 256 bytes) and, for the
    grouped GEMM, its list of live tile rows (an int each), rounded up to the 1 KB the dynamic buffer is
    aligned to."""
    listed = 4 * -(-m // BLOCK) if groups else 0
    return -(-(listed + 256) // 1024) * 1024


def check(m: int, n: int, k: int, tiling, groups: int = 0) -> None:
    """Raises ValueError where the persistent kernel does not take `tiling` or the shape (groups > 0: the
    grouped contiguous GEMM over that many weight matrices)."""
    t = tiling
    if t.persistent not in SCHEDULES:
        raise ValueError(f"persistent must be one of {SCHEDULES}: {t}")
    plain = dataclasses.replace(t, persistent="", stages=3, panel=0, half_tiles=t.half_tiles and not groups)
    if plain != type(t)(128, 256, 3, scales_ahead=True):
        raise ValueError(
            "the persistent kernel takes 128x256 tiles with the scales ahead and no other option (the grouped "
            f"GEMM half tiles too): {t}"
        )
    if n % 256:
        raise ValueError(f"the persistent kernel needs n a multiple of 256: {t} at n={n}")
    if t.panel < 0:
        raise ValueError(f"panel must be 0 (row-major tiles) or a number of tile rows: {t}")
    if not 1 <= t.stages or shared_bytes(t.stages) + static_bytes(m, 0) > CTA_SHARED:
        raise ValueError(f"the persistent kernel's ring and staging fit 1 to 3 stages in 227 KB: {t}")
    if groups and (m % BLOCK or groups > MAX_GROUPS or m // BLOCK >= MAX_TILE_ROWS):
        raise ValueError(
            f"the grouped persistent kernel needs m a multiple of {BLOCK}, fewer than {MAX_TILE_ROWS} tile "
            f"rows and at most {MAX_GROUPS} groups: m={m}, {groups} groups"
        )
    if shared_bytes(t.stages) + static_bytes(m, groups) > CTA_SHARED:
        raise ValueError(
            f"the grouped walk's list of {m // BLOCK} tile rows does not fit in shared memory beside the ring "
            f"of {t.stages} stages: m={m}"
        )


def source(m: int, n: int, k: int, tiling, groups: int = 0) -> str:
    """The kernel's CUDA source for one shape and tiling (its constants defined ahead of the file's text)."""
    consts = dict(
        DJAX_M=m,
        DJAX_N_TILES=n // 256,
        DJAX_KB=k // BLOCK,
        DJAX_STAGES=tiling.stages,
        DJAX_PANEL=tiling.panel,
        DJAX_A_ROWS=min(m, BLOCK),
        DJAX_ATOMIC=int(tiling.persistent == "atomic"),
        DJAX_GROUPS=groups,
        DJAX_HALF_TILES=int(bool(groups and tiling.half_tiles)),
    )
    return "".join(f"#define {name} {value}\n" for name, value in consts.items()) + SOURCE.read_text()


def lower(m: int, n: int, k: int, tiling, groups: int = 0) -> tuple[str, dict]:
    """(CUDA source, launch description) as `fp8_gemm_tilelang.lower_ws` gives them: the launch plan is that of
    TileLang's lowering of the same tiles one a CTA (the same kernel parameters; groups > 0: its grouped
    program's), with this kernel's shared memory and one CTA per SM (`ctas`; `ws_kernel` sets it again for the
    GPU it runs on, past the disk cache)."""
    from djax.kernels.fp8_gemm_tilelang import lower_ws

    check(m, n, k, tiling, groups)
    plain_source, launch = lower_ws(m, n, k, dataclasses.replace(tiling, persistent=""), groups)
    start = plain_source.index("__launch_bounds__")
    signature = plain_source[start : plain_source.index("{", start)]
    text = source(m, n, k, tiling, groups)
    # the parameters the plan describes must be this kernel's, in order (its name and MI are macros)
    name = "fp8_gemm_grouped_kernel" if groups else "fp8_gemm_kernel"
    mi = ", const int* __restrict__ MI" if groups else ""
    own = text[text.index("__launch_bounds__") :]
    own = own[: own.index("{")].replace("DJAX_KERNEL", name).replace(" DJAX_MI_PARAM", mi)
    if signature != own:
        raise NotImplementedError(f"TileLang's lowering has another kernel signature: {signature}")
    a_box = launch["params"][1].box  # (k, rows): the bytes A's load brings must be those the kernel expects
    if a_box != (BLOCK, min(m, BLOCK)):
        raise NotImplementedError(f"TileLang's lowering has another box for A: {a_box}")
    return text, {**launch, "grid": (ctas(m, n), 1, 1), "shared_bytes": shared_bytes(tiling.stages)}
