"""A counter-based generator for the device step's perturbations: Philox4x32-10.

Every four numbers of a perturbation matrix come from one Philox4x32-10 block (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011) keyed by the run's seed and counted by
(column block, row, step, stream): any element of any step's Z can be drawn on its own, in any
order, on any device, and a GPU thread draws its block with no state to carry. The counter:

* ``c0``: the column block (columns 4 c0 .. 4 c0 + 3 of the row);
* ``c1``: the row of the step's Z (pair j, sample i: row j * B + i, as the estimator orders them);
* ``c2``: the step's low 32 bits;
* ``c3``: the stream (:data:`NORMAL` or :data:`UNIFORM`) in the top 16 bits, the step's bits
  32-47 below (a run of 2^48 steps never repeats a counter).

The key is the seed's low and high 32 bits. A block's four words w are four uniforms
u = (w + 1/2) 2^-32 in (0, 1); N(0, 1) pairs are Box-Muller in float64,
sqrt(-2 ln u0) (cos 2 pi u1, sin 2 pi u1), then float32.

:func:`philox4x32` and :func:`draw_rows` are the NumPy reference (the CPU tests check it
against Random123's known answers); :func:`device_rows` runs the same algorithm as one CUDA
kernel through CuPy (imported only when called).
"""

from __future__ import annotations

from typing import Any

import numpy as np

NORMAL, UNIFORM = 0, 1  # the streams: N(0, 1) rows, U(0, 2) factors of anchor-guided rows
ROUNDS = 10
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW = np.uint64(0xFFFFFFFF)
_STEP_BITS = 48


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 of the counters (four uint32 arrays of one shape) under ``key`` (two
    32-bit ints): four uint32 arrays of that shape."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    for round_index in range(ROUNDS):
        k0 = np.uint32((key[0] + round_index * _W0) & 0xFFFFFFFF)
        k1 = np.uint32((key[1] + round_index * _W1) & 0xFFFFFFFF)
        p0 = _M0 * c0.astype(np.uint64)
        p1 = _M1 * c2.astype(np.uint64)
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0,
            (p1 & _LOW).astype(np.uint32),
            (p0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1,
            (p0 & _LOW).astype(np.uint32),
        )
    return c0, c1, c2, c3


def stream_key(seed: int) -> tuple[int, int]:
    """The Philox key of a run seeded ``seed`` (a non-negative int below 2^64)."""
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2^64), got {seed}")
    return seed & 0xFFFFFFFF, seed >> 32


def step_counter(step: int, stream: int) -> tuple[int, int]:
    """Counter words c2, c3 of step ``step`` (its low 48 bits) in ``stream``."""
    step = int(step) % 2**_STEP_BITS
    return step & 0xFFFFFFFF, (stream << 16) | (step >> 32)


def draw_rows(
    seed: int, step: int, stream: int, rows: int, width: int, first_row: int = 0
) -> np.ndarray:
    """Rows ``first_row`` .. ``first_row + rows - 1`` [rows, width] float32 of the step's
    ``stream``: N(0, 1) draws (:data:`NORMAL`) or U(0, 2) ones (:data:`UNIFORM`). NumPy
    reference of :func:`device_rows`."""
    blocks = -(-width // 4)
    c0 = np.broadcast_to(np.arange(blocks, dtype=np.uint32), (rows, blocks))
    c1 = np.broadcast_to(np.arange(first_row, first_row + rows, dtype=np.uint32)[:, None],
                         (rows, blocks))
    c2, c3 = step_counter(step, stream)
    words = philox4x32((c0, c1, np.full_like(c0, c2), np.full_like(c0, c3)), stream_key(seed))
    u = [(w.astype(np.float64) + 0.5) * 2.0**-32 for w in words]
    if stream == UNIFORM:
        values = np.stack([2.0 * v for v in u], axis=-1)
    else:
        r01 = np.sqrt(-2.0 * np.log(u[0]))
        r23 = np.sqrt(-2.0 * np.log(u[2]))
        values = np.stack([r01 * np.cos(2.0 * np.pi * u[1]), r01 * np.sin(2.0 * np.pi * u[1]),
                           r23 * np.cos(2.0 * np.pi * u[3]), r23 * np.sin(2.0 * np.pi * u[3])],
                          axis=-1)
    return values.reshape(rows, 4 * blocks)[:, :width].astype(np.float32)


_CUDA_BODY = r"""
const unsigned int row = first_row + (unsigned int)(i / blocks);
const unsigned int block = (unsigned int)(i % blocks);
unsigned int x0 = block, x1 = row, x2 = c2, x3 = c3, a = k0, b = k1;
for (int r = 0; r < 10; ++r) {
    if (r) { a += 0x9E3779B9u; b += 0xBB67AE85u; }
    const unsigned long long p0 = 0xD2511F53ull * x0, p1 = 0xCD9E8D57ull * x2;
    const unsigned int y0 = (unsigned int)(p1 >> 32) ^ x1 ^ a;
    const unsigned int y2 = (unsigned int)(p0 >> 32) ^ x3 ^ b;
    x1 = (unsigned int)p1; x3 = (unsigned int)p0; x0 = y0; x2 = y2;
}
const double s = 2.3283064365386963e-10;  // 2^-32
const double u0 = (x0 + 0.5) * s, u1 = (x1 + 0.5) * s, u2 = (x2 + 0.5) * s, u3 = (x3 + 0.5) * s;
double v[4];
if (uniform) {
    v[0] = 2.0 * u0; v[1] = 2.0 * u1; v[2] = 2.0 * u2; v[3] = 2.0 * u3;
} else {
    const double r01 = sqrt(-2.0 * log(u0)), r23 = sqrt(-2.0 * log(u2));
    const double t1 = 6.283185307179586 * u1, t3 = 6.283185307179586 * u3;
    v[0] = r01 * cos(t1); v[1] = r01 * sin(t1); v[2] = r23 * cos(t3); v[3] = r23 * sin(t3);
}
const long long base = (long long)(row - first_row) * width + 4ll * block;
for (int j = 0; j < 4; ++j) {
    if (4 * block + j < (unsigned int)width) out[base + j] = (float)v[j];
}
"""

_KERNEL: Any = None


def device_rows(
    seed: int, step: int, stream: int, rows: int, width: int, first_row: int = 0,
    out: Any = None,
) -> Any:
    """:func:`draw_rows` on the current CUDA device: a CuPy float32 array [rows, width]
    (written into ``out`` when given), one thread per Philox block."""
    import cupy

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = cupy.ElementwiseKernel(
            "uint32 k0, uint32 k1, uint32 c2, uint32 c3, int64 blocks, int64 width, "
            "uint32 first_row, bool uniform",
            "raw float32 out", _CUDA_BODY, "eva0_philox_rows")
    if out is None:
        out = cupy.empty((rows, width), dtype=cupy.float32)
    blocks = -(-width // 4)
    k0, k1 = stream_key(seed)
    c2, c3 = step_counter(step, stream)
    _KERNEL(np.uint32(k0), np.uint32(k1), np.uint32(c2), np.uint32(c3), np.int64(blocks),
            np.int64(width), np.uint32(first_row), stream == UNIFORM, out, size=rows * blocks)
    return out
