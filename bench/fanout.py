"""``eva0-edge eval --ray [ADDRESS]``: the independent cells of an evaluation as Ray tasks.

A cell is one method at one batch size on one domain in the ``single`` protocol (each domain
starts from the source model there), or on the whole stream in the others (continual, soak, ...,
where a domain starts where the previous one ended). Every task loads the same domains as the
local run (the seeded image subset is drawn over all domains, so a task loads them all and keeps
its own) and builds a fresh method, so the results equal the local run's to the digit; the
report is assembled in the local run's order. Needs the ``[fleet]`` extra (Ray); on a cluster,
every node needs the package, the model files and the dataset (or its cache) at the same paths.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from eva0_edge.fleet.serve import init_ray
from eva0_edge.runtime.modelfile import read_metadata

from .testbed.evaluate import (
    EvalSpec,
    batch_sizes,
    check_method,
    load_domains,
    method_factory,
    spec_dict,
    split_overrides,
)
from .testbed.protocols import StreamResult, run_protocol
from .testbed.report import write_report


def run_cell(spec: EvalSpec, name: str, batch: int, domain: str | None) -> StreamResult:
    """One cell: ``name`` at ``batch`` on ``domain`` (None: the whole stream)."""
    cell_spec = replace(spec, batch_size=batch, batch_sizes=None)
    domains = load_domains(spec, progress=False)
    if domain is not None:
        domains = [d for d in domains if d.name == domain]
    return run_protocol(
        name, method_factory(cell_spec, name), domains, spec.protocol, batch,
        read_metadata(spec.model).preprocessing, spec.seed, progress=False,
    )


def joined(parts: list[StreamResult]) -> StreamResult:
    """Per-domain results of one method and batch size as the local run reports them (the
    final statistics are the last domain's, as a local run's are after its last reset)."""
    out = StreamResult(parts[0].method, {}, parts[0].batch)
    for part in parts:
        out.accuracy.update(part.accuracy)
        for trace in ("batch_correct", "batch_size", "batch_domain", "drift", "logit_norm"):
            getattr(out, trace).extend(getattr(part, trace))
    out.skipped_steps = parts[-1].skipped_steps
    out.forwards_per_sample = parts[-1].forwards_per_sample
    out.final_stats = parts[-1].final_stats
    return out


def evaluate_on_ray(
    spec: EvalSpec, address: str | None = None, out_dir: str | os.PathLike | None = None,
    cpus_per_cell: float = 1.0,
) -> dict[str, StreamResult]:
    """:func:`~.evaluate.evaluate` with every cell a Ray task (a local instance when
    ``address`` is None); same keys and results."""
    for name in spec.methods:
        check_method(name)
    split_overrides(spec.overrides)
    sizes = batch_sizes(spec)
    init_ray(address)
    import ray

    names = [d.name for d in load_domains(spec)] if spec.protocol == "single" else [None]
    task = ray.remote(run_cell).options(num_cpus=cpus_per_cell)
    cells: dict[str, list[Any]] = {}
    for batch in sizes:
        for name in spec.methods:
            key = name if len(sizes) == 1 else f"{name} B={batch}"
            cells[key] = [task.remote(spec, name, batch, domain) for domain in names]
    results = {key: joined(ray.get(refs)) for key, refs in cells.items()}
    if out_dir is not None:
        write_report(results, {**spec_dict(spec), "ray": address or "local"}, Path(out_dir))
    return results
