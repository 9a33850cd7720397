"""Domain memory: the adapted states of past stream segments, recalled when a segment comes back.

A *segment* is the stream between two changes the input change detector calls
(:mod:`.inputwatch`). When one ends, what was adapted on it is kept in a slot: theta, the
sample-wise feature moments and the activation shift's window (the guard's verdict is kept by
what is stored: a segment is stored only while the guard is neither pausing nor holding, so a
slot holds a theta the guard vouched for). The slot's key is the segment's own input
descriptor, the detector's long window at the change: each descriptor's mean and variance
(brightness, contrast, roughness; 6 floats).

``RECALL_SAMPLES`` (32) samples into a new segment, its descriptors' mean is compared with
every key by the detector's own test: z_d^2 = (m_recent - m_key)^2 n / var_key per descriptor,
n the recent window's samples, the slot's distance the largest z_d. The nearest slot within
``threshold`` (config ``bank_threshold``, in those standard errors; default the detector's
``CHANGE_Z``: a segment the detector would not call a change from) is *recalled*: its state
is restored at no forward, adaptation goes on from there, and the compute budget spends as on
a stream it has learnt (:meth:`~.budget.ComputeBudget.settle`). None within: a *miss*, a new
segment, which gets the dense credit. When a recalled segment ends, its slot is updated
in place; a new one takes a free slot or evicts the least recently used (``bank_slots``, N).

Memory: N x (P + D + K + 2F + 11) floats (P adapted parameters, D the head input, K classes,
F features): the shipped ViT's 8 slots are 8 x 3,9xx floats. The bank is kept in the state
file (``bank_*`` arrays, validated as the rest of the state: :func:`check_bank`), so it
survives a restart; ``reset`` empties it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .inputwatch import CHANGE_Z, DESCRIPTORS, RECENT_SAMPLES
from .state import AdaptState, StateError

BANK_SLOTS = 8
BANK_THRESHOLD = CHANGE_Z
MAX_BANK_SLOTS = 64
RECALL_SAMPLES = RECENT_SAMPLES
MIN_SEGMENT_SAMPLES = 128  # a shorter segment taught too little to keep
KEY_WIDTH = 2 * len(DESCRIPTORS)  # each descriptor's mean, then its variance
# per slot: the shift's mean squared norm and weight, the moments' weight, the slot's last use
SCALARS = ("shift_sq", "shift_weight", "stat_weight", "last_used", "samples")


@dataclass
class Memory:
    """One segment's adapted state. key: [6] descriptor means then variances; theta: [P]
    float32; shift_mean: [D] (empty without a shift); moments: [K + 2F] the centre, mean and
    second moment; shift_classes: [K] the shift window's class mix (empty unless the shift
    corrects for label shift); the scalars as :data:`SCALARS` name them (``samples``: the
    segment's length in samples, ``last_used``: the bank's clock when it was last stored or
    recalled)."""

    key: np.ndarray
    theta: np.ndarray
    shift_mean: np.ndarray
    moments: np.ndarray
    shift_sq: float
    shift_weight: float
    stat_weight: float
    last_used: float
    samples: float
    shift_classes: np.ndarray = field(default_factory=lambda: np.zeros(0))


class DomainBank:
    """At most ``slots`` memories; a recent descriptor mean within ``threshold`` standard
    errors of a key recalls its memory. Counts ``hits``, ``misses`` and ``evictions``."""

    def __init__(self, slots: int, threshold: float) -> None:
        self.slots = slots
        self.threshold = threshold
        self.memories: list[Memory] = []
        self.clock = 0.0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self.memories)

    def summary(self) -> dict[str, float | int]:
        """What ``stats()["bank"]`` reports."""
        return {"slots": self.slots, "used": len(self), "threshold": self.threshold,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}

    def distances(self, recent_mean: np.ndarray, samples: float) -> np.ndarray:
        """Each slot's distance [N] from a recent window of ``samples`` samples with descriptor
        means ``recent_mean`` [3]: the largest z over the descriptors (see the module)."""
        if not self.memories:
            return np.zeros(0)
        keys = np.stack([m.key for m in self.memories])
        width = len(DESCRIPTORS)
        variance = np.maximum(keys[:, width:], 1e-12)
        z_squared = (recent_mean[None] - keys[:, :width]) ** 2 * samples / variance
        return np.sqrt(z_squared.max(axis=1))

    def recall(self, recent_mean: np.ndarray, samples: float, count_miss: bool = True,
               ) -> int | None:
        """The slot of the nearest memory within the threshold (touched: the most recently
        used now), counted as a hit; None, counted as a miss with ``count_miss``."""
        distances = self.distances(recent_mean, samples)
        if not distances.size or distances.min() >= self.threshold:
            self.misses += int(count_miss)
            return None
        slot = int(distances.argmin())
        self.hits += 1
        self.clock += 1.0
        self.memories[slot].last_used = self.clock
        return slot

    def store(self, memory: Memory, slot: int | None) -> int:
        """Keep ``memory``: in ``slot`` (the one the segment was recalled from), else a free
        slot, else the least recently used one's (an eviction). Returns the slot."""
        self.clock += 1.0
        memory.last_used = self.clock
        if slot is None and len(self.memories) < self.slots:
            self.memories.append(memory)
            return len(self.memories) - 1
        if slot is None:
            slot = int(np.argmin([m.last_used for m in self.memories]))
            self.evictions += 1
        self.memories[slot] = memory
        return slot

    # ------------------------------------------------------------- the state file
    def write(self, state: AdaptState) -> None:
        """Put the memories into the state's ``bank_*`` arrays (slot after slot)."""
        memories = self.memories
        state.bank_keys = _joined([m.key for m in memories])
        state.bank_theta = _joined([m.theta for m in memories], np.float32)
        state.bank_shift = _joined([m.shift_mean for m in memories])
        state.bank_moments = _joined([m.moments for m in memories])
        state.bank_scalars = _joined([
            np.array([getattr(m, name) for name in SCALARS]) for m in memories])
        state.bank_shift_classes = _joined([m.shift_classes for m in memories])

    @classmethod
    def read(cls, state: AdaptState, slots: int, threshold: float, shift_width: int) -> DomainBank:
        """The bank kept in ``state`` (checked by :func:`check_bank` first)."""
        bank = cls(slots, threshold)
        moments_width = _moments_width(state)
        count = state.bank_keys.size // KEY_WIDTH
        if not count:
            return bank
        keys = state.bank_keys.reshape(count, KEY_WIDTH)
        thetas = state.bank_theta.reshape(count, -1)
        shifts = state.bank_shift.reshape(count, shift_width)
        moments = state.bank_moments.reshape(count, moments_width)
        scalars = state.bank_scalars.reshape(count, len(SCALARS))
        mixes = state.bank_shift_classes.reshape(count, -1)
        for i in range(count):
            values = dict(zip(SCALARS, map(float, scalars[i]), strict=True))
            bank.memories.append(Memory(keys[i].copy(), thetas[i].astype(np.float32),
                                        shifts[i].copy(), moments[i].copy(), **values,
                                        shift_classes=mixes[i].copy()))
        bank.clock = float(scalars[:, SCALARS.index("last_used")].max())
        return bank


