"""A change detector on the input images themselves: sees a change of stream that the model's
features cannot show.

The activation shift's detector (:mod:`.shift`) watches the head inputs at the current theta.
A theta adapted to a noisy stream makes clean images look much like the noisy ones there, so
the return to clean goes unseen (shipped ViT, 500 images of Gaussian noise sigma 0.2 then 500
clean ones: 0 changes, the clean part served 2.6 points under NoAdapt). The pixels do show it:
three descriptors per image of the model's preprocessed input x [B, C, H, W],

* ``mean``: the mean value (brightness);
* ``log_variance``: log of the variance over all values (contrast);
* ``log_roughness``: log of the mean squared difference of neighbouring values over the
  variance (noise raises it, blur lowers it, contrast leaves it unchanged),

enter two per-sample windows (:mod:`.rates`): a long one of ``LONG_SAMPLES`` (512) with each
descriptor's mean and mean square, and a recent one of ``RECENT_SAMPLES`` (32). A change is
called when one descriptor's recent mean (with the new batch) is more than ``CHANGE_Z`` (4.5) of
its standard errors from the long mean (before the batch: a batch of 64 would otherwise pull
the long mean a fifth of the way to itself; z^2 = (m_recent - m_long)^2 R / var_long, per
descriptor); both windows then restart empty. On the 32 x 32 Fashion-MNIST images at batch 1
and 64: no change in 10000 clean test or 5000 clean validation images, nor inside any domain
of the 15-corruption continual validation stream (severity 5, where 10 of the 14 changes of
corruption are seen); a return to clean seen within 1-64 images after Gaussian noise of sigma
0.2-0.5, blur of radius 0.5-2 or JPEG quality 5-20 (sigma 0.1 is not always seen: z about 4).

A return that small moves the images less than the window test sees in 32 samples, but it
lasts. Beside the window test a CUSUM watches each descriptor both ways: every sample adds its
deviation from the long mean (before its batch) in the long window's standard deviations,
clipped to ``CUSUM_CLIP`` (3: one odd image adds at most 3), less the allowance ``CUSUM_K``
(0.25); a sum is floored at 0 after each batch, and a change is called when one is over
``CUSUM_H`` (24). It runs once the long window holds ``CUSUM_MIN_SAMPLES`` (128) samples'
weight and restarts with the windows. Chosen on the validation split
(``studies/change-cusum/``): no false alarm in 5000 validation and 30000 training images in
order (batch 1, 16 and 64), none inside a domain of the continual stream at severity 1, 3 or
5, and 10 / 13 of its 14 changes of corruption seen at severity 1 / 5 (the window test alone:
7 / 11); a sustained shift of 0.7 standard deviations (the sigma-0.1 return) is called about
50 samples after it starts.

Large images are described from a sample of rows (s the least stride leaving at most ``GRID``
(32) rows and columns, 1 on the 32 x 32 images): mean and variance over the subgrid of every
s-th row and column, roughness over the horizontal neighbour differences along every s-th row
and the vertical ones between it and the row under it (whole rows: memory read in order).
Each is an unbiased estimate of the full image's value, and the windows' variances include its
sampling noise. On 224 x 224 inputs the full-image descriptors took 60 ms per batch of 32 on
the H100 machine's host (the step's ORT time there: 18 ms); the sample reads 2/7 of the rows.

The windows live in memory only (a few floats): after a restart of the process they refill
within ``RECENT_SAMPLES`` samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import namespace, to_host
from .rates import window_factor, windowed_update

DESCRIPTORS = ("mean", "log_variance", "log_roughness")
RECENT_SAMPLES = 32
LONG_SAMPLES = 512
CHANGE_Z = 4.5
GRID = 32
# The CUSUM (see the module's docstring): allowance per sample and threshold, in the long
# window's standard deviations; a sample's deviation clipped to CUSUM_CLIP; run once the long
# window holds CUSUM_MIN_SAMPLES samples' weight.
CUSUM_K = 0.25
CUSUM_H = 24.0
CUSUM_CLIP = 3.0
CUSUM_MIN_SAMPLES = 128
_EPS = 1e-6  # on variances, in the input's (normalised) units squared


def describe(x: Any) -> np.ndarray:
    """The descriptors [B, 3] (float64 on the host, in :data:`DESCRIPTORS` order) of images x
    [B, C, H, W] (a host array, or the CUDA session's resident copy: the sums run where the
    images are), from the rows of stride ``ceil(min(H, W) / GRID)`` (see the module's
    docstring). The sums run in float32 (the means pairwise, the sums of squares as dot
    products): on the Fashion-MNIST streams within 1.2e-5 of float64 sums, the same changes
    called (``results/inputwatch/``), at a third of the time from batch 16 up."""
    xp = namespace(x)
    x = xp.asarray(x, dtype=np.float32)
    batch, _, height, width = x.shape
    stride = max(1, -(-min(height, width) // GRID))
    rows, below = x[:, :, ::stride, :], x[:, :, 1::stride, :]  # kept rows, the rows under them
    grid = rows[:, :, :, ::stride].reshape(batch, -1)
    mean = grid.sum(axis=1) / np.float32(grid.shape[1])
    variance = _mean_squares(grid - mean[:, None])
    across = (rows[..., 1:] - rows[..., :-1]).reshape(batch, -1)
    down = (below - rows[:, :, : below.shape[2]]).reshape(batch, -1)
    edges = _mean_squares(across) + _mean_squares(down)
    return to_host(xp.stack([mean.astype(np.float64), xp.log(variance + _EPS),
                             xp.log((edges + _EPS) / (variance + _EPS))], axis=1))


def _mean_squares(values: Any) -> Any:
    """Each row's mean square [B] (float64) of float32 ``values`` [B, N], summed in float32."""
    xp = namespace(values)
    return (xp.einsum("bi,bi->b", values, values) / np.float32(values.shape[1])).astype(
        np.float64)


