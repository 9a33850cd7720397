"""Issue 49's protocols: gradual (severity 1->5->1 within each corruption, never reset), mixed
(every domain pooled into one stream, each sample scored against its own domain), every
severity in one eval (keys `` S=<s>``), the soak's passes, the CLI's severity lists, the tuner's
cells and the Pareto summary per protocol. Tiny fake domains: pixel (0, 0) of every image
codes its corruption, severity and index, and a fake method reads the codes back."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from eva0_edge.bench.cli import severity_list
from eva0_edge.bench.testbed.datasets import Domain
from eva0_edge.bench.testbed.protocols import GRADUAL_SEVERITIES, run_protocol
from eva0_edge.runtime.metadata import Preprocessing
from tests.fixtures import SHIPPED_RESNET_GN

PRE = Preprocessing((3, 32, 32), (0.5,) * 3, (0.5,) * 3)
NAMES = ("a", "b", "c")


def coded(name: str, severity: int, labels: np.ndarray) -> Domain:
    """A domain whose image i has pixel (0, 0) = (corruption index, severity, i)."""
    images = np.zeros((len(labels), 32, 32, 3), np.uint8)
    images[:, 0, 0] = np.stack([np.full(len(labels), NAMES.index(name)),
                                np.full(len(labels), severity), np.arange(len(labels))], 1)
    return Domain(name, severity, np.asarray(labels), images=images)


def codes(x: np.ndarray) -> np.ndarray:
    """Pixel (0, 0) of a preprocessed batch [B, 3, 32, 32] back as uint8 codes [B, 3]."""
    return np.rint((x[:, :, 0, 0] * 0.5 + 0.5) * 255).astype(int)


class Recorder:
    """A fake method: records each batch's codes and its resets; predicts class ``predict``
    or, with ``predict=None``, the corruption's index."""

    def __init__(self, predict: int | None = 0):
        self.batches: list[np.ndarray] = []
        self.resets = 0
        self.predict = predict

    def step(self, x: np.ndarray) -> np.ndarray:
        found = codes(x)
        self.batches.append(found)
        classes = found[:, 0] if self.predict is None else np.full(len(x), self.predict)
        return np.eye(10)[classes]

    def reset(self) -> None:
        self.resets += 1


def every_severity(names=("a", "b"), size: int = 6) -> list[Domain]:
    """Each corruption at severities 1-5; at severity s its first s images are class 0."""
    return [coded(n, s, (np.arange(size) >= s).astype(int)) for n in names for s in range(1, 6)]


def test_gradual_rises_and_falls_within_each_corruption_and_never_resets():
    method = Recorder()
    result = run_protocol("fake", lambda: method, every_severity(), "gradual", 6, PRE,
                          progress=False)
    assert method.resets == 0
    seen = [(NAMES[b[0, 0]], int(b[0, 1])) for b in method.batches]
    assert all(len(set(map(tuple, b[:, :2]))) == 1 for b in method.batches)  # one step a batch
    assert seen == [(n, s) for n in ("a", "b") for s in GRADUAL_SEVERITIES]
    assert [(s["domain"], s["severity"]) for s in result.steps] == seen
    # every step streams all its images, in a fresh shuffle: the two severity-1 steps differ
    orders = [b[:, 2].tolist() for b in method.batches]
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert len({tuple(o) for o in orders}) > 2


def test_gradual_scores_each_corruption_over_all_its_steps():
    result = run_protocol("fake", Recorder, every_severity(), "gradual", 4, PRE, progress=False)
    hits = sum(GRADUAL_SEVERITIES)  # class 0 predicted: s hits at severity s
    assert list(result.accuracy) == ["a", "b"]
    assert result.accuracy["a"] == pytest.approx(100.0 * hits / (6 * len(GRADUAL_SEVERITIES)))
    assert [s["accuracy"] for s in result.steps[:9]] == pytest.approx(
        [100.0 * s / 6 for s in GRADUAL_SEVERITIES])


def test_gradual_refuses_a_corruption_missing_a_severity():
    domains = [d for d in every_severity() if (d.name, d.severity) != ("b", 4)]
    with pytest.raises(ValueError, match="b has none at severity \\[4\\]"):
        run_protocol("fake", Recorder, domains, "gradual", 4, PRE, progress=False)


