"""The one-token step's rings, written by slot, against the general chunk path that rebuilds them.

A chunk of one token writes its key into its window slot and its raw projections into the compressors' ring
slots, and reads the windows that close from the rings by slot (`deepseek_v4.write_slot`). A chunk of two
tokens whose second is not valid computes the same step the general way: the rings put in position order,
the chunk appended, the rings rebuilt. Both must give the same streams and the same state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.config import preset
from djax.models import deepseek_v4 as v4

# Per row, the position the step writes: inside the first window of every ratio (3), closing windows of
# ratios 2 and 4 but not 16 (7), closing 2, 4 and 16 (15), past the sliding window of 8 and closing every
# ratio again (31), one that closes nothing (6), and a row whose step is not valid (at 15: its state must
# stay as it is, though its windows would close).
LENGTHS = np.array([3, 7, 15, 31, 6, 15])
VALID = np.array([1, 1, 1, 1, 1, 0])
MAX_LEN = 40


@pytest.fixture(scope="module", params=["tiny-v4", "tiny-v41"])
def model(request):
    cfg = preset(request.param)
    return cfg, djax.init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize("spare", [0, 3])
def test_one_token_step_equals_general_chunk(model, spare, monkeypatch):
    """`spare` > 0: rings larger than their windows (rollback), so slot = position % (R + spare)."""
    monkeypatch.setattr(v4, "SLOT_WRITES_FROM_BATCH", 1)  # these 6 rows write by slot
    cfg, params = model
    b = len(LENGTHS)
    tokens = jax.random.randint(jax.random.key(1), (b, MAX_LEN), 2, cfg.vocab_size)
    state = v4.init_state(cfg, b, MAX_LEN, spare)
    _, state = jax.jit(v4.extend, static_argnames="cfg")(
        params, tokens[:, :32], state, cfg, jnp.asarray(LENGTHS, jnp.int32)
    )
    nxt = jnp.take_along_axis(tokens, jnp.asarray(LENGTHS)[:, None], axis=1)  # [b, 1]
    valid = jnp.asarray(VALID, jnp.int32)
    step = jax.jit(v4.extend, static_argnames="cfg")
    h1, one = step(params, nxt, state, cfg, valid)
    h2, two = step(params, jnp.concatenate([nxt, nxt[:, ::-1]], axis=1), state, cfg, valid)

    live = VALID > 0
    h1, h2 = np.asarray(h1), np.asarray(h2)
    np.testing.assert_allclose(h1[live, 0], h2[live, 0], atol=1e-5 * np.abs(h2[live, 0]).max(), rtol=0)
    flat_one, _ = jax.tree_util.tree_flatten_with_path(one)
    flat_two = jax.tree_util.tree_leaves(two)
    flat_before = jax.tree_util.tree_leaves(state)
    assert len(flat_one) == len(flat_two) == len(flat_before)
    for (path, a), want, before in zip(flat_one, flat_two, flat_before):
        a, want, before = np.asarray(a), np.asarray(want), np.asarray(before)
        name = jax.tree_util.keystr(path)
        scale = max(float(np.abs(want).max()), 1e-30) if want.dtype.kind == "f" else 0
        np.testing.assert_allclose(a, want, atol=1e-5 * scale, rtol=0, err_msg=name)
        np.testing.assert_array_equal(a[~live], before[~live], err_msg=name)  # the invalid row: untouched
    # the rings did change where the step was valid (the comparison above is not between two no-ops)
    window = np.asarray(one["layers"][0]["window"])
    r = window.shape[1]
    for row in np.flatnonzero(live):
        slot = LENGTHS[row] % r
        assert not np.array_equal(window[row, slot], np.asarray(state["layers"][0]["window"])[row, slot])


def test_slot_writes_only_for_one_token_from_the_batch_set():
    x = lambda b, c: jnp.zeros((b, c, 4))  # noqa: E731
    n = v4.SLOT_WRITES_FROM_BATCH
    assert v4.by_slot(x(n, 1)) and v4.by_slot(x(4 * n, 1))
    assert not v4.by_slot(x(n - 1, 1)) and not v4.by_slot(x(n, 2))


def test_slot_positions():
    """Slot s of a ring of 5 holds the newest position p = s (mod 5) at or before `newest`."""
    got = np.asarray(v4.slot_positions(jnp.array([7, 2, 0, -1]), 5))
    assert got.tolist() == [[5, 6, 7, 3, 4], [0, 1, 2, -2, -1], [0, -4, -3, -2, -1], [-5, -4, -3, -2, -1]]
