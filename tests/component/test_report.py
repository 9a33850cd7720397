"""The eval report's Pareto front: the runs no cheaper (or equally cheap) run matches."""

from __future__ import annotations

from eva0_edge.bench.testbed.protocols import StreamResult
from eva0_edge.bench.testbed.report import pareto_front, pareto_lines, read_traces, write_report


def _run(method: str, batch: int, average: float, forwards: float | None) -> StreamResult:
    return StreamResult(method, {"gaussian_noise": average, "shot_noise": average}, batch,
                        batch_correct=[1, 1], batch_size=[batch, batch],
                        batch_domain=["gaussian_noise", "shot_noise"], drift=[0.0, 0.1],
                        logit_norm=[1.0, 1.0], forwards_per_sample=forwards)


RESULTS = {
    "noadapt B=64": _run("noadapt", 64, 60.0, 1.0),
    "noadapt-shift B=64": _run("noadapt-shift", 64, 63.7, 1.0),
    "zoa B=64": _run("zoa", 64, 62.0, 2.0),          # dearer than the shift and worse
    "eva0 B=64": _run("eva0", 64, 64.9, 2.0),
    "foa B=64": _run("foa", 64, 64.9, 28.0),         # as good as EVA-0 at 14x its forwards
    "tent B=64": _run("tent", 64, 70.0, None),       # no forward count: not placed
    "eva0 B=1": _run("eva0", 1, 50.0, 2.0),
}


def test_the_front_keeps_only_runs_no_cheaper_run_matches():
    assert pareto_front(RESULTS, 64) == ["noadapt-shift B=64", "eva0 B=64"]
    assert pareto_front(RESULTS, 1) == ["eva0 B=1"]
    assert pareto_front(RESULTS, 16) == []


def test_the_report_names_the_front_and_draws_it(tmp_path):
    assert pareto_lines(RESULTS) == (
        "Pareto front, B = 1: eva0 (2.00 fwd, 50.0%)\n"
        "Pareto front, B = 64: noadapt-shift (1.00 fwd, 63.7%) -> eva0 (2.00 fwd, 64.9%)")
    spec = {"model": "m.onnx", "dataset": "fmnist-c", "severity": 5, "protocol": "continual",
            "batch_sizes": [1, 64]}
    paths = write_report(RESULTS, spec, tmp_path)
    assert "Pareto front, B = 64: noadapt-shift" in paths["md"].read_text()
    assert paths["pareto"].stat().st_size > 10_000


def test_the_traces_come_back_method_by_method(tmp_path):
    spec = {"model": "m.onnx", "dataset": "fmnist-c", "severity": 5, "protocol": "continual",
            "batch_sizes": [1, 64]}
    traces = read_traces(write_report(RESULTS, spec, tmp_path)["traces"])
    assert list(traces) == list(RESULTS)
    for name, result in RESULTS.items():
        assert traces[name]["batch_correct"].tolist() == result.batch_correct
        assert traces[name]["batch_size"].tolist() == result.batch_size
        assert traces[name]["batch_domain"].tolist() == result.batch_domain


def test_the_title_names_the_split_a_run_read(tmp_path):
    """A tuning run on the validation split is never titled as test images."""
    spec = {"model": "m.onnx", "dataset": "fmnist-c", "severity": 5, "protocol": "single",
            "batch_size": 1}
    titles = {}
    for split, corruptions in (("val", ["clean"]), ("test", ["clean"]), ("val", None)):
        out = tmp_path / f"{split}-{corruptions}"
        paths = write_report(RESULTS, {**spec, "split": split, "corruptions": corruptions}, out)
        titles[split, bool(corruptions)] = paths["md"].read_text().splitlines()[0]
    assert titles["val", True] == "## m.onnx - clean val images, single, batch 1"
    assert titles["test", True] == "## m.onnx - clean test images, single, batch 1"
    assert titles["val", False] == "## m.onnx - fmnist-c severity 5, val split, single, batch 1"
