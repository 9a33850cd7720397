"""The compute budget: the forward counter stays within it, a budget of one forward is the
shift alone, a full budget is the method as it is, the bucket's fill survives a state file."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.budget import BURST_SAMPLES, ComputeBudget
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from tests.fixtures import SHIPPED

RESNET = SHIPPED[1]


@pytest.mark.parametrize("budget", [1.0, 1.1, 1.25, 1.5, 1.9])
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("burst", [BURST_SAMPLES, 256])
def test_the_bucket_never_spends_more_than_it_was_given(budget, batch, burst):
    """Over any prefix of N samples, with a change every 700 samples: extra forwards <=
    (F - 1) N + the bucket of ``burst`` samples' credit; on a long stream the spending is the
    budget's."""
    bucket = ComputeBudget(budget, 2, burst=burst)
    spent, seen = 0, 0
    for i in range(0, 40000, batch):
        if i // 700 != (i + batch) // 700:
            bucket.changed()
        spent += batch if bucket.adapt(batch) else 0
        seen += batch
        assert spent <= (budget - 1) * seen + max((budget - 1) * burst, batch) + 1e-6
    assert spent >= (budget - 1) * seen - max((budget - 1) * burst, batch) - batch


def test_after_a_change_the_bucket_is_spent_densely_then_evenly():
    bucket = ComputeBudget(1.5, 2)
    first = [bucket.adapt(16) for _ in range(64)]  # 1024 samples from a full bucket
    assert all(first[:40]) and not all(first)
    settled = [bucket.adapt(16) for _ in range(400)]
    gaps = np.diff(np.flatnonzero(settled))
    assert gaps.min() >= 1 and gaps.max() <= 3  # one batch in two, spread evenly
    bucket.changed()
    assert all(bucket.adapt(16) for _ in range(30))


def test_the_guards_duels_are_paid_for_before_adaptation_goes_on():
    bucket = ComputeBudget(1.5, 2)
    bucket.charge(2000)  # a long duel: 2000 extra forwards
    bucket.changed()
    waited = 0
    while not bucket.adapt(16):
        waited += 16
    assert waited >= (2000 - 512) / 0.5 - 16  # the debt beyond the full bucket, at 0.5 a sample


def test_a_budget_outside_one_to_the_methods_forwards_is_refused():
    for bad in (0.5, 2.5):
        with pytest.raises(ValueError, match="budget must be between 1 and"):
            Policy.load(RESNET, "eva0", {"budget": bad})
    for bad in (0, -3, 1 << 21):
        with pytest.raises(ValueError, match="budget_burst must be between 1 and"):
            Policy.load(RESNET, "eva0", {"budget": 1.5, "budget_burst": bad})
        with pytest.raises(ValueError, match="budget_burst must be between 1 and"):
            Policy.load(RESNET, "eva0", {"budget_burst": bad})  # no budget set (yet)
    with pytest.raises(ValueError, match="budget_burst must be an integer"):
        Policy.load(RESNET, "eva0", {"budget": 1.5, "budget_burst": 12.5})


def test_the_budget_summary_tables_and_plots_measured_forwards(tmp_path):
    """Two eval reports (full cost, and EVA-0 at a budget) -> one row per method and batch,
    EVA-0's budget in its name, the measured forwards per sample, a PNG."""
    import json

    from eva0_edge.bench.budget_summary import main

    def report(label: str, budget: float | None, rows: dict) -> None:
        folder = tmp_path / f"resnet_gn_fmnist-{label}"
        folder.mkdir()
        spec = {"model": "models/resnet_gn_fmnist.onnx", "protocol": "continual", "limit": 300,
                "overrides": {} if budget is None else {"budget": budget}}
        results = {name: {"batch_size": 1, "average": avg, "forwards_per_sample": fps}
                   for name, (avg, fps) in rows.items()}
        (folder / "results.json").write_text(json.dumps({"spec": spec, "results": results}))

    report("full", None, {"noadapt B=1": (79.4, 1.0), "eva0 B=1": (81.1, 2.0)})
    report("1.5", 1.5, {"eva0 B=1": (81.2, 1.49)})
    assert main([str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "budget.json").read_text())["rows"]
    assert [(r["method"], r["forwards_per_sample"]) for r in rows] == [
        ("noadapt", 1.0), ("eva0 budget 1.5", 1.49), ("eva0", 2.0)]
    assert (tmp_path / "budget.png").stat().st_size > 0
    # a rerun of the budget row alone keeps the other rows of the earlier summary
    earlier = tmp_path.parent / f"{tmp_path.name}-earlier.json"
    (tmp_path / "budget.json").rename(earlier)
    for folder in ("full", "1.5"):
        for f in (tmp_path / f"resnet_gn_fmnist-{folder}").iterdir():
            f.unlink()
        (tmp_path / f"resnet_gn_fmnist-{folder}").rmdir()
    report("1.5", 1.5, {"eva0 B=1": (81.6, 1.48)})
    assert main([str(tmp_path), "--keep", str(earlier)]) == 0
    rows = json.loads((tmp_path / "budget.json").read_text())["rows"]
    assert [(r["method"], r["average"]) for r in rows] == [
        ("noadapt", 79.4), ("eva0 budget 1.5", 81.6), ("eva0", 81.1)]