def _moments_width(state: AdaptState) -> int:
    """The floats of one slot's moments: K + 2F, the centre, mean and second moment."""
    return state.center.size + state.mean.size + state.second_moment.size


def _joined(parts: list[np.ndarray], dtype: type = np.float64) -> np.ndarray:
    """The 1-D concatenation of ``parts`` (empty for none)."""
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)


def bank_sizes(num_params: int, num_features: int, num_classes: int) -> dict[str, int]:
    """The most elements each ``bank_*`` array of a state may hold (``MAX_BANK_SLOTS`` slots;
    a state's slots are then held to the policy's ``bank_slots`` by :func:`check_bank`)."""
    return {
        "bank_keys": MAX_BANK_SLOTS * KEY_WIDTH,
        "bank_theta": MAX_BANK_SLOTS * num_params,
        "bank_shift": MAX_BANK_SLOTS * num_features,
        "bank_moments": MAX_BANK_SLOTS * (num_classes + 2 * num_features),
        "bank_scalars": MAX_BANK_SLOTS * len(SCALARS),
        "bank_shift_classes": MAX_BANK_SLOTS * num_classes,
    }


def check_bank(
    state: AdaptState, slots: int, theta0: np.ndarray, theta_radius: float,
    shift_width: int, num_classes: int, shift_source: np.ndarray | None, shift_radius: float,
) -> None:
    """StateError naming the first ``bank_*`` field that is not a bank this policy could have
    kept: more slots than ``slots``, arrays of sizes that do not agree on one slot count (P
    ``theta0.size`` per theta, ``shift_width`` per shift mean, K + 2F per moments), a key with
    a variance <= 0, a theta beyond ``theta_radius`` of theta0, a shift mean beyond
    ``shift_radius`` of the source head mean (or a squared norm below its mean's), weights
    outside [0, 1], a negative second moment or count."""
    keys = state.bank_keys
    if keys.size % KEY_WIDTH:
        raise StateError(f"state bank_keys has {keys.size} values, not {KEY_WIDTH} per slot")
    count = keys.size // KEY_WIDTH
    if count > slots:
        raise StateError(f"state bank_keys holds {count} slots; this policy keeps at most "
                         f"{slots} (bank_slots)")
    moments_width = _moments_width(state)
    widths = {"bank_theta": theta0.size, "bank_shift": shift_width,
              "bank_moments": moments_width, "bank_scalars": len(SCALARS)}
    for name, width in widths.items():
        size = getattr(state, name).size
        if size != count * width:
            raise StateError(f"state {name} has {size} values; {count} slots of this model "
                             f"need {count * width}")
    mixes = state.bank_shift_classes
    if mixes.size not in (0, count * num_classes):
        raise StateError(f"state bank_shift_classes has {mixes.size} values; {count} slots of "
                         f"this model need {count * num_classes} (or none)")
    if not count:
        return
    if mixes.size:
        rows = mixes.reshape(count, num_classes)
        if (rows < 0).any() or (np.abs(rows.sum(axis=1) - 1.0) > 1e-6).any():
            raise StateError("state bank_shift_classes holds a row that is not a class mix "
                             "(values >= 0 summing to 1)")
    width = len(DESCRIPTORS)
    if (keys.reshape(count, KEY_WIDTH)[:, width:] <= 0).any():
        raise StateError("state bank_keys holds a descriptor variance <= 0")
    thetas = state.bank_theta.reshape(count, -1).astype(np.float64)
    far = np.linalg.norm(thetas - theta0.astype(np.float64)[None], axis=1).max()
    if far > theta_radius:
        raise StateError(f"state bank_theta holds a theta {far:.4g} from theta0; this model "
                         f"allows at most {theta_radius:.4g}")
    scalars = state.bank_scalars.reshape(count, len(SCALARS))
    named = {name: scalars[:, i] for i, name in enumerate(SCALARS)}
    for name in ("shift_weight", "stat_weight"):
        if ((named[name] < 0) | (named[name] > 1)).any():
            raise StateError(f"state bank_scalars holds a {name} outside [0, 1]")
    for name in ("shift_sq", "last_used", "samples"):
        if (named[name] < 0).any():
            raise StateError(f"state bank_scalars holds a negative {name}")
    moments = state.bank_moments.reshape(count, moments_width)
    if (moments[:, num_classes + state.mean.size:] < 0).any():
        raise StateError("state bank_moments holds a negative second moment")
    if shift_width:
        shifts = state.bank_shift.reshape(count, shift_width)
        if shift_source is not None:
            far = np.linalg.norm(shifts - shift_source[None], axis=1).max()
            if far > shift_radius:
                raise StateError(f"state bank_shift holds a mean {far:.4g} from the source "
                                 f"head mean; this model allows at most {shift_radius:.4g}")
        norms = (shifts**2).sum(axis=1)
        if (named["shift_sq"] < norms * (1.0 - 1e-9) - 1e-12).any():
            raise StateError("state bank_scalars holds a shift_sq below its bank_shift mean's "
                             "squared norm: not moments of one set of samples")
