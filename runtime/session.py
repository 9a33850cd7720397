"""An ONNX Runtime session over an adaptable model file, with input checks and a forward count."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError

from .arrays import cupy_or_none, namespace
from .iobinding import BoundRunner
from .metadata import ModelFormatError, ModelMetadata
from .split import split_files

log = logging.getLogger(__name__)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}

# Normalised pixels may exceed the [0, 1] image range by this much (in std units) before the
# input is refused as "not preprocessed" (raw 0..255 pixels land far outside).
RANGE_TOLERANCE = 1.0

# A checked batch of at least this many values stays on the device (its check, the input
# descriptors and a served forward run there); a smaller one is checked, described and served
# from the host. On an H200 the host's served batch under a budget cost 1.01-1.08x NoAdapt at
# batch 1 and 1.15-1.20x at batch 8 (224 x 224: 150k and 1.2M values) against the device's
# 1.30-1.47x and 1.30-1.43x, the device's 1.10-1.17x against 1.25-1.41x at batch 32 (4.8M)
# (results/h200-2026-12-04/final/budget-*): the crossover lies between, 2^21 is about batch 14.
DEVICE_BATCH_VALUES = 2**21


class InputError(ValueError):
    """The input batch has the wrong shape, dtype or value range; nothing was run or changed."""


def resolve_providers(provider: str = "auto") -> list[str]:
    """ORT providers for 'cpu', 'cuda' or 'auto' (CUDA when onnxruntime-gpu sees a GPU)."""
    available = ort.get_available_providers()
    if provider == "auto":
        provider = "cuda" if PROVIDERS["cuda"] in available else "cpu"
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}: use cpu, cuda or auto")
    if PROVIDERS[provider] not in available:
        raise ValueError(
            f"provider {provider!r} is not available in this onnxruntime build "
            f"(available: {available}); install eva0-edge[gpu] for CUDA"
        )
    if provider == "cuda" and hasattr(ort, "preload_dlls"):
        # CUDA and cuDNN from the nvidia-* wheels when they are not on the loader path
        ort.preload_dlls()
    return [PROVIDERS[provider]] + ([PROVIDERS["cpu"]] if provider != "cpu" else [])


def session_options(
    threads: int | None = None, profile_prefix: str | None = None
) -> ort.SessionOptions:
    """Options chosen by measurement: no memory-pattern planning (it cut peak RSS 25-44% with no
    slowdown, because batch rows vary), full graph optimisation, spinning left on during a call
    (turning it off made ORT effectively single-threaded) and stopped when the call returns
    (``session.force_spinning_stop``): otherwise a session's intra-op threads keep spinning
    after its call and steal the cores from the next session's, the split file's suffix after
    its prefix (PTQ4ViT W8A8 ViT-B, B = 1, 2 cores, one process per run, 3 rounds: 121 ms with
    the spin left running, 76 ms with it stopped, 72 ms unsplit; FP32 253 / 194 / 182 ms;
    EVA-0 at B = 8 within the noise for FP32 and 8-14% faster on W8A8).
    ``profile_prefix``: ORT's profiler on, its JSON trace written under that path prefix
    (``session.end_profiling()`` names the file)."""
    options = ort.SessionOptions()
    options.enable_mem_pattern = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


# The GPU arena grows by what a call asks for, not to the next power of two (ORT's default), so
# the peak GPU memory is near what the step needs (measured on an H100: see README, On a GPU).
ARENA_SAME_AS_REQUESTED = 1
CUDA_PROVIDER_OPTIONS = {"arena_extend_strategy": "kSameAsRequested"}


def shared_arena(options: ort.SessionOptions, device: str) -> None:
    """Make the sessions opened with ``options`` draw from one process-wide arena on ``device``
    ('cpu' or 'cuda'; created on first use), so the prefix's activations and the suffix's reuse
    the same memory."""
    if device not in _ARENAS:
        if device == "cpu":
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                     ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        else:
            info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                     ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator_v2(
                PROVIDERS["cuda"], info, CUDA_PROVIDER_OPTIONS,
                ort.OrtArenaCfg({"arena_extend_strategy": ARENA_SAME_AS_REQUESTED}),
            )
        _ARENAS.add(device)
    options.add_session_config_entry("session.use_env_allocators", "1")


_ARENAS: set[str] = set()


def open_session(
    path: str | os.PathLike, options: ort.SessionOptions, providers: list[str]
) -> ort.InferenceSession:
    """An ORT session on ``path``; FileNotFoundError or ModelFormatError naming the file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        entries = [(p, CUDA_PROVIDER_OPTIONS) if p == PROVIDERS["cuda"] else p for p in providers]
        return ort.InferenceSession(str(path), options, providers=entries)
    except (ort.capi.onnxruntime_pybind11_state.InvalidProtobuf,
            ort.capi.onnxruntime_pybind11_state.InvalidGraph,
            ort.capi.onnxruntime_pybind11_state.Fail) as err:
        raise ModelFormatError(f"{path} is not a loadable ONNX model: {err}") from err


