"""FOA (Niu et al., ICML 2024): forward-only adaptation of input prompts with CMA-ES.

Per batch x [B, C, H, W] on a prompt model (``eva0-edge export --prompts T``):

1. K candidate prompts: ``popsize = K - 1`` samples of CMA-ES (the ``cma`` package) plus the
   previous batch's best prompt (FOA's default K = 28: population 27 + 1); below
   :data:`ELITIST_FORWARDS` (K = 2-4) a population of K without the previous best;
2. one ORT call over K*B rows (the patch embedding shared inside the graph);
3. fitness of candidate j = sum_i entropy(o_ji) + lambda * B / 64 *
   (||std_j(h) - sigma_s||^2 + ||mean_j(h) - m_s||^2) over the model's alignment features (std
   over the batch, unbiased as torch.std), the source statistics from the model file;
4. ``es.tell`` all K (candidates and their fitness); the prediction is the best candidate's
   output with FOA's activation shifting: the head's input moved by
   ``shift_step * (m_s(head input) - m_test)``, where m_test is an EMA (new weight
   ``shift_alpha``) of the test-time mean head input over the candidates.

``foa-dagger`` is FOA with lambda = 0 and no shifting: entropy only, no source statistics.

What happens to a batch is decided by the :class:`~.policy.Policy` that owns the model, as for
the EVA-0 family: with a compute budget (``budget``, forwards per sample, 1 to K) a batch the budget
does not pay for is served under the best prompt so far with one forward per sample, its head
inputs entering the shifting's EMA (:meth:`FOAModel.serve`); the others get the K-candidate
step above (:meth:`FOAModel.adapt`). FOA has no health guard: the guard's bounds are calibrated
on the drift and alignment of adapted norm parameters, and a prompt's would need their own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from .budget import BURST_SAMPLES, check_budget
from .config import replaced
from .losses import softmax_entropy
from .metadata import ModelMetadata
from .monitoring import Health, StepStats
from .registry import FOA_FORWARDS, REGISTRY, parse_method
from .session import AdaptableSession

log = logging.getLogger(__name__)

# FOA's fitness takes its feature statistics over the batch (its authors' batch is 64): on the
# shipped ViT's clean validation images it lost 10-13 points at batch 1 for every lambda_fit of
# 0.1-6.4, and stayed within 1 point from batch 4 up (models/vit_fmnist.tune-foa.json).
SMALL_BATCH = 4
# The previous best told beside the population is, to cma, an injected solution: with a
# population of 2 or 3 beside it (K = 3, 4) cma's covariance went to NaN eigenvalues (it
# asserts) within 60 batches on a 576-dimension prompt. From this K on the previous best
# competes; below, CMA-ES evaluates a population of K alone.
ELITIST_FORWARDS = 5
# Small populations also need cma's mirrored samples drawn without its injection mechanism
# (mirror method 0): with the default a population of 2 raised "Found unused injected
# direction/solutions" within a few batches.
SMALL_POPULATION_OPTIONS = {"CMA_mirrormethod": 0}


@dataclass(frozen=True)
class FOAConfig:
    """FOA's hyper-parameters (the FOA paper's ViT-Base values; a model file's ``tuned`` values
    for the method override them, the caller's ``config`` overrides both).

    forwards: K forward passes per sample (CMA-ES population K - 1 + previous best; K < 5:
    population K).
    lambda_fit: weight of the feature-statistics term of the fitness. shift: activation
    shifting on/off; shift_step: its step size; shift_alpha: EMA weight of the new batch in the
    test-time head-input mean. sigma0: CMA-ES initial step size (the search starts at 0).
    budget: average forwards per sample (1 <= budget <= forwards; None: the K-candidate step on
    every batch), see :mod:`.budget`; budget_burst: the samples whose credit its bucket holds.
    """

    forwards: int = FOA_FORWARDS
    lambda_fit: float = 0.4
    shift: bool = True
    shift_step: float = 1.0
    shift_alpha: float = 0.1
    sigma0: float = 1.0
    budget: float | None = None
    budget_burst: int = BURST_SAMPLES

    def updated(self, values: dict[str, Any]) -> FOAConfig:
        """A copy with ``values`` applied; ValueError naming any unknown key."""
        return replaced(self, values)


FOA_METHODS: dict[str, dict[str, Any]] = {
    name: spec.overrides for name, spec in REGISTRY.items() if spec.kind == "foa"
}


class FOAModel:
    """FOA or FOA-dagger over a prompt model: the batch interface of :class:`Engine`
    (``predict``, ``serve``, ``adapt``, ``reset``, ``stats``), its batches decided by the
    :class:`~.policy.Policy` that owns it (the compute budget; no guard, no kept state). The
    search (the CMA-ES object, the best prompt, the shifting's EMA) lives here.

    >>> model = FOAModel(AdaptableSession("vit_prompt.onnx"), "foa", seed=0)
    >>> logits, _, _ = model.adapt(model.session.check_input(x))  # [B, K]; K forwards/sample
    """

    def __init__(
        self,
        session: AdaptableSession,
        method: str = "foa",
        config: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        base, fp = parse_method(method)
        if base not in FOA_METHODS:
            raise ValueError(f"unknown FOA method {method!r}; known: {sorted(FOA_METHODS)}")
        metadata: ModelMetadata = session.metadata
        if not metadata.is_prompt_model:
            raise ValueError(
                f"{base} evolves input prompts: export the ViT with `eva0-edge export "
                "--prompts T` (this file adapts norm parameters)"
            )
        self.session = session
        self.metadata = metadata
        self.name = base
        self.config = FOAConfig().updated(
            {**FOA_METHODS[base], **metadata.tuned.get(base, {}), **fp, **(config or {})}
        )
        if self.config.forwards < 2:
            raise ValueError(f"{base}: #FP (forwards) must be >= 2, got {self.config.forwards}")
        check_budget(base, self.config.budget, self.config.forwards,
                     self.config.budget_burst)
        self.spec = REGISTRY[base]
        self.shift = None  # FOA's activation shifting is its own EMA (head_shift), no window
        needs_source = self.config.lambda_fit > 0 or self.config.shift
        if needs_source and not metadata.has_source_stats:
            raise ValueError(
                f"{base} needs the model's source statistics (run `eva0-edge calibrate`); "
                "foa-dagger needs none"
            )
        if metadata.has_source_stats:
            self._source_mean = metadata.arrays["source_mean"].astype(np.float64)
            self._source_std = metadata.arrays["source_std"].astype(np.float64)
            head = next(s for s in metadata.feature_layout if s.name == "head_input")
            self.head_features = slice(head.offset, head.offset + head.size)
        self.seed = int(seed)
        self.warned_small_batch = False  # warn once per model, not per reset
        self.reset()

    @property
    def method(self) -> str:
        return self.name

    @property
    def elitist(self) -> bool:
        """Whether the previous best is the K-th candidate (K >= :data:`ELITIST_FORWARDS`)."""
        return self.config.forwards >= ELITIST_FORWARDS

    @property
    def popsize(self) -> int:
        """CMA-ES population per batch: K - 1 beside the previous best, else K."""
        return self.config.forwards - 1 if self.elitist else self.config.forwards

    def reset(self) -> None:
        """Back to the initial prompt, a fresh CMA-ES and no test-time statistics."""
        import cma

        dim = self.metadata.num_params
        # cma samples from numpy's global generator unless given its own ``randn``: two models
        # in one process would then draw each other's candidates
        rng = np.random.default_rng(self.seed)
        self.es = cma.CMAEvolutionStrategy(  # cma reads seed 0 as "random": offset by 1
            np.zeros(dim), self.config.sigma0,
            inopts={"seed": self.seed + 1, "popsize": self.popsize, "maxiter": np.inf,
                    "verbose": -9, "randn": lambda *shape: rng.standard_normal(shape),
                    **({} if self.elitist else SMALL_POPULATION_OPTIONS)},
        )
        self.best_prompt = self.metadata.theta0.astype(np.float64)
        self.best_fitness = float("nan")
        self.test_mean: np.ndarray | None = None
        self.steps = 0
        self.frozen = False
        self.last = StepStats()

    def freeze(self, frozen: bool = True) -> None:
        """Predict with the best prompt so far and stop searching (``frozen``), or resume."""
        self.frozen = bool(frozen)

    def health(self) -> Health:
        """The counters a server exports; FOA has no guard and clips nothing."""
        return Health(self.steps, self._drift(), 0, 0, not self.frozen)

    def _drift(self) -> float:
        return float(np.linalg.norm(self.best_prompt - self.metadata.theta0))

    def stats(self) -> dict[str, Any]:
        counter = self.session.counter
        return {
            "method": self.name,
            "steps": self.steps,
            "skipped_steps": 0,
            "samples": counter.samples,
            "forwards": counter.forwards,
            "forwards_per_sample": counter.per_sample,
            "drift": self._drift(),
            "best_fitness": self.best_fitness,
            "mean_entropy": self.last.entropy,
            "mean_logit_norm": self.last.logit_norm,
            "frozen": self.frozen,
        }

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Logits [B, K] under the best prompt so far (shifted as the last step would), one
        forward per sample, no adaptation."""
        return self._run_best(self.session.check_input(x))[0]

    def serve(self, x: np.ndarray) -> tuple[np.ndarray, bool]:
        """A batch the policy serves without the search (the compute budget said wait):
        :meth:`predict` on the checked batch x [B, C, H, W], its head inputs then entering the
        shifting's EMA as a step's candidates do. Returns the logits [B, K] and False (no
        change detector of its own)."""
        logits, features = self._run_best(x)
        self._observe_head_inputs(features[None].astype(np.float64))
        return logits, False

    def _run_best(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shifted logits [B, K] (owned) and the features [B, F] under the best prompt."""
        prompts = np.broadcast_to(self.best_prompt, (x.shape[0], self.best_prompt.size))
        _, features, shifted = self.session.run_shifted(x, prompts, self.head_shift())
        self.session.counter.samples += x.shape[0]
        self.last = StepStats.of(shifted)
        return self.session.owned(shifted), features

    def adapt(self, x: np.ndarray) -> tuple[np.ndarray, bool, np.ndarray]:
        """Evaluate K candidate prompts on the checked batch x, update CMA-ES; the best
        candidate's (activation-shifted) logits [B, K] are served. Returns them, False (no
        change detector) and them again (the prediction)."""
        batch = x.shape[0]
        if batch < SMALL_BATCH and not self.warned_small_batch:
            self.warned_small_batch = True
            log.warning("%s adapts on batch statistics: on batches of fewer than %d images it "
                        "lost 10-13 points on clean images (shipped ViT, batch 1); form larger "
                        "batches (serve --max-delay-ms) or use eva0", self.method, SMALL_BATCH)
        candidates = [np.asarray(c, dtype=np.float64) for c in self.es.ask()]
        if self.elitist:
            candidates.append(self.best_prompt)
        rows = np.repeat(np.stack(candidates).astype(np.float32), batch, axis=0)
        logits, features, shifted = self.session.run_shifted(x, rows, self.head_shift())
        self.session.counter.samples += batch
        count = len(candidates)
        logits = logits.reshape(count, batch, -1).astype(np.float64)
        features = features.reshape(count, batch, -1).astype(np.float64)
        fitness = self.fitness(logits, features)
        self.es.tell(candidates, fitness.tolist())
        best = int(np.argmin(fitness))
        self.best_prompt, self.best_fitness = candidates[best], float(fitness[best])
        self._observe_head_inputs(features)
        self.steps += 1
        prediction = self.session.owned(shifted.reshape(count, batch, -1)[best])
        self.last = StepStats.of(prediction)
        return prediction, False, prediction

    def _observe_head_inputs(self, features: np.ndarray) -> None:
        """The shifting's EMA takes the mean head input of ``features`` [candidates, B, F]."""
        if not self.config.shift:
            return
        batch_mean = features[:, :, self.head_features].mean(axis=(0, 1))
        a = self.config.shift_alpha
        self.test_mean = (
            batch_mean if self.test_mean is None else (1 - a) * self.test_mean + a * batch_mean
        )

    def fitness(self, logits: np.ndarray, features: np.ndarray) -> np.ndarray:
        """FOA's fitness per candidate. logits [K, B, classes], features [K, B, F] -> [K]."""
        entropy = np.stack([softmax_entropy(o).sum() for o in logits])
        if self.config.lambda_fit == 0:
            return entropy
        batch = logits.shape[1]
        mean = features.mean(axis=1)
        std = features.std(axis=1, ddof=1 if batch > 1 else 0)
        discrepancy = ((std - self._source_std) ** 2).sum(axis=1) + (
            (mean - self._source_mean) ** 2
        ).sum(axis=1)
        return entropy + self.config.lambda_fit * discrepancy * batch / 64.0

    def head_shift(self) -> np.ndarray:
        """The activation shift added to the head input [D] (FOA: ``shift_step`` x (source mean -
        EMA test mean) of the head-input features); zero until a batch has been seen, or with
        shifting off. ``head_features`` is the slice of the feature vector it applies to."""
        width = self.metadata.feature_layout[-1].size
        if not self.config.shift or self.test_mean is None:
            return np.zeros(width, dtype=np.float32)
        shift = self.config.shift_step * (self._source_mean[self.head_features] - self.test_mean)
        return shift.astype(np.float32)