def test_mixed_batches_draw_from_several_domains_each_scored_against_its_own():
    domains = [coded(n, 5, np.full(12, i)) for i, n in enumerate(NAMES)]  # a: 0, b: 1, c: 2
    method = Recorder(predict=None)  # right on every sample, wherever it comes from
    result = run_protocol("fake", lambda: method, domains, "mixed", 6, PRE, progress=False)
    assert method.resets == 0
    assert result.accuracy == {"a": 100.0, "b": 100.0, "c": 100.0}
    assert sum(len(set(b[:, 0])) > 1 for b in method.batches) >= len(method.batches) - 1
    assert sorted(map(tuple, np.concatenate(method.batches)[:, [0, 2]].tolist())) == sorted(
        (i, j) for i in range(3) for j in range(12))  # every sample once
    only_a = run_protocol("fake", Recorder, domains, "mixed", 6, PRE, progress=False)
    assert only_a.accuracy == {"a": 100.0, "b": 0.0, "c": 0.0}  # class 0 is a's label only
    assert set(only_a.batch_domain) == {"mixed"}


def test_the_soak_runs_its_passes():
    domains = [coded(n, 5, np.zeros(4, int)) for n in ("a", "b")]
    method = Recorder()
    result = run_protocol("fake", lambda: method, domains, "soak", 4, PRE, progress=False,
                          soak_passes=3)
    assert list(result.accuracy) == ["a@1", "b@1", "a@2", "b@2", "a@3", "b@3"]
    assert method.resets == 0 and len(method.batches) == 6


def test_a_domain_streamed_twice_reports_its_last_visit():
    """As before gradual: the hostile protocol's ``clean`` after each fault is its last visit."""
    domains = [coded("a", 5, np.zeros(4, int)), coded("b", 5, np.ones(4, int)),
               coded("a", 5, np.array([0, 1, 1, 1]))]
    result = run_protocol("fake", Recorder, domains, "continual", 4, PRE, progress=False)
    assert result.accuracy == {"a": 25.0, "b": 0.0}


def test_several_severities_run_as_their_own_streams_keyed_s(tmp_path):
    from eva0_edge.bench.testbed.evaluate import EvalSpec, evaluate

    # severity 1: all class 0, severity 3: all class 1; a run sees only its severity's images
    domains = [coded(n, s, np.full(4, 0 if s == 1 else 1)) for s in (1, 3) for n in ("a", "b")]
    spec = EvalSpec(model=str(SHIPPED_RESNET_GN), dataset="fmnist-c", protocol="continual",
                    severity=[1, 3], batch_size=4, batch_sizes=[2, 4], methods=["noadapt"])
    results = evaluate(spec, tmp_path, progress=False, domains=domains)
    assert list(results) == ["noadapt B=2 S=1", "noadapt B=4 S=1", "noadapt B=2 S=3",
                             "noadapt B=4 S=3"]
    assert [r.severity for r in results.values()] == [1, 1, 3, 3]
    assert all(sum(r.batch_size) == 8 for r in results.values())
    md = (tmp_path / "results.md").read_text()
    assert "| method | B | S | a | b |" in md and "| noadapt | 4 | 3 |" in md
    assert "severities 1,3" in md.splitlines()[0] and "Pareto front, B = 4, S = 3" in md
    saved = json.loads((tmp_path / "results.json").read_text())["results"]
    assert saved["noadapt B=2 S=3"]["severity"] == 3
    assert (tmp_path / "pareto.png").stat().st_size > 0


def test_gradual_takes_no_severity_but_the_default():
    from eva0_edge.bench.testbed.evaluate import EvalSpec, stream_sets

    spec = EvalSpec(model="m.onnx", dataset="fmnist-c", protocol="gradual", severity=5,
                    batch_size=4, methods=["noadapt"])
    assert stream_sets(spec) == [(1, 2, 3, 4, 5)]
    for severity in (3, [1, 5]):
        spec.severity = severity
        with pytest.raises(ValueError, match="leave --severity out"):
            stream_sets(spec)


@pytest.mark.parametrize("text,value", [("5", 5), ("1-5", [1, 2, 3, 4, 5]),
                                        ("1,3,5", [1, 3, 5]), ("2-2", 2)])