@dataclass
class ForwardCounter:
    """Forward passes counted per sample: one theta row run on one image is one forward.
    ``ort_seconds``: wall time spent in the session's ORT calls (input packing included).
    ORT calls may come from two threads (the asynchronous server's adaptation pass runs beside
    serving), so they are recorded under a lock."""

    forwards: int = 0
    samples: int = 0
    ort_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, rows: int, seconds: float) -> None:
        """One ORT call over ``rows`` theta rows that took ``seconds``."""
        with self._lock:
            self.forwards += rows
            self.ort_seconds += seconds

    @property
    def per_sample(self) -> float:
        return self.forwards / self.samples if self.samples else 0.0


@dataclass(frozen=True)
class SessionSettings:
    """How ONNX Runtime runs an adaptable file, as one value: built once from the command line
    (:func:`~eva0_edge.runtime.cli.session_settings`) or in code, and passed whole to
    :func:`~eva0_edge.runtime.methods.load_method`, the fleet's replicas and the testbed.
    ``provider``: "auto", "cpu" or "cuda"; ``threads``: ORT's intra-op threads (None: ORT's
    default, one per core); ``low_memory``, ``io_binding``, ``split``, ``memory_budget_mb``,
    ``device_step``: see :class:`AdaptableSession`."""

    provider: str = "auto"
    threads: int | None = None
    low_memory: bool = False
    io_binding: bool | None = None
    split: bool | None = None
    memory_budget_mb: float | None = None
    device_step: bool | None = None

    def keywords(self) -> dict[str, object]:
        """The settings as :class:`AdaptableSession`'s keyword arguments."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


class AdaptableSession:
    """Runs ``pixel_values`` [N, C, H, W] under ``theta`` [r*N, P] and returns
    (logits [r*N, K], features [r*N, F]). All arrays float32.

    On a prompt model (``metadata.adapted_input == "prompt"``) the theta rows are the flattened
    prompts: they are fed as ``prompt`` [r*N, T, D], with a zero ``head_shift`` unless
    :meth:`run_shifted` gives one.

    ``low_memory``: run the r theta copies as r ORT calls of N rows instead of one call of r*N
    rows. Peak activation memory is then that of plain inference, at the cost of computing the
    shared prefix r times instead of once.

    ``split``: cut the file into its shared prefix and adapted suffix (:mod:`.split`) and run
    them as two sessions (default None: split unless ``low_memory`` or ``profile_prefix`` asks
    for the one-file session, falling back to it with a warning when the parts cannot be
    written): the prefix once on the N images, the suffix on the theta copies in calls of at
    most ``memory_budget_mb`` worth of rows (estimated per row from the suffix's largest
    activation; at least N rows a call, the rows plain inference runs; default
    ``DEFAULT_BUDGET_MB``, 16 MiB: a small model runs its copies in one call, a large one in
    calls of N rows, so the peak stays near that of inference, on the host or on the GPU).
    The results equal the one-call graph's.

    ``profile_prefix``: ONNX Runtime's profiler on (see :func:`session_options`).

    ``io_binding``: run through :class:`BoundRunner` (outputs written into buffers reused from
    call to call; on CUDA the inputs go to reused device buffers and split sessions' prefix
    activations stay on the device; default None: on CUDA only). The arrays :meth:`run`
    returns are then overwritten by the next call with the same row count: :meth:`owned`
    copies what a caller hands on.

    ``device_step``: keep a batch and a step's arrays on the CUDA device (CuPy, the ``[gpu]``
    extra; :mod:`.device_step`): the engine's step draws, builds, runs and reduces its rows
    there (:meth:`run_device`); a batch of at least :data:`DEVICE_BATCH_VALUES` values is
    checked there by a reduction and stays there for every call on it (:meth:`resident`: the
    step, the input descriptors, a served forward whose theta crosses once, not per row).
    Default None: on a CUDA session through IOBinding of a ``theta`` file when CuPy sees the
    device; True where that cannot be is refused."""

    def __init__(
        self,
        path: str | os.PathLike,
        metadata: ModelMetadata | None = None,
        provider: str = "auto",
        threads: int | None = None,
        low_memory: bool = False,
        io_binding: bool | None = None,
        profile_prefix: str | None = None,
        split: bool | None = None,
        memory_budget_mb: float | None = None,
        device_step: bool | None = None,
    ) -> None:
        one_file = low_memory or profile_prefix is not None
        if split and one_file:
            raise ValueError("split sessions are not combined with low_memory or profiling")
        if memory_budget_mb is not None and (split is False or one_file or memory_budget_mb <= 0):
            raise ValueError("memory_budget_mb needs split sessions and a positive size")
        self.path = Path(path)
        self.low_memory = low_memory
        self.threads = threads
        self.providers = resolve_providers(provider)
        self.device = "cuda" if self.providers[0] == PROVIDERS["cuda"] else "cpu"
        options = session_options(threads, profile_prefix)
        self.parts: SplitSessions | None = None
        if split is None:
            if not one_file:
                self.parts = SplitSessions.or_none(path, options, self.providers,
                                                   memory_budget_mb)
        elif split:
            self.parts = SplitSessions(path, options, self.providers, memory_budget_mb)
        if self.parts is not None:
            self.session = self.parts.suffix
        else:
            self.session = open_session(path, options, self.providers)
        if metadata is None:  # from ORT's parse: the file is read once
            metadata = ModelMetadata.from_props(self.session.get_modelmeta().custom_metadata_map)
        self.metadata = metadata
        if self.session.get_providers()[0] != self.providers[0]:
            raise RuntimeError(
                f"onnxruntime could not start {self.providers[0]} for {path} (it fell back to "
                f"{self.session.get_providers()}); check the CUDA and cuDNN libraries"
            )
        self.io_binding = self.device == "cuda" if io_binding is None else io_binding
        self.binder = None
        if self.io_binding and self.parts is not None:
            self.parts.bind(self.device)
        elif self.io_binding:
            self.binder = BoundRunner(self.session, self.device)
        sessions = [self.session] if self.parts is None else [self.parts.prefix, self.parts.suffix]
        names = {i.name for session in sessions for i in session.get_inputs()}
        self.adapted_input = metadata.adapted_input
        needed = {"pixel_values", self.adapted_input}
        if metadata.is_prompt_model:
            needed.add("head_shift")
            self._prompt_shape = tuple(metadata.theta_layout[0].shape)
        if not needed <= names:
            raise ValueError(
                f"{path} lacks the {sorted(needed)} inputs its metadata promises "
                f"(graph inputs: {sorted(names)})"
            )
        pre = metadata.preprocessing
        mean, std = np.asarray(pre.mean), np.asarray(pre.std)
        self._low = float(np.min((0.0 - mean) / std)) - RANGE_TOLERANCE
        self._high = float(np.max((1.0 - mean) / std)) + RANGE_TOLERANCE
        self.counter = ForwardCounter()
        self.cupy = self._device_arrays(device_step)
        self._resident: tuple[np.ndarray, Any] | None = None  # (checked batch, its copy)
        self._theta_row: tuple[np.ndarray, Any] | None = None  # (served theta, its copy)

    def _device_arrays(self, asked: bool | None) -> ModuleType | None:
        """CuPy when the device step runs (see the class), else None."""
        if asked is False:
            return None
        why = ("it needs the CUDA provider" if self.device != "cuda" else
               "it needs IOBinding" if not self.io_binding else
               "it adapts theta files only (this one adapts prompts)"
               if self.metadata.is_prompt_model else None)
        cupy = None if why else cupy_or_none()
        if cupy is None and why is None:
            why = "CuPy cannot use the CUDA device (install eva0-edge[gpu])"
        if why and asked:
            raise ValueError(f"device_step: {why}")
        return cupy

    @property
    def device_step(self) -> bool:
        """Whether batches and steps stay on the CUDA device (see the class)."""
        return self.cupy is not None

    def resident(self, x: np.ndarray) -> Any:
        """The device copy of ``x`` when ``x`` is the batch :meth:`check_input` returned last
        (the same object), else None."""
        kept = self._resident
        return kept[1] if kept is not None and kept[0] is x else None

    def check_input(self, x: np.ndarray) -> np.ndarray:
        """Validate a batch of normalised pixels; return it as contiguous float32.

        Raises InputError for a non-array, a non-float dtype, a shape other than
        [N, C, H, W] with the model's (C, H, W), N = 0, non-finite values, or values outside the
        range normalisation can produce (e.g. raw 0..255 pixels).
        """
        if not isinstance(x, np.ndarray):
            raise InputError(f"pixel_values must be a numpy array, got {type(x).__name__}")
        if not np.issubdtype(x.dtype, np.floating):
            raise InputError(
                f"pixel_values must be floating point (normalised), got {x.dtype}; "
                "preprocess raw images first (eva0_edge.runtime.preprocess)"
            )
        expected = tuple(self.metadata.preprocessing.input_size)
        if x.ndim != 4 or tuple(x.shape[1:]) != expected:
            raise InputError(
                f"pixel_values must have shape [N, {', '.join(map(str, expected))}], "
                f"got {list(x.shape)}"
            )
        if x.shape[0] == 0:
            raise InputError("pixel_values is an empty batch")
        x = np.ascontiguousarray(x, dtype=np.float32)
        device = None
        if self.cupy is not None and x.size >= DEVICE_BATCH_VALUES:  # one copy, reduced there
            device = self.cupy.asarray(x)
            low, high = (float(v) for v in self.cupy.stack([device.min(), device.max()]).get())
        else:
            low, high = float(x.min()), float(x.max())
        # a NaN or inf anywhere shows in these two
        if not (np.isfinite(low) and np.isfinite(high)):
            raise InputError("pixel_values contains NaN or infinite values")
        if low < self._low or high > self._high:
            raise InputError(
                f"pixel_values range [{low:.3g}, {high:.3g}] is outside what the model's "
                f"normalisation yields [{self._low:.3g}, {self._high:.3g}]; were the images "
                "scaled to [0, 1] and normalised with the metadata's mean/std?"
            )
        if device is not None:
            self._resident = (x, device)
        return x

    def single_threaded(self) -> AdaptableSession:
        """A session on the same file whose ORT calls run on the calling thread alone (intra-op
        threads 1), sharing this one's forward counter: this session when it is one already
        (``threads=1``) or runs on CUDA, else a sibling opened now (the same split, row budget
        and ``low_memory``; its weights are a second copy in memory).

        The asynchronous server's adaptation pass runs on it: its thread runs at the lowest
        priority, and a call on a multi-threaded session would also run on that session's
        intra-op threads, at normal priority, beside the answers (shipped ResNet-GN, 2 cores,
        ORT's default threads, one perf_analyzer client: ``--async-adapt --budget 1.5`` served
        0.83x NoAdapt's images/s at 2.35x its p99 with the shared session)."""
        if self.threads == 1 or self.device != "cpu":
            return self
        sibling = AdaptableSession(
            self.path, self.metadata, "cpu", threads=1, low_memory=self.low_memory,
            io_binding=self.io_binding, split=self.parts is not None,
            memory_budget_mb=None if self.parts is None else self.parts.memory_budget_mb,
            device_step=False,
        )
        sibling.counter = self.counter
        return sibling

    @property
    def concurrent_calls(self) -> bool:
        """Whether two threads may run this session's ORT calls at once: ORT sessions allow
        it; IOBinding's one binding and reused output buffers (:class:`BoundRunner`) do not."""
        return not self.io_binding

    def owned(self, array: np.ndarray) -> np.ndarray:
        """``array`` itself, or a copy when it may be an output buffer the next call reuses."""
        return array.copy() if self.io_binding else array

    def run(self, x: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One ORT call. ``x`` must already be checked; theta rows must be a multiple of N."""
        if theta.strides[0] == 0 and theta.shape[0] == x.shape[0] and \
                self.resident(x) is not None:
            return self._run_served(x, theta[0])
        logits, features = self._run_copies(x, theta, ["logits", "features"], None)
        return logits, features

    def _run_served(self, x: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The device step's served call: one ``theta`` [P] for every row, copied to the
        device once (again only when it changes) and broadcast there; host outputs."""
        cupy: Any = self.cupy
        kept = self._theta_row
        if kept is None or not np.array_equal(kept[0], theta):
            kept = self._theta_row = (theta.copy(), cupy.asarray(theta, dtype=np.float32))
        rows = cupy.ascontiguousarray(cupy.broadcast_to(kept[1], (x.shape[0], theta.size)))
        logits, features = self.run_device(x, rows)
        return logits.get(), features.get()

    def run_device(self, x: np.ndarray, rows: Any) -> tuple[Any, Any]:
        """One ORT call of the device step: the checked batch ``x`` [N, ...] (its resident
        copy, or copied now) under the CuPy theta ``rows`` [r*N, P]; CuPy (logits [r*N, K],
        features [r*N, F]), buffers the next call with as many rows overwrites."""
        if self.cupy is None:
            raise RuntimeError("run_device needs the device step (device_step)")
        count, n = rows.shape[0], x.shape[0]
        if count % n:
            raise ValueError(f"theta has {count} rows, not a multiple of the batch {n}")
        start = time.perf_counter()
        pixels = self.resident(x)
        if pixels is None:
            pixels = self.cupy.asarray(x)
        names = ["logits", "features"]
        if self.parts is not None:
            results = self.parts.run(pixels, count, names, lambda a, b: {"theta": rows[a:b]},
                                     device_outputs=True)
        elif self.binder is not None:
            results = self.binder.run({"pixel_values": pixels, "theta": rows}, names, count,
                                      device_outputs=True)
        else:
            raise RuntimeError("the device step runs through IOBinding")
        self.counter.record(count, time.perf_counter() - start)
        return results[0], results[1]

    def run_shifted(
        self, x: np.ndarray, theta: np.ndarray, head_shift: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prompt models only: (logits, features, shifted_logits [r*N, K]), the last computed
        with ``head_shift`` [D] added to the classifier head's input (FOA's activation shift)."""
        if not self.metadata.is_prompt_model:
            raise ValueError("activation shifting needs a prompt model (export with --prompts)")
        shift = np.ascontiguousarray(head_shift, dtype=np.float32).reshape(1, -1)
        logits, features, shifted = self._run_copies(
            x, theta, ["logits", "features", "shifted_logits"], shift
        )
        return logits, features, shifted

    def _run_copies(
        self, x: np.ndarray, theta: np.ndarray, outputs: list[str], shift: np.ndarray | None
    ) -> list[np.ndarray]:
        rows, n = theta.shape[0], x.shape[0]
        if rows % n:
            raise ValueError(f"theta has {rows} rows, not a multiple of the batch {n}")
        start = time.perf_counter()
        theta = np.ascontiguousarray(theta, dtype=np.float32)
        if self.parts is not None:
            results = self.parts.run(
                x, rows, outputs, lambda a, b: self._adapted_feeds(theta[a:b], shift)
            )
        elif self.low_memory and rows > n:
            parts = [
                [self.owned(a) for a in self._run(x, theta[j : j + n], outputs, shift)]
                for j in range(0, rows, n)
            ]
            results = [np.concatenate([p[k] for p in parts]) for k in range(len(outputs))]
        else:
            results = self._run(x, theta, outputs, shift)
        self.counter.record(rows, time.perf_counter() - start)
        return results

    def _run(
        self, x: np.ndarray, theta: np.ndarray, outputs: list[str], shift: np.ndarray | None
    ) -> list[np.ndarray]:
        feeds = {"pixel_values": x, **self._adapted_feeds(theta, shift)}
        if self.binder is not None:
            return self.binder.run(feeds, outputs, theta.shape[0])
        return self.session.run(outputs, feeds)

    def _adapted_feeds(self, theta: np.ndarray, shift: np.ndarray | None) -> dict[str, np.ndarray]:
        """The adapted inputs for theta rows [R, P]: ``theta``, or ``prompt`` and ``head_shift``."""
        if not self.metadata.is_prompt_model:
            return {"theta": theta}
        return {
            "prompt": theta.reshape(theta.shape[0], *self._prompt_shape),
            "head_shift": shift if shift is not None
            else np.zeros((1, self._prompt_shape[1]), dtype=np.float32),
        }


DEFAULT_BUDGET_MB = 16.0


class SplitSessions:
    """The prefix and suffix sessions of a split file (:func:`.split.split_model`); the suffix
    runs ``rows_per_call`` theta rows at a time (see :class:`AdaptableSession`)."""

    def __init__(
        self, path: str | os.PathLike, options: ort.SessionOptions, providers: list[str],
        memory_budget_mb: float | None,
    ) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        try:
            parts = split_files(path)
        except (onnx.onnx_cpp2py_export.checker.ValidationError, onnx.onnx_cpp2py_export.
                shape_inference.InferenceError, DecodeError, ValueError) as err:
            raise ModelFormatError(f"{path} cannot be split into prefix and suffix: {err}") from err
        self.boundary = parts.boundary
        self.row_bytes = 4 * parts.row_elements
        self.memory_budget_mb = memory_budget_mb
        shared_arena(options, "cpu" if providers[0] == PROVIDERS["cpu"] else "cuda")
        self.prefix = open_session(parts.prefix, options, providers)
        self.suffix = open_session(parts.suffix, options, providers)
        self.binders: tuple[BoundRunner, BoundRunner] | None = None

    def bind(self, device: str) -> None:
        """Run both parts through IOBinding on ``device``; the prefix's activations stay there
        (see :class:`BoundRunner`)."""
        self.binders = (BoundRunner(self.prefix, device), BoundRunner(self.suffix, device))

    @classmethod
    def or_none(
        cls, path: str | os.PathLike, options: ort.SessionOptions, providers: list[str],
        memory_budget_mb: float | None,
    ) -> SplitSessions | None:
        """The split sessions, or None (with a warning) when the file cannot be split or its
        parts cannot be cached; a missing file still raises."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        try:
            return cls(path, options, providers, memory_budget_mb)
        except (OSError, ModelFormatError) as err:
            log.warning("running %s as one session (no split sessions): %s", path, err)
            return None

    def rows_per_call(self, n: int, rows: int) -> int:
        """Theta rows per suffix call: the most multiples of ``n`` the budget holds (at least
        ``n``: the rows of plain inference), at most ``rows``. Without a budget:
        ``DEFAULT_BUDGET_MB``, which only a small model's calls fit in (one call instead of
        several saves the per-call overhead where the activations are a few MiB)."""
        budget = DEFAULT_BUDGET_MB if self.memory_budget_mb is None else self.memory_budget_mb
        fits = int(budget * 2**20 // self.row_bytes) // n * n
        return min(rows, max(n, fits))

    def run(
        self, x: Any, rows: int, outputs: list[str],
        adapted: Callable[[int, int], Mapping[str, Any]], device_outputs: bool = False,
    ) -> list:
        """The prefix once on ``x`` [N, ...], the suffix over theta rows [a, b) in chunks
        (``adapted(a, b)``: their feeds); ``outputs`` [rows, ...]: one call's arrays (bound:
        its reused buffers), or several calls' written into fresh arrays; CuPy arrays with
        ``device_outputs`` (bound sessions only)."""
        n = x.shape[0]
        chunk = self.rows_per_call(n, rows)
        if self.binders is None:
            values = self.prefix.run(self.boundary, {"pixel_values": x})

            def suffix(feeds: dict, count: int) -> list:
                return self.suffix.run(outputs, feeds)
        else:
            prefix, bound = self.binders
            values = prefix.run({"pixel_values": x}, self.boundary, n, on_device=self.boundary)

            def suffix(feeds: dict, count: int) -> list:
                return bound.run(feeds, outputs, count, device_outputs=device_outputs)
        hidden = dict(zip(self.boundary, values, strict=True))
        if chunk >= rows:
            return suffix({**hidden, **adapted(0, rows)}, rows)
        results: list = []
        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            part = suffix({**hidden, **adapted(a, b)}, b - a)
            if not results:
                results = [namespace(p).empty((rows, *p.shape[1:]), dtype=p.dtype)
                           for p in part]
            for out, p in zip(results, part, strict=True):
                out[a:b] = p
        return results