def test_the_layers_summary_shares_the_gain_of_the_file_adapting_the_most(tmp_path):
    """Two cost reports and four eval reports; the share of the gain is of the file of the same
    architecture with the most adapted parameters: the shipped ResNet-GN (1344) for a copy
    whose metadata adapts only its first two theta segments, the shipped ViT for itself."""
    import dataclasses
    import json

    from eva0_edge.bench.layers_summary import main
    from eva0_edge.runtime.modelfile import load_onnx, save_onnx, set_metadata

    shipped = load_onnx("models/resnet_gn_fmnist.onnx")
    metadata = read_metadata(shipped)
    layout = metadata.theta_layout[:2]
    width = sum(seg.size for seg in layout)
    fewer = dataclasses.replace(metadata, theta_layout=layout, arrays={
        **metadata.arrays, "theta0": metadata.arrays["theta0"][:width]})
    save_onnx(set_metadata(shipped, fewer), tmp_path / "resnet_gn_fmnist-less.onnx")
    for stages, ratio in (("4", 1.1), ("1-4", 2.0)):
        (tmp_path / f"bench-resnet50_gn-{stages}").mkdir()
        rows = [{"method": "noadapt", "batch": 8, "ratio_to_noadapt": 1.0},
                {"method": "eva0", "batch": 8, "ratio_to_noadapt": ratio}]
        (tmp_path / f"bench-resnet50_gn-{stages}" / "cost.json").write_text(
            json.dumps({"architecture": "resnet50_gn", "rows": rows}))
    for name, eva0 in (("vit_fmnist", 81.0), ("resnet_gn_fmnist", 80.5),
                       ("resnet_gn_fmnist-less", 80.0)):
        (tmp_path / f"acc-{name}").mkdir()
        spec = {"model": f"{name}.onnx", "protocol": "continual"}
        results = {"noadapt B=8": {"batch_size": 8, "average": 79.0},
                   "eva0 B=8": {"batch_size": 8, "average": eva0}}
        if name.startswith("resnet"):  # the one-forward shift: 79.7
            results["noadapt-shift B=8"] = {"batch_size": 8, "average": 79.7}
        (tmp_path / f"acc-{name}" / "results.json").write_text(
            json.dumps({"spec": spec, "results": results}))
    assert main([str(tmp_path), "--model-dirs", str(tmp_path), "models"]) == 0
    report = json.loads((tmp_path / "layers.json").read_text())
    assert [(r["stages"], r["ratio_to_noadapt"]) for r in report["costs"]] == [
        ("4", 1.1), ("1-4", 2.0)]
    assert [(r["model"], r["gain"], r["share_of_gain"], r["gain_over_shift"],
             r["share_over_shift"]) for r in report["accuracy"]] == [
        ("resnet_gn_fmnist", 1.5, 1.0, 0.8, 1.0), ("resnet_gn_fmnist-less", 1.0, 0.667, 0.3, 0.375),
        ("vit_fmnist", 2.0, 1.0, None, None)]
    assert "| vit_fmnist | 1,2,3,4,5,6 | 2304 | continual | 8 | 79.00 | - | 81.00 |" in \
        (tmp_path / "layers.md").read_text()
    assert (tmp_path / "layers.png").stat().st_size > 0


def test_the_seeds_summary_averages_each_seeds_cost_of_the_budget(tmp_path):
    """Per seed the budget row minus the full-cost row of the same model and batch size; the
    mean and its standard error over seeds; rows missing from one seed are left out."""
    import json

    from tests.fixtures import load_study

    main = load_study("budget-seeds", "budget_seeds").main

    def summary(name: str, budget_avg: float, full_avg: float, extra: bool = False) -> str:
        rows = [{"model": "m", "batch_size": 64, "method": "eva0 budget 1.5",
                 "average": budget_avg, "forwards_per_sample": 1.5},
                {"model": "m", "batch_size": 64, "method": "eva0", "average": full_avg,
                 "forwards_per_sample": 2.0}]
        if extra:
            rows.append({**rows[0], "batch_size": 1})
        (tmp_path / name).mkdir()
        (tmp_path / name / "budget.json").write_text(json.dumps({"rows": rows}))
        return str(tmp_path / name / "budget.json")

    paths = [summary("seed1", 84.0, 84.5, extra=True), summary("seed2", 84.2, 84.3)]
    assert main([f"first={summary('main', 83.0, 83.6)}", *paths, "--out",
                 str(tmp_path / "out")]) == 0
    (row,) = json.loads((tmp_path / "out" / "seeds.json").read_text())["rows"]
    assert row["differences"] == pytest.approx({"first": -0.6, "seed1": -0.5, "seed2": -0.1})
    assert row["mean"] == pytest.approx(-0.4)
    assert row["standard_error"] == pytest.approx(np.std([-0.6, -0.5, -0.1], ddof=1) / 3 ** 0.5)
    with pytest.raises(SystemExit):
        main([paths[0], paths[0], "--out", str(tmp_path / "out")])  # one name twice
