"""Activation shifting for norm-adapted models (FOA's, Niu et al. 2024, at no extra forward).

The classifier's input is moved toward the source: ``h' = h + s`` with
``s = strength * (m_source - m_test)``, m_source the mean head input on the calibration images
(the model file's source statistics) and m_test a windowed mean of the test-time head inputs.
The head is affine, so the shifted logits are ``logits + W s`` (:mod:`.head`): a [K] offset per
step, no forward. FOA uses strength 1 and an EMA that gives the new batch of 64 a weight of 0.1,
i.e. a factor 0.9 per 64 samples; the window here is per sample (:mod:`.rates`), so the same
W samples count at every batch size (FOA's EMA reads as W = 64 x 1.9 / 0.1 = 1216).

Like FOA, a batch is served with the shift learnt from the samples before it, then its own head
inputs enter the window. The shift only changes what is served: the adaptation objective sees
the model's own logits.

``shift_max`` bounds what the shift acts on: when ||m_source - m_test|| exceeds it (a stream far
from every corruption the bound was learnt on: black frames, white frames, noise) the window
restarts empty and nothing is shifted, so such a stream leaves nothing behind for the images
that follow it. With a bound, a window is checked and served only once it holds
``BOUND_SAMPLES`` (64) samples' weight: one image is far from any mean. The shipped files learn
the bound on the validation corruptions (``models/recipes/shift_bound.py``).

Label shift. ``m_source - m_test`` assumes the window holds the classes in the source's mix. In
a run of one class (a camera watching one object; SAR's class-sorted stream) m_test is that
class's mean, and the shift moves the run off its own class (the one-forward tier 10-16
points below NoAdapt on the validation split's class-sorted streams, ``results/label-shift/``).
Where the file carries the per-class source means
M [K, D] (``head_input_class_means``, written by ``eva0-edge calibrate``; classes as the file
predicts them on the clean images) and ``prior_window`` is set, the gap is taken at the
window's own class mix: ``gap = m_source - m_test + rho (q - pi) @ M`` with q [K] the window's
predicted class mix (argmax of the unshifted logits), pi [K] the stream's over the last
``prior_window`` samples (starting balanced; a batch after which the recent window is
:meth:`~ActivationShift.degenerate`, black frames or one image repeated, does not count: its
one predicted class says nothing of the stream's mix, and 500 black frames taught the
ResNet-GN's pi their class, which tilted the clean images after them) and rho in [0, 1] how
far the 32-sample window's class mix is from pi beyond its sampling noise (James-Stein's
positive part,
:meth:`ActivationShift.label_persistence`): an i.i.d. stream, whatever its mix, is shifted as
before (rho near 0, so a corruption that tips the predictions toward a few classes is still
corrected), a run of one class by the covariate offset alone. Numbers:
``results/label-shift/`` (``studies/label-shift/label_shift.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from .head import HeadError, LinearHead, cached_head
from .metadata import ModelMetadata
from .rates import window_factor, windowed_update
from .session import AdaptableSession
from .state import AdaptState

if TYPE_CHECKING:
    from .config import AdaptConfig

log = logging.getLogger(__name__)

BOUND_SAMPLES = 64
RECENT_SAMPLES = 32
CHANGE_Z = 3.0
MIN_SPREAD = 0.05  # least share of E||h||^2 the window's variance must have to be shifted


def source_head_mean(metadata: ModelMetadata, head: LinearHead) -> np.ndarray:
    """m_source [D]: the calibrated mean head input (``head_input_mean``), or, where the head
    reads a feature segment as it is, that segment's source mean. HeadError when the file has
    neither (run ``eva0-edge calibrate`` again)."""
    arrays = metadata.arrays
    if "head_input_mean" in arrays:
        mean = arrays["head_input_mean"].astype(np.float64)
        if mean.shape != (head.width,):
            raise HeadError(f"head_input_mean has shape {mean.shape}, the head reads "
                            f"{head.width} values")
        return mean
    if head.norm is None and metadata.has_source_stats:
        return arrays["source_mean"][head.segment].astype(np.float64)
    raise HeadError("activation shifting needs the source mean of the classifier's input: "
                    "run `eva0-edge calibrate` on this file (it adds head_input_mean)")


def source_class_means(metadata: ModelMetadata, head: LinearHead) -> np.ndarray | None:
    """M [K, D]: the calibrated mean head input per predicted class
    (``head_input_class_means``), or None when the file was calibrated without it; HeadError
    when its size does not fit the head."""
    flat = metadata.arrays.get("head_input_class_means")
    if flat is None:
        return None
    if flat.size != head.weight.size:
        raise HeadError(f"head_input_class_means holds {flat.size} values, the head reads "
                        f"{head.weight.shape[0]} x {head.width}")
    return flat.astype(np.float64).reshape(head.weight.shape)


class ActivationShift:
    """The shift of one model: ``strength`` (FOA: 1), ``window`` (samples, >= 1), the head,
    m_source [D] and the bound. Its windows live in the adaptation state (``shift_*`` fields of
    :class:`~.state.AdaptState`), so they are saved and restored with theta.

    Two windows of the head input: the long one (``window`` samples) is what the shift uses;
    a recent one of ``RECENT_SAMPLES`` (32) watches for a change of stream. When the recent mean
    is more than ``CHANGE_Z`` (3) of its own standard errors from the long mean (in the long
    window's total variance: z^2 = ||m_recent - m_long||^2 R / var), the long window restarts
    empty and refills from the samples that follow: after black or noise frames (no variance,
    or another mean) the shift follows the images that come next within tens of samples
    instead of a window's length, and a new corruption in a continual stream gets its own
    shift as soon. A window is served once it holds ``RECENT_SAMPLES`` samples' weight
    (``BOUND_SAMPLES`` with a bound): a mean of fewer images is mostly their own noise; and
    only while its variance is at least ``MIN_SPREAD`` (5%) of its mean squared norm: moving
    one image repeated (a camera facing a wall) to the source mean erases what it shows
    (validation corruptions at theta0: 11-97% on the ViT, 29-49% on the ResNet-GN; one image
    repeated: 0; the ViT on noise frames: 1.3%). The offset is shrunk toward zero by how much
    of the gap to the source mean the window's own sampling noise explains
    (:meth:`_shrinkage`): on clean test images the unshrunk shift cost the ResNet-GN 0.3-0.5
    points (2000 images, B = 2, 8, 32), pure noise moved to the logits.
    """

    def __init__(self, head: LinearHead, source_mean: np.ndarray, strength: float,
                 window: float, max_distance: float | None = None,
                 class_means: np.ndarray | None = None, prior_window: float | None = None,
                 ) -> None:
        if window < 1:
            raise ValueError(f"shift_window must be >= 1 sample, got {window}")
        if max_distance is not None and max_distance <= 0:
            raise ValueError(f"shift_max must be > 0 (or None: unbounded), got {max_distance}")
        self.head = head
        self.source_mean = source_mean
        self.strength = float(strength)
        self.factor = window_factor(window)
        self.recent_factor = window_factor(min(RECENT_SAMPLES, window))
        self.max_distance = max_distance
        if prior_window is not None and prior_window < 1:
            raise ValueError(f"shift_prior_window must be >= 1 sample (or None: off), got "
                             f"{prior_window}")
        if class_means is not None and class_means.shape != head.weight.shape:
            raise HeadError(f"head_input_class_means has shape {class_means.shape}, the head "
                            f"is {head.weight.shape}")
        self.class_means = None if prior_window is None else class_means
        self.prior_factor = 0.0 if prior_window is None else window_factor(prior_window)
        self.checked_weight = 1 - self.factor ** (
            RECENT_SAMPLES if max_distance is None else BOUND_SAMPLES)
        self.restarts = 0
        self.changes = 0
        self._offset_key: tuple[float, float, bytes] | None = None
        self._offset: np.ndarray | None = None

    def degenerate(self, state: AdaptState) -> bool:
        """Whether the recent window (full: ``RECENT_SAMPLES`` samples' weight) holds a stream
        with almost no spread: variance under ``MIN_SPREAD`` of its mean squared norm (black or
        white frames, one image repeated, noise frames: the ViT at theta0 1.3%; the validation
        corruptions 10% or more). Such a stream teaches nothing worth keeping."""
        full = 1.0 - self.recent_factor**RECENT_SAMPLES
        if not state.shift_recent.size or state.shift_recent_weight < full:
            return False
        square = state.shift_recent_sq
        return bool(square - float(state.shift_recent @ state.shift_recent) < MIN_SPREAD * square)

    def offset(self, state: AdaptState) -> np.ndarray:
        """The logit offset W s [K] (read-only) for the state's test mean (zero until the
        window holds ``RECENT_SAMPLES`` samples, ``BOUND_SAMPLES`` with a bound). It is kept
        with the window it came from (its weight, squared norm and mean, compared by value) and
        computed again only when they change: the asynchronous server learns from one-image
        requests in blocks, so seven of eight are served with the offset the block left
        (23 us of NumPy each on the shipped ResNet-GN)."""
        key = (state.shift_weight, state.shift_sq, state.shift_mean.tobytes())
        if self._offset is None or key != self._offset_key:
            offset = self._compute_offset(state)
            offset.flags.writeable = False
            self._offset_key, self._offset = key, offset
        return self._offset

    def _compute_offset(self, state: AdaptState) -> np.ndarray:
        weight = state.shift_weight
        if not state.shift_mean.size or weight <= 0 or weight < self.checked_weight:
            return np.zeros(self.head.bias.shape)
        variance = _variance(state)
        if variance < MIN_SPREAD * state.shift_sq:
            return np.zeros(self.head.bias.shape)
        gap = self.gap(state)
        return self.head.weight @ (self.strength * self._shrinkage(state, variance, gap) * gap)

    @property
    def corrects_label_shift(self) -> bool:
        """Whether the shift corrects for the class mix (the file's per-class source means and
        a ``prior_window``; see the module's docstring)."""
        return self.class_means is not None

    def gap(self, state: AdaptState) -> np.ndarray:
        """What the shift moves the head input by before its strength and shrinkage [D]:
        ``m_source - m_test``, plus, when it corrects for label shift,
        ``(q - pi) @ M`` (q [K] the window's predicted class mix, pi [K] the stream's long-run
        one, M [K, D] the per-class source means)."""
        gap = self.source_mean - state.shift_mean
        classes = 0 if self.class_means is None else self.class_means.shape[0]
        if not classes or state.shift_classes.size != classes or \
                state.shift_prior.size != classes:
            return gap
        return gap + self.label_persistence(state) * (
            (state.shift_classes - state.shift_prior) @ self.class_means)

    def label_persistence(self, state: AdaptState) -> float:
        """rho in [0, 1]: how far the short change window's class mix r [K] is from the
        stream's long-run one pi beyond what independent draws from pi would put between them,
        James-Stein's positive part ``max(0, 1 - noise / ||r - pi||^2)`` with noise
        ``(1 - sum pi^2) / RECENT_SAMPLES`` (the window mean's expected squared error): about 0
        on an i.i.d. stream, 1 in a run of one class."""
        recent = state.shift_recent_classes
        if recent.size != state.shift_prior.size:
            return 0.0
        distance = float(((recent - state.shift_prior) ** 2).sum())
        noise = (1.0 - float(state.shift_prior @ state.shift_prior)) / RECENT_SAMPLES
        return max(0.0, 1.0 - noise / max(distance, 1e-30))

    def _shrinkage(self, state: AdaptState, variance: float, gap: np.ndarray) -> float:
        """James-Stein's positive part: ``max(0, 1 - noise / ||gap||^2)``, noise the window
        mean's expected squared error (total variance / effective sample count). A stream
        from the source's own distribution (clean images) has a gap of about its noise and is
        barely shifted; a corruption's gap is many times its noise and is shifted in full."""
        a, w = self.factor, state.shift_weight
        effective = w * w * (1.0 + a) / ((1.0 - a) * (1.0 - (1.0 - w) ** 2))
        noise = max(variance, 0.0) / effective
        return max(0.0, 1.0 - noise / max(float(gap @ gap), 1e-30))

    def summary(self, state: AdaptState) -> dict[str, float | int]:
        """What the statistics report of the shift on ``state`` (JSON-serialisable)."""
        return {
            "strength": self.strength,
            "samples_weight": state.shift_weight,
            "restarts": self.restarts,
            "stream_changes": self.changes,
            "logit_offset_norm": float(np.linalg.norm(self.offset(state))),
        }

    def restart(self, state: AdaptState) -> None:
        """Empty both windows."""
        state.shift_weight = state.shift_recent_weight = 0.0

    def observe(self, state: AdaptState, features: np.ndarray) -> None:
        """Add the head inputs of ``features`` [B, F] (stream order) to both windows (and, when
        the shift corrects for label shift, their predicted classes, the argmax of the unshifted
        logits, to the class mixes, and to pi unless the recent window is then
        :meth:`degenerate`); empty the long one on a change of stream, and both when the gap to
        the source is beyond ``max_distance``."""
        h = self.head.head_input(features)
        squares = (h**2).sum(axis=1, keepdims=True)
        st, width = state, self.head.width
        classes = 0 if self.class_means is None else self.class_means.shape[0]
        if not st.shift_mean.size or st.shift_weight == 0:
            st.shift_mean, st.shift_sq, st.shift_weight = np.zeros(width), 0.0, 0.0
            st.shift_classes = np.zeros(classes)
        if not st.shift_recent.size or st.shift_recent_weight == 0:
            st.shift_recent, st.shift_recent_sq, st.shift_recent_weight = np.zeros(width), 0.0, 0.0
            st.shift_recent_classes = np.zeros(classes)
        moments = np.concatenate([h, squares], axis=1)
        if classes:
            predicted = np.eye(classes)[(h @ self.head.weight.T + self.head.bias).argmax(axis=1)]
            if st.shift_classes.size != classes:  # a window from a file without the correction
                st.shift_classes = np.full(classes, 1.0 / classes)
            if st.shift_prior.size != classes:  # a fresh stream: its classes balanced
                st.shift_prior = np.full(classes, 1.0 / classes)
            long, st.shift_weight = windowed_update(
                np.concatenate([st.shift_mean, [st.shift_sq], st.shift_classes]),
                st.shift_weight, np.concatenate([moments, predicted], axis=1), self.factor)
            st.shift_classes, long = long[width + 1:], long[:width + 1]
            if st.shift_recent_classes.size != classes:
                st.shift_recent_classes = np.full(classes, 1.0 / classes)
            recent, st.shift_recent_weight = windowed_update(
                np.concatenate([st.shift_recent, [st.shift_recent_sq], st.shift_recent_classes]),
                st.shift_recent_weight, np.concatenate([moments, predicted], axis=1),
                self.recent_factor)
            st.shift_recent_classes, recent = recent[width + 1:], recent[:width + 1]
        else:
            long, st.shift_weight = windowed_update(
                np.append(st.shift_mean, st.shift_sq), st.shift_weight, moments, self.factor)
            recent, st.shift_recent_weight = windowed_update(
                np.append(st.shift_recent, st.shift_recent_sq), st.shift_recent_weight, moments,
                self.recent_factor)
        st.shift_mean, st.shift_sq = long[:-1], float(long[-1])
        st.shift_recent, st.shift_recent_sq = recent[:-1], float(recent[-1])
        if classes and not self.degenerate(st):
            st.shift_prior = windowed_update(st.shift_prior, 1.0, predicted, self.prior_factor)[0]
        if self._changed(st):
            self.changes += 1
            st.shift_weight = 0.0
        elif self.max_distance is not None and st.shift_weight >= self.checked_weight and \
                np.linalg.norm(self.gap(st)) > self.max_distance:
            self.restarts += 1
            self.restart(st)

    def _changed(self, st: AdaptState) -> bool:
        full = 1.0 - self.recent_factor**RECENT_SAMPLES
        if st.shift_recent_weight < full or st.shift_weight < 1.0 - self.factor**RECENT_SAMPLES:
            return False
        variance = max(_variance(st), 0.0)
        gap = float(((st.shift_recent - st.shift_mean) ** 2).sum())
        floor = 1e-12 * (1.0 + float(st.shift_mean @ st.shift_mean))
        return gap * RECENT_SAMPLES > CHANGE_Z**2 * (variance + floor)


class SourceFreeShift(ActivationShift):
    """The activation shift of a file without source statistics (EVA-0-dagger's, fully
    source-free): the served logits move by ``strength`` x the offset that makes the windowed
    mean logit equal across classes, ``o = mean_k(l_bar) - l_bar`` with
    ``l_bar = W m_test + b`` [K] the head applied to the window's mean head input.

    Why that target: the head is affine, so any shift of its input acts on the logits only
    through ``W s`` [K], and of the source mean only the mean logit ``W m_source + b`` matters,
    up to a constant (softmax ignores one). A classifier trained on balanced classes has a mean
    source logit that is nearly the same for every class (the shipped Fashion-MNIST models:
    within 0.34 nats of its class average, where a severity-5 corruption moves it by several
    nats), so "equal across classes" stands in for the source mean with nothing but the head's
    weights and the unlabelled test stream (a stream whose classes are far from balanced is
    moved toward balance: the same assumption the source mean makes of the test stream).

    A trained classifier's own mean logit is not exactly balanced (the shipped models on clean
    validation images: 0.13-0.16 nats root-mean-square over the classes, 0.15-0.17 in a window
    of 256; a severity-5 corruption the shift helps on: 0.4-1.2), and moving it costs clean
    accuracy (0.4-1.0 points on the ViT at strength 1 to 1.5). So the offset is shrunk as the source
    shift's is, James-Stein's positive part: ``max(0, 1 - margin^2 / rms^2)`` with ``rms`` the
    offset's root-mean-square over the classes and ``margin`` (nats) the imbalance taken for
    the model's own; a clean stream is barely moved, a corrupted one in full.

    The windows, the change detector, the least spread and the served weight are the parent's
    (``max_distance`` is not used: its bound is a distance to a source mean). ``source_mean``
    is the origin [D], only the reference the state limits measure the windows from.
    """

    def __init__(self, head: LinearHead, strength: float, window: float,
                 margin: float = 0.0) -> None:
        if margin < 0:
            raise ValueError(f"free_shift_margin must be >= 0, got {margin}")
        super().__init__(head, np.zeros(head.width), strength, window, None)
        self.margin = float(margin)

    def _compute_offset(self, state: AdaptState) -> np.ndarray:
        weight = state.shift_weight
        if not state.shift_mean.size or weight <= 0 or weight < self.checked_weight:
            return np.zeros(self.head.bias.shape)
        if _variance(state) < MIN_SPREAD * state.shift_sq:
            return np.zeros(self.head.bias.shape)
        mean_logit = self.head.weight @ state.shift_mean + self.head.bias
        gap = mean_logit.mean() - mean_logit
        square = float(gap @ gap) / gap.size  # rms^2 over the classes
        shrink = max(0.0, 1.0 - self.margin**2 / max(square, 1e-30)) if self.margin else 1.0
        return self.strength * shrink * gap


def _variance(state: AdaptState) -> float:
    """The long window's total variance E||h||^2 - ||E h||^2 (may round below 0)."""
    return state.shift_sq - float(state.shift_mean @ state.shift_mean)


def _check_head(session: AdaptableSession, head: LinearHead, what: str) -> None:
    """Check the head read from ``session``'s file against one forward of a fixed random image
    at theta0 (not counted as a served forward); HeadError naming ``what`` when the classifier
    read from the graph does not reproduce its logits from its features."""
    metadata = session.metadata
    c, h, w = metadata.preprocessing.input_size
    x = np.random.default_rng(0).standard_normal((2, c, h, w)).astype(np.float32)
    counter = session.counter
    saved = (counter.forwards, counter.samples, counter.ort_seconds)
    logits, features = session.run(x, np.broadcast_to(metadata.theta0, (2, metadata.num_params)))
    counter.forwards, counter.samples, counter.ort_seconds = saved
    if not head.matches(logits.astype(np.float64), features):
        raise HeadError(f"{session.path}: the classifier read from the graph does not "
                        f"reproduce its logits from its features; {what} is not available "
                        "for this file")


def load_shift(
    session: AdaptableSession, strength: float, window: float, max_distance: float | None = None,
    prior_window: float | None = None,
) -> ActivationShift:
    """Read the head of ``session``'s file, check it (:func:`_check_head`) and build the shift
    (correcting for label shift over ``prior_window`` samples when the file has the per-class
    source means); HeadError when the file's head cannot be shifted."""
    head = cached_head(session.path, session.metadata)
    source_mean = source_head_mean(session.metadata, head)
    _check_head(session, head, "activation shifting")
    return ActivationShift(head, source_mean, strength, window, max_distance,
                           source_class_means(session.metadata, head), prior_window)


def load_free_shift(
    session: AdaptableSession, strength: float, window: float, margin: float = 0.0
) -> SourceFreeShift:
    """The source-free shift of ``session``'s file (:class:`SourceFreeShift`): its head read
    and checked as :func:`load_shift` does, but no source statistics needed; HeadError when
    the head cannot be shifted."""
    head = cached_head(session.path, session.metadata)
    _check_head(session, head, "the source-free shift")
    return SourceFreeShift(head, strength, window, margin)


def configured_shift(
    session: AdaptableSession, config: AdaptConfig, method: str, asked: bool
) -> ActivationShift | None:
    """The activation shift ``config`` sets: the source shift (``activation_shift`` > 0), else
    the source-free one (``free_shift`` > 0), else None (values checked by
    :func:`.config.engine_config`). A file whose head cannot be shifted refuses a shift the
    user ``asked`` for, and runs unshifted (with a warning) when the shift came from the
    file's tuned values (a quantized copy of a tuned file, a user's file whose classifier is
    not one affine layer)."""
    try:
        if config.activation_shift > 0:
            return load_shift(session, config.activation_shift, config.shift_window,
                              config.shift_max, config.shift_prior_window)
        if config.free_shift > 0:
            return load_free_shift(session, config.free_shift, config.shift_window,
                                   config.free_shift_margin)
    except HeadError as err:
        if asked:
            raise
        which = "activation" if config.activation_shift > 0 else "source-free"
        log.warning("%s: %s shift off: %s", method, which, err)
    return None
