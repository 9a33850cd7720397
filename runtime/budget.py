"""The compute budget: how many forwards per sample adaptation may spend, and where.

An adapting method pays ``forwards`` (EVA-0: 2) forwards per sample it adapts on; a batch
served at the current theta pays one (the activation shift keeps learning from it). A budget
of F forwards per sample (1 <= F <= forwards) is kept as a bucket of credit counted in extra
forwards: every sample adds F - 1 (one in a guard duel too), adapting on a batch of B takes
B (forwards - 1), a duel of the health guard takes what it ran beyond one forward per sample.
A duel (a trip's pause, an audit, the next pause of a hold) starts only when the credit pays
for all of it: one it cannot pay for is not run, and the candidate gives way to theta0, the
side every duel falls back to, served with one forward per sample (:mod:`.controller`); so
does a duel that a change of stream would lengthen beyond what the credit pays for. The credit
goes below 0 by at most the batch that ends a duel, and adaptation waits until that is paid
for.
The bucket holds at most ``budget_burst`` (default ``BURST_SAMPLES``, 1024) samples' worth,
(F - 1) x burst, and starts full, so over any N samples the forward counter reads at most
F N + (F - 1) burst + B (:func:`forwards_bound`).

Where the credit goes (a token bucket with two speeds):

* **dense** after a change of stream (the start, a change the input detector or the
  activation shift sees, a guard trip or verdict): every batch is adapted on while the
  credit lasts. A new stream is where a step pays (the continual tables: most of EVA-0's gain
  over the shift alone comes in the first few hundred samples of a corruption);
* **settled** otherwise: a batch is adapted on only when serving it would let the next
  batch's credit overflow the full bucket, so a stream the model has learnt gets the
  budget's average rate spread evenly (F = 1.9: nine batches in ten), and the bucket is full
  again for the next change.

A change that finds the bucket empty waits for it to fill, so on a stream that changes every
``burst`` or so samples the credit goes to every second change, whole. Spending such a change's
own credit at once instead (dense for ``burst`` samples after every change, one batch in two at
F = 1.5) measured worse on the validation split, continual, 1000 images per corruption (before
a duel's samples earned their credit): the ResNet-GN at B = 64 -0.33 from full cost against
-0.23 (five seeds, standard error 0.09), the ViT -0.42 and -0.36 at B = 16 and 64; keeping part
of the bucket for the next change measured worse on both models once they did
(``results/budget-schedule/``): dense steps on one stream pay more than the same steps
spread over two.

F = forwards adapts on every batch (the method as it is, bit for bit); F = 1 never adapts: the
method serves at theta0 with the activation shift, noadapt-shift's forward.
"""

from __future__ import annotations

BURST_SAMPLES = 1024
MAX_BURST_SAMPLES = 1 << 20


def check_budget(method: str, budget: float | None, forwards: int, burst: int) -> None:
    """ValueError unless ``budget`` (forwards per sample; None: adapt on every batch) is
    between 1 and ``method``'s own ``forwards`` and ``burst`` (``budget_burst``, samples; checked
    with or without a budget, so a bad value in a config never waits for one) is in range."""
    if budget is not None and not 1 <= budget <= forwards:
        raise ValueError(f"{method}: budget must be between 1 and the method's {forwards} "
                         f"forwards per sample (None: {forwards}), got {budget}")
    if not 1 <= burst <= MAX_BURST_SAMPLES:
        raise ValueError(f"budget_burst must be between 1 and {MAX_BURST_SAMPLES} samples, "
                         f"got {burst}")


def forwards_bound(budget: float, burst: int, samples: int, batch: int) -> float:
    """The most forwards per sample the counter reads over ``samples`` samples served in
    batches of ``batch`` at ``budget`` F with a bucket of ``burst`` samples' credit: F, plus
    the full bucket it starts with and the batch that may end a duel, spread over the samples:
    F + ((F - 1) burst + batch) / samples."""
    return budget + ((budget - 1.0) * burst + batch) / samples


class ComputeBudget:
    """The bucket for ``budget`` forwards per sample of a method with ``forwards`` per adapted
    sample (``asynchronous``: adapted apart from the served forward, see ``extra``), holding
    ``burst`` samples' credit.
    ``credit`` (extra forwards, at most the capacity; below 0 while the guard's duels are being
    paid for) is saved in the adaptation state as ``fill``."""

    def __init__(
        self, budget: float, forwards: int, asynchronous: bool = False,
        burst: int = BURST_SAMPLES,
    ) -> None:
        check_budget("compute budget", budget, forwards, burst)
        self.budget = float(budget)
        # forwards an adapted sample pays beyond the served one: the step's own prediction is
        # served (forwards - 1), or, adapting apart from serving (the asynchronous server), none
        self.extra = forwards if asynchronous else forwards - 1
        self.burst = burst
        self.capacity = (self.budget - 1.0) * burst
        self.credit = self.capacity
        self.dense = True
        self.adapted_samples = 0
        self.served_samples = 0

    def summary(self) -> dict[str, float | int]:
        """What ``stats()["budget"]`` reports: the budget, the bucket's size (samples' credit)
        and fill, and the samples adapted on and served only."""
        return {"forwards_per_sample": self.budget, "burst": self.burst, "fill": self.fill,
                "adapted_samples": self.adapted_samples, "served_samples": self.served_samples}

    @property
    def fill(self) -> float:
        """The credit as a share of the bucket, 0..1 (what the state file keeps: a debt to
        the guard's duels is forgiven across a restart)."""
        return min(1.0, max(0.0, self.credit / self.capacity)) if self.capacity > 0 else 1.0

    @fill.setter
    def fill(self, share: float) -> None:
        self.credit = min(max(share, 0.0), 1.0) * self.capacity

    def changed(self) -> None:
        """A change of stream: spend densely until the credit runs out."""
        self.dense = True

    def settle(self) -> None:
        """The stream is one already learnt (the domain bank recalled it): spend evenly, the
        credit kept for streams it does not know."""
        self.dense = False

    def adapt(self, batch: int) -> bool:
        """Whether to adapt on the next batch of ``batch`` samples (and charge it): the
        synchronous step, which :meth:`earn`s the batch's credit and then :meth:`spend`s."""
        self.earn(batch)
        return self.spend(batch)

    def earn(self, batch: int) -> None:
        """Add the credit of ``batch`` served samples, (F - 1) each, up to the bucket (or one
        batch's cost, when that is larger)."""
        capacity = max(self.capacity, batch * self.extra)
        self.credit = min(capacity, self.credit + (self.budget - 1.0) * batch)

    def spend(self, batch: int) -> bool:
        """Whether the credit pays for adapting on ``batch`` samples now (dense: whenever it
        can; settled: only when the next batch's credit would overflow the bucket); if so it
        is taken. Counts the samples as adapted on, or as served only."""
        cost = batch * self.extra
        capacity = max(self.capacity, cost)  # a low budget still affords a large batch now and then
        affordable = self.credit >= cost
        # settled: adapt when serving would let the next batch's credit overflow the bucket
        overflows = self.credit + (self.budget - 1.0) * batch > capacity
        take = affordable and (self.dense or overflows)
        self.dense = self.dense and affordable
        if take:
            self.credit -= cost
            self.adapted_samples += batch
        else:
            self.served_samples += batch
        return take

    def charge(self, extra_forwards: float) -> None:
        """Take forwards the guard spent beyond one per sample (a duel is started, and
        lengthened, only when the credit pays for it; its last batch may take the credit below
        0, and adaptation then waits until that is paid for)."""
        self.credit -= extra_forwards