def test_the_cli_reads_a_severity_a_range_or_a_list(text, value):
    assert severity_list(text) == value


@pytest.mark.parametrize("text", ["0", "6", "0-5", "1,6", "3-1", "1,1", "x", ""])
def test_the_cli_refuses_a_severity_outside_1_to_5(text):
    with pytest.raises(argparse.ArgumentTypeError, match="1..5|not a severity"):
        severity_list(text)


@pytest.mark.parametrize("argv,named", [
    (["--severity", "0"], "--severity"), (["--severity", "6"], "1..5"),
    (["--protocol", "gradual", "--severity", "3"], "leave --severity out"),
    (["--protocol", "spiral"], "spiral"), (["--soak-passes", "0"], "--soak-passes")])
def test_eval_refuses_a_bad_severity_or_protocol_in_one_line(argv, named, capsys):
    from eva0_edge.cli import main

    try:
        status = main(["eval", "--model", str(SHIPPED_RESNET_GN), "--limit", "1", *argv])
    except SystemExit as stop:
        status = stop.code
    assert status not in (0, None)
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("eva0-edge") and named in message


def test_the_tuner_scores_a_cell_per_protocol_severity_and_batch():
    from eva0_edge.bench.testbed.tuner import TuneData, TuneSettings, cell_batches, score

    clean = [Domain("clean", 0, np.zeros(4, int), images=np.zeros((4, 32, 32, 3), np.uint8))]
    data = TuneData(every_severity(size=4), clean, "fmnist-c", [3, 5])
    settings = TuneSettings(batch_sizes=[4], protocols=["single", "gradual", "mixed"])
    cells, forwards, _ = score(str(SHIPPED_RESNET_GN), "noadapt", data, settings, {})
    assert list(cells) == ["single S=3 B=4", "single S=5 B=4", "gradual B=4", "mixed S=3 B=4",
                           "mixed S=5 B=4", "clean B=4"]
    assert set(forwards) == set(cells) - {"clean B=4"}
    # batches: single 2 domains x 2 severities, gradual 2 x 9 steps, mixed 2 x 2 pooled, clean 1
    assert cell_batches(data, settings) == 4 + 18 + 4 + 1


def test_the_pareto_summary_has_a_row_and_panel_per_protocol_severity_and_bank(tmp_path):
    from eva0_edge.bench.budget_summary import main

    def report(folder: str, protocol: str, overrides: dict, results: dict) -> None:
        (tmp_path / folder).mkdir()
        spec = {"model": "models/m.onnx", "protocol": protocol, "severity": 5, "limit": 50,
                "overrides": overrides}
        (tmp_path / folder / "results.json").write_text(
            json.dumps({"spec": spec, "results": results}))

    def run(avg: float, fps: float, severity: int | None = None) -> dict:
        return {"batch_size": 16, "average": avg, "forwards_per_sample": fps,
                **({} if severity is None else {"severity": severity})}

    report("m-mixed-full", "mixed", {}, {"noadapt S=1": run(80, 1, 1), "eva0 S=1": run(82, 2, 1),
                                        "noadapt S=5": run(60, 1, 5), "eva0 S=5": run(59, 2, 5)})
    report("m-gradual-1.5", "gradual", {"budget": 1.5, "bank_slots": 8},
           {"eva0": run(70, 1.5)})
    report("m-gradual-full", "gradual", {"bank_slots": 0}, {"eva0": run(71, 2)})
    assert main([str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "budget.json").read_text())["rows"]
    assert [(r["protocol"], r["severity"], r["method"], r["bank"], r["front"]) for r in rows] == [
        ("gradual", "1->5->1", "eva0 budget 1.5", 8, True),
        ("gradual", "1->5->1", "eva0", 0, True),
        ("mixed", "1", "noadapt", 0, True), ("mixed", "1", "eva0", 0, True),
        ("mixed", "5", "noadapt", 0, True), ("mixed", "5", "eva0", 0, False)]
    table = (tmp_path / "budget.md").read_text()
    assert "| m | gradual | 1->5->1 | 16 | eva0 budget 1.5 | bank 8 | 1.50 | 70.00 | yes |" in table
    assert "| m | mixed | 5 | 16 | eva0 | no bank | 2.00 | 59.00 |  |" in table
    assert (tmp_path / "budget.png").stat().st_size > 0
