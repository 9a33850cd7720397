"""The adaptation worker: one thread owns the :class:`~..policy.Policy` and its state.

Inference requests queue up and coalesce into one adaptation step (dynamic batching): the worker
takes the oldest request, then keeps taking queued requests while the batch stays within
``max_batch`` rows and the oldest request has waited less than ``max_delay`` seconds. It runs one
``step`` on the concatenated rows and hands every request exactly its own rows back, in order.

With ``adaptive_delay`` (the default) the batch waits only while more requests are on their way:
the server ``announce``s each request as it arrives, before its body is read and decoded, and
the forming batch stops waiting as soon as the queue is empty and no announced request is still
being decoded. A lone client then never pays the delay (its next request cannot come before its
answer), while concurrent clients still coalesce; no request waits longer than ``max_delay``.
Control operations (statistics, reset, state get/put) run on the same thread between steps, so
nothing else ever touches the state.

With ``asynchronous`` (``serve --async-adapt``; EVA-0-family methods) a batch is answered from
one forward at the current theta (:meth:`~..policy.Policy.serve_step`; batches
under 8 rows are learnt from in blocks, and the worker has the policy learn what waits
before a control operation, a pass, a snapshot or the stop) as soon as it has run, and its
rows join the recent inputs (the last ``max_batch`` rows; older ones are
dropped from adaptation). Once ``max_batch`` rows are waiting, the queue is empty and no pass
is running, the worker begins a pass on them (:meth:`~..policy.Policy.begin_pass`,
within the compute budget: the perturbed rows). Its ORT call (the 2 x #rows forwards; the GIL
released) runs on a second thread that Linux schedules only on CPU nothing else wants
(SCHED_IDLE; nice 19 where that is refused; a stop that abandons a pass gives the thread the
normal policy back, where the OS permits, so that the process can end), on a single-threaded
session so that none of it runs on the serving session's intra-op threads
(:meth:`~..session.AdaptableSession.single_threaded`), while the worker goes on serving. The
estimate from it (the losses and the gradient: NumPy, which holds the GIL between its calls)
runs on a third thread at the worker's own priority: a thread at the lowest priority that holds
the GIL waits for CPU to release it, and the answers wait with it (one client, interleaved:
images/s and p99 better in 8 of 9 rounds than with the estimate on the pass thread,
``results/serve-tail/estimate-thread/``). The worker applies the update when both are done
(:meth:`~..policy.AdaptationPass.finish`, dropped if a roll-back, reset or installed
state came in between). So serving never waits for a pass, and a busy CPU starves passes, not
answers. (On a session whose ORT calls share one IOBinding, the CUDA default, the call runs on
the worker between requests instead.) A response never depends on a later request and no input
is adapted on before it has been answered. ``counts`` says how many samples were served,
adapted on, dropped from adaptation, are in the running pass and are waiting.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..estimator import GradientEstimate
from ..policy import AdaptationPass, Policy
from .inference_stats import RequestTimes
from .snapshots import SnapshotStore

log = logging.getLogger("eva0_edge.serve")


@dataclass
class _Job:
    x: np.ndarray
    future: Future
    times: RequestTimes | None = None  # filled with its queue and step times before it is answered
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class _Control:
    operation: Callable[[Any], Any]
    future: Future


_STOP = object()
_WAKE = object()  # an announced request was withdrawn: look again whether to wait
_PASS_DONE = object()  # the running pass's ORT call and estimate are done (or failed)

# Where SCHED_IDLE is missing or refused: the pass thread's nice value, the lowest priority.
PASS_NICE = 19


def _lower_priority(thread_ids: list[int]) -> None:
    """Let the calling thread (the pass's) run only on CPU nothing else wants: Linux's
    SCHED_IDLE policy (any other runnable thread preempts it at once), else nice 19; set per
    thread, its id appended to ``thread_ids``. Where neither is allowed the thread keeps its
    priority."""
    thread = threading.get_native_id()
    thread_ids.append(thread)
    try:
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError) as err:
        log.debug("adaptation pass thread: no SCHED_IDLE (%s), nice %d", err, PASS_NICE)
    try:
        os.setpriority(os.PRIO_PROCESS, thread, PASS_NICE)
    except (AttributeError, OSError) as err:
        log.debug("adaptation pass thread keeps its priority: %s", err)


def _lift_priority(thread: int) -> None:
    """Give the pass thread ``thread`` (a native id) the normal policy again, at the stop: a
    process exits only once each of its threads has run again, and a SCHED_IDLE thread on a
    busy host, in a pass or waiting for one, may not run for seconds (two CPU-bound processes
    beside the server: 4.9-7.3 s from SIGTERM to exit, four: 8.5-12.8 s; lifted: 0.2-0.3 s,
    ``results/serve-shutdown/``). Needs CAP_SYS_NICE (root keeps it, a container may drop it);
    where it is refused the exit waits as long as the host starves the thread."""
    try:
        os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError) as err:
        log.info("stop: the adaptation pass thread keeps its low priority (%s); the exit waits "
                 "for it to run", err)


@dataclass
class _Pass:
    """The running adaptation pass: what it began on and the future of its estimate (after its
    ORT call)."""

    adaptation: AdaptationPass
    estimate: Future


@dataclass
class StepRecord:
    """What one adaptation step did: rows, requests, and seconds spent in ``step``."""

    rows: int
    requests: int
    seconds: float
    skipped: bool


class AdaptationWorker:
    """Owns the model; ``submit`` a checked batch, get a Future of its logits [B, K]."""

    def __init__(
        self,
        model: Policy,
        max_batch: int,
        max_delay_s: float,
        snapshots: SnapshotStore | None = None,
        snapshot_every: int = 100,
        on_step: Callable[[StepRecord], None] | None = None,
        adaptive_delay: bool = True,
        asynchronous: bool = False,
    ) -> None:
        if max_batch < 1 or max_delay_s < 0 or snapshot_every < 1:
            raise ValueError("need max_batch >= 1, max_delay >= 0 and snapshot_every >= 1")
        # the policy that serves and adapts apart (asynchronous mode), else None
        self._adaptive: Policy | None = None
        if asynchronous:
            model.set_asynchronous()
            self._adaptive = model
        self._pass_threads: list[int] = []  # the pass thread's native id, once it runs
        apart = self._adaptive is not None and model.session.concurrent_calls
        # a pass's ORT call on idle CPU, its estimate at the worker's priority (see above)
        self._runs = ThreadPoolExecutor(1, "eva0-pass", initializer=_lower_priority,
                                        initargs=(self._pass_threads,)) if apart else None
        self._estimates = ThreadPoolExecutor(1, "eva0-estimate") if apart else None
        self._pass: _Pass | None = None
        self._recent: list[np.ndarray] = []
        self._recent_rows = 0  # rows in _recent, kept as they come and go (read per request)
        self._counts = {"served_samples": 0, "adapted_samples": 0, "dropped_samples": 0}
        self.executions = 0  # batches the model ran to answer requests
        self.abandoned_pass = False  # a pass was still running when the worker stopped
        self.model = model
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.snapshots = snapshots
        self.snapshot_every = snapshot_every
        self.on_step = on_step
        self.adaptive_delay = adaptive_delay
        self._announced = 0
        self._announced_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._held: Any = None
        self._thread = threading.Thread(target=self._run, name="eva0-adapt", daemon=True)
        self._snapshot_step: int | None = None  # the state's step at the last snapshot

    def start(self) -> None:
        if self.snapshots is not None and self.model.spec.keeps_state:
            self._snapshot_step = self.model.state.step  # a restored state counts on from here
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is queued, write a final snapshot, and end the thread. A pass whose
        ORT call has not finished is abandoned (its rows dropped), not waited for: on a loaded
        host its thread may get no CPU for tens of seconds (``abandoned_pass``)."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def announce(self) -> None:
        """A request arrived and will be ``submit``ted (``announced=True``) or ``withdraw``n."""
        with self._announced_lock:
            self._announced += 1

    def withdraw(self) -> None:
        """An announced request will not be submitted (bad input, timeout, ...)."""
        with self._announced_lock:
            self._announced -= 1
            last = self._announced == 0
        if last:
            self._queue.put(_WAKE)

    def submit(self, x: np.ndarray, announced: bool = False,
               times: RequestTimes | None = None) -> Future:
        """Queue a batch already checked by ``model.session.check_input``; ``times`` gets its
        ``queue`` and ``compute_infer`` seconds before the future is answered."""
        future: Future = Future()
        if announced:
            with self._announced_lock:
                self._announced -= 1
        self._queue.put(_Job(x, future, times))
        return future

    def call(self, operation: Callable[[Any], Any]) -> Future:
        """Run ``operation(model)`` on the worker thread, between steps."""
        future: Future = Future()
        self._queue.put(_Control(operation, future))
        return future

    def snapshot_now(self) -> bool | None:
        """Write a snapshot (worker thread only; a failure is logged, serving goes on).
        True when written, False when writing failed, None without a state directory."""
        if self.snapshots is None or not self.model.spec.keeps_state:
            return None
        self._learn_waiting()
        self._snapshot_step = self.model.state.step
        try:
            path = self.snapshots.save(self.model)
        except OSError as err:
            log.error("snapshot failed, will retry at the next interval: %s", err)
            return False
        log.debug("snapshot %s at step %d", path.name, self.model.health().step)
        return True

    def counts(self) -> dict[str, int]:
        """Samples served, adapted on, dropped from adaptation, in the running pass and waiting
        for the next (asynchronous mode; the synchronous step adapts on what it serves, as
        its budget allows)."""
        running = 0 if self._pass is None else self._pass.adaptation.rows
        return {**self._counts, "adapting_samples": running,
                "waiting_samples": self._waiting_rows()}

    def _waiting_rows(self) -> int:
        return self._recent_rows

    # ------------------------------------------------------------------ thread
    def _next(self, timeout: float | None = None) -> Any:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        return self._queue.get(timeout=timeout)

    def _run(self) -> None:
        while True:
            try:  # with a pass's rows waiting and none running, an empty queue means adapt now
                ready = self._pass is None and self._waiting_rows() >= self.max_batch
                item = self._next(timeout=0 if ready else None)
            except queue.Empty:
                self._adapt_recent()
                continue
            if item is _WAKE:
                continue
            if item is _PASS_DONE:
                self._finish_pass()
                continue
            if item is _STOP:
                break
            if isinstance(item, _Control):
                self._control(item)
                continue
            self._batch(item)
        self._learn_waiting()
        if self._pass is not None and self._pass.estimate.done():  # its update is kept
            self._finish_pass()
        elif self._pass is not None:  # starved (its thread runs on idle CPU only): abandoned
            rows, self._pass = self._pass.adaptation.rows, None
            self._counts["dropped_samples"] += rows
            self.abandoned_pass = True
            log.info("stop: the running adaptation pass (%d samples) is abandoned", rows)
        for thread in self._pass_threads:
            _lift_priority(thread)
        for executor in (self._runs, self._estimates):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        self.snapshot_now()  # the state of the last applied step

    def _control(self, item: _Control) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            self._learn_waiting()
            item.future.set_result(item.operation(self.model))
        except Exception as err:  # noqa: BLE001 - handed to the caller
            item.future.set_exception(err)

    def _nobody_coming(self) -> bool:
        """Adaptive delay: nothing queued and no announced request still on its way."""
        if not self.adaptive_delay or self._held is not None or not self._queue.empty():
            return False
        with self._announced_lock:
            return self._announced <= 0

    def _batch(self, first: _Job) -> None:
        jobs, rows = [first], first.x.shape[0]
        deadline = first.enqueued + self.max_delay_s
        while rows < self.max_batch:
            if self._nobody_coming():
                break
            try:
                item = self._next(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is _WAKE:
                continue
            if not isinstance(item, _Job) or rows + item.x.shape[0] > self.max_batch:
                self._held = item
                break
            jobs.append(item)
            rows += item.x.shape[0]
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not jobs:
            return
        x = jobs[0].x if len(jobs) == 1 else np.concatenate([job.x for job in jobs])
        began = time.monotonic()
        start = time.perf_counter()
        try:
            if self._adaptive is not None:
                logits = self._adaptive.serve_step(x)
            else:
                logits = self.model.step(x)
        except Exception as err:  # noqa: BLE001 - every waiting request gets the error
            for job in jobs:
                job.future.set_exception(err)
            return
        seconds = time.perf_counter() - start
        self.executions += 1
        offset = 0
        for job in jobs:
            n = job.x.shape[0]
            if job.times is not None:
                job.times.queue, job.times.compute_infer = began - job.enqueued, seconds
            job.future.set_result(logits[offset : offset + n])
            offset += n
        if self._adaptive is not None:
            self._remember(x)
        self._count_step()
        if self.on_step is not None:
            try:
                self.on_step(StepRecord(rows, len(jobs), seconds, self.model.last.skipped))
            except Exception:  # noqa: BLE001 - metrics must never stop the worker
                log.exception("step callback failed")

    def _learn_waiting(self) -> None:
        """Learn from the served batches the policy holds for its next block (asynchronous
        mode), so that what reads or writes the state next sees them; a failure is logged."""
        if self._adaptive is None:
            return
        try:
            self._adaptive.learn()
        except Exception:  # noqa: BLE001 - the answers went out; serving goes on
            log.exception("learning from the served samples failed")

    def _remember(self, x: np.ndarray) -> None:
        """Keep the answered rows x for adaptation: the last ``max_batch`` rows at most."""
        self._counts["served_samples"] += x.shape[0]
        self._recent.append(x)
        self._recent_rows += x.shape[0]
        while self._recent_rows > self.max_batch:
            excess = self._recent_rows - self.max_batch
            oldest = self._recent[0]
            if oldest.shape[0] <= excess:
                self._recent.pop(0)
                dropped = oldest.shape[0]
            else:
                self._recent[0] = oldest[excess:]
                dropped = excess
            self._counts["dropped_samples"] += dropped
            self._recent_rows -= dropped

    def _adapt_recent(self) -> None:
        """Begin the adaptation pass on the recent (answered) rows, its ORT call on the pass
        thread and its estimate on the estimate thread (or both here, without them); the rows
        are dropped when the budget or a pause says not now."""
        batch, self._recent, self._recent_rows = self._recent, [], 0
        x = batch[0] if len(batch) == 1 else np.concatenate(batch)
        model = self._adaptive
        assert model is not None  # only asynchronous mode keeps recent rows
        try:
            adaptation = model.begin_pass(x)
        except Exception:  # noqa: BLE001 - the answers went out; serving goes on
            log.exception("adaptation pass failed; its %d samples are dropped", x.shape[0])
            adaptation = None
        if adaptation is None:
            self._counts["dropped_samples"] += x.shape[0]
            return
        if self._runs is None or self._estimates is None:  # one IOBinding: here, between requests
            self._apply(adaptation, adaptation.run)
            return
        call = self._runs.submit(adaptation.call)
        estimate = self._estimates.submit(lambda: adaptation.estimate(call.result()))
        self._pass = _Pass(adaptation, estimate)
        estimate.add_done_callback(lambda _: self._queue.put(_PASS_DONE))

    def _finish_pass(self) -> None:
        """Apply the running pass, waiting for its ORT call if need be."""
        running, self._pass = self._pass, None
        if running is not None:  # None: a late wake-up of a pass finished at stop
            self._apply(running.adaptation, running.estimate.result)

    def _apply(self, adaptation: AdaptationPass, estimate: Callable[[], GradientEstimate]) -> None:
        """The pass's update from its ``estimate()`` (its ORT call and estimate, run on their
        threads or here); the policy drops a pass the state moved away from."""
        rows = adaptation.rows
        try:
            ran = adaptation.finish(estimate())
        except Exception:  # noqa: BLE001 - the answers went out; serving goes on
            log.exception("adaptation pass failed; its %d samples are dropped", rows)
            ran = False
        self._counts["adapted_samples" if ran else "dropped_samples"] += rows
        if ran:
            self._count_step()

    def _count_step(self) -> None:
        """After a batch or a pass: a snapshot once the state has taken ``snapshot_every``
        steps since the last one (steps taken, not batches served: a frozen or one-forward
        server writes its state when it stops; a reset starts the count again)."""
        if self.snapshots is None or not self.model.spec.keeps_state:
            return
        step = self.model.state.step
        if self._snapshot_step is None or step < self._snapshot_step:
            self._snapshot_step = step
        if step - self._snapshot_step >= self.snapshot_every:
            self.snapshot_now()
