"""Read what a graph's intermediate tensors hold by running it: which axis of each is the batch.

ONNX shape inference cannot always tell (a Reshape to a computed shape, a contrib op); two real
ONNX Runtime runs at batch sizes 2 and 3 can. A float tensor whose axis k is 2 in the first run
and 3 in the second carries the batch on axis k; an integer tensor whose values differ between
the runs is computed from the batch size (a shape path); anything else does not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

PROBE_BATCHES = (2, 3)


@dataclass(frozen=True)
class Probe:
    """One tensor at the two probe batch sizes: shape at each and whether it is data."""

    name: str
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    is_float: bool
    batch_dependent_values: bool
    dtype: str = "float32"

    @property
    def rank(self) -> int:
        return len(self.shapes[0])

    @property
    def batch_axis(self) -> int | None:
        """The axis that grows with the batch (None: no axis does, or more than one does)."""
        first, second = self.shapes
        if len(first) != len(second):
            return None
        grown = [k for k, (a, b) in enumerate(zip(first, second, strict=True)) if a != b]
        if len(grown) != 1:
            return None
        k = grown[0]
        a, b = first[k], second[k]
        ratio = PROBE_BATCHES[1] / PROBE_BATCHES[0]
        return k if a > 0 and abs(b / a - ratio) < 1e-9 else None

    @property
    def depends_on_batch(self) -> bool:
        return self.shapes[0] != self.shapes[1] or self.batch_dependent_values


class ProbeError(ValueError):
    """The graph does not run at two batch sizes: its batch dimension cannot be pinned."""


def probe(model: onnx.ModelProto, input_name: str, sample_shape: tuple[int, ...],
          names: list[str], seed: int = 0) -> dict[str, Probe]:
    """Run ``model`` at batch 2 and 3 (uniform random inputs of ``sample_shape`` = (C, H, W))
    with ``names`` added as outputs; one :class:`Probe` per name."""
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    present = {o.name for o in probed.graph.output}
    for name in names:
        if name not in present:
            probed.graph.output.append(onnx.ValueInfoProto(name=name))
            present.add(name)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(probed.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - ORT raises its own exception types
        raise ProbeError(f"ONNX Runtime cannot load the graph: {err}") from err
    rng = np.random.default_rng(seed)
    runs = []
    for batch in PROBE_BATCHES:
        x = rng.uniform(-1.0, 1.0, (batch, *sample_shape)).astype(np.float32)
        try:
            outputs = session.run(names, {input_name: x})
        except Exception as err:  # noqa: BLE001
            raise ProbeError(
                f"the graph does not run at batch {batch}: {err}. Export it with a dynamic "
                "batch dimension (torch.onnx.export(..., dynamic_shapes=...) or "
                "dynamic_axes={'input': {0: 'batch'}})"
            ) from err
        runs.append(outputs)
    probes = {}
    for i, name in enumerate(names):
        a, b = runs[0][i], runs[1][i]
        is_float = np.issubdtype(a.dtype, np.floating)
        changed = (not is_float and a.shape == b.shape and not np.array_equal(a, b))
        probes[name] = Probe(name, (tuple(a.shape), tuple(b.shape)), is_float, changed,
                             str(a.dtype))
    return probes