class InputChangeDetector:
    """Watches the input stream; :meth:`observe` says whether a batch showed a change."""

    def __init__(self) -> None:
        self.long_factor = window_factor(LONG_SAMPLES)
        self.recent_factor = window_factor(RECENT_SAMPLES)
        self.changes = 0
        self.last_z_squared: float | None = None  # the last batch's largest z^2 (see observe)
        self.last_values = np.zeros((0, len(DESCRIPTORS)))  # the last batch's descriptors
        self.restart()

    def restart(self) -> None:
        """Empty both windows and the CUSUM."""
        width = len(DESCRIPTORS)
        self.long_moments, self.long_weight = np.zeros(2 * width), 0.0
        self.recent_mean, self.recent_weight = np.zeros(width), 0.0
        self.cusum = np.zeros(2 * width)  # each descriptor's upward, then downward sum

    def observe(self, x: Any) -> bool:
        """Add the images x [B, C, H, W] (stream order) and return whether the stream changed;
        on a change both windows restart (the next change is looked for among the samples
        that follow). ``last_z_squared`` keeps the batch's largest descriptor z^2 (None while
        the windows fill) and ``last_values`` the batch's descriptors [B, 3]."""
        values = self.last_values = describe(x)
        self.recent_mean, self.recent_weight = windowed_update(
            self.recent_mean, self.recent_weight, values, self.recent_factor)
        window = self.long_window()  # before the batch: both tests compare against it
        self.last_z_squared = self._z_squared(window)
        changed = self.last_z_squared is not None and self.last_z_squared > CHANGE_Z**2
        changed |= self._cusum_exceeded(values, window)
        self.long_moments, self.long_weight = windowed_update(
            self.long_moments, self.long_weight, np.concatenate([values, values**2], axis=1),
            self.long_factor)
        if not changed:
            return False
        self.changes += 1
        self.restart()
        return True

    def _cusum_exceeded(self, values: np.ndarray, window: tuple[np.ndarray, np.ndarray]) -> bool:
        """Add the batch's descriptors [B, 3] to the CUSUM (each one's deviation from the long
        ``window``'s mean, before the batch, in its standard deviations, clipped to
        ``CUSUM_CLIP``, less ``CUSUM_K`` per sample, the sums floored at 0 after each batch)
        and return whether one sum is over ``CUSUM_H``; nothing is added before the long
        window holds ``CUSUM_MIN_SAMPLES`` samples' weight."""
        if self.long_weight < 1.0 - self.long_factor**CUSUM_MIN_SAMPLES:
            return False
        mean, variance = window
        deviation = np.clip((values - mean) / np.sqrt(variance), -CUSUM_CLIP, CUSUM_CLIP)
        total = deviation.sum(axis=0)
        self.cusum = np.maximum(
            self.cusum + np.concatenate([total, -total]) - CUSUM_K * len(values), 0.0)
        return bool(self.cusum.max() > CUSUM_H)

    def _z_squared(self, window: tuple[np.ndarray, np.ndarray]) -> float | None:
        """The largest descriptor's z^2, recent window against the long ``window`` (its mean and
        variance, :meth:`long_window`); None before both hold
        ``RECENT_SAMPLES`` samples' weight."""
        if self.recent_weight < 1.0 - self.recent_factor**RECENT_SAMPLES or \
                self.long_weight < 1.0 - self.long_factor**RECENT_SAMPLES:
            return None
        mean, variance = window
        z_squared = (self.recent_mean - mean) ** 2 * RECENT_SAMPLES / variance
        return float(z_squared.max())

    def long_window(self) -> tuple[np.ndarray, np.ndarray]:
        """The long window's mean [3] and variance [3] of each descriptor, the variance
        floored at 1e-8 x (1 + mean^2) (what the change test divides by)."""
        width = len(DESCRIPTORS)
        mean = self.long_moments[:width]
        variance = np.maximum(self.long_moments[width:] - mean**2, 0.0) + 1e-8 * (1.0 + mean**2)
        return mean, variance
