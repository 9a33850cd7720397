"""The device step's counter-based generator (Philox4x32-10), NumPy reference: Random123's
known answers, rows drawn in any order or slice equal, distinct streams, the distributions."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.counter_rng import (
    NORMAL,
    UNIFORM,
    draw_rows,
    philox4x32,
    step_counter,
    stream_key,
)

# Random123's kat_vectors for philox4x32_10: (counter, key) -> output
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize(("counter", "key", "want"), KNOWN_ANSWERS)
def test_philox_gives_random123s_known_answers(counter, key, want):
    got = philox4x32(tuple(np.array([c], dtype=np.uint32) for c in counter), key)
    assert tuple(int(w[0]) for w in got) == want


def test_a_row_is_the_same_however_it_is_drawn():
    whole = draw_rows(3, 17, NORMAL, 10, 9)
    np.testing.assert_array_equal(draw_rows(3, 17, NORMAL, 2, 9, first_row=4), whole[4:6])
    np.testing.assert_array_equal(draw_rows(3, 17, NORMAL, 10, 5), whole[:, :5])


def test_seed_step_row_and_stream_each_change_the_draw():
    base = draw_rows(3, 17, NORMAL, 4, 64)
    for other in (draw_rows(4, 17, NORMAL, 4, 64), draw_rows(3, 18, NORMAL, 4, 64),
                  draw_rows(3, 17, NORMAL, 4, 64, first_row=1), draw_rows(3, 17, UNIFORM, 4, 64),
                  draw_rows(3, 17 + 2**32, NORMAL, 4, 64), draw_rows(3 + 2**32, 17, NORMAL, 4, 64)):
        assert not np.isclose(other, base).any(axis=1).all()
    assert not np.array_equal(base[0], base[1])


def test_the_streams_have_their_distributions():
    normal = draw_rows(0, 5, NORMAL, 100, 10_000).astype(np.float64)
    assert abs(normal.mean()) < 0.005 and abs(normal.std() - 1.0) < 0.005
    assert abs((normal**4).mean() - 3.0) < 0.05  # Gaussian tails, not a uniform's
    rows = normal.reshape(100, -1)
    assert abs(np.corrcoef(rows[0], rows[1])[0, 1]) < 0.05
    uniform = draw_rows(0, 5, UNIFORM, 100, 10_000)
    assert uniform.min() > 0.0 and uniform.max() < 2.0
    assert abs(uniform.mean() - 1.0) < 0.005 and abs(uniform.var() - 1.0 / 3.0) < 0.005


def test_keys_and_counters_are_range_checked_and_wrap_past_48_bits():
    with pytest.raises(ValueError, match="seed"):
        stream_key(-1)
    assert stream_key(2**32 + 5) == (5, 1)
    assert step_counter(2**48 + 7, NORMAL) == step_counter(7, NORMAL)
    assert step_counter(2**40, UNIFORM) == (0, (1 << 16) | 2**8)
