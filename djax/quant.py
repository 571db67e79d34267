"""Block-quantized weights (FP8 e4m3 / FP4 e2m1 with per-block scales) kept as they are on disk."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QArray:
    """values[..., o, i] in a narrow float type; scale[..., o / block[0], i / block[1]] float32.

    The dense weight is values * scale broadcast over each block. The model dequantizes on use
    (`dense`), so only the narrow bytes live in memory between steps.
    """

    values: jax.Array
    scale: jax.Array
    block: tuple[int, int] = field(metadata=dict(static=True), default=(128, 128))

    @property
    def shape(self):
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    def dense(self, dtype=jnp.bfloat16) -> jax.Array:
        bo, bi = self.block
        *lead, o, i = self.values.shape
        s = jnp.repeat(jnp.repeat(self.scale.astype(jnp.float32), bo, axis=-2), bi, axis=-1)[..., :o, :i]
        return (self.values.astype(jnp.float32) * s).astype(dtype)


def dense(w, dtype) -> jax.Array:
    """A weight as a dense array of `dtype`, whether it is stored plain or block-quantized."""
    if isinstance(w, QArray):
        return w.dense(dtype)
    return w.astype(dtype)
