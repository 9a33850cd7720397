"""The compute budget: the forward counter stays within it, a budget of one forward is the
shift alone, a full budget is the method as it is, the bucket's fill survives a state file."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.bench.testbed.datasets import corrupted_fmnist
from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist
from eva0_edge.runtime.budget import BURST_SAMPLES, ComputeBudget, forwards_bound
from eva0_edge.runtime.modelfile import read_metadata
from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.preprocess import preprocess_uint8
from tests.test_testbed import SHIPPED

RESNET = SHIPPED[1]


@pytest.fixture(scope="module")
def fmnist_clean() -> np.ndarray:
    images, _ = load_fashion_mnist("test")
    order = np.random.default_rng(5).permutation(len(images))[:2048]
    return preprocess_uint8(images[order], read_metadata(RESNET).preprocessing)


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
    with pytest.raises(ValueError, match="budget_burst must be int"):
        Policy.load(RESNET, "eva0", {"budget": 1.5, "budget_burst": 12.5})


@pytest.mark.parametrize("burst", [BURST_SAMPLES, 128])
def test_the_forward_counter_stays_within_the_budget(fmnist_clean, burst):
    model = Policy.load(RESNET, "eva0", {"budget": 1.25, "budget_burst": burst},
                               threads=1)
    for i in range(0, len(fmnist_clean), 16):
        model.step(fmnist_clean[i:i + 16])
    stats = model.stats()
    assert 1.1 < stats["forwards_per_sample"] <= forwards_bound(1.25, burst, len(fmnist_clean), 16)
    assert stats["budget"]["burst"] == burst
    counted = stats["budget"]["adapted_samples"] + stats["budget"]["served_samples"]
    assert counted == len(fmnist_clean)
    assert stats["drift"] > 0


def test_the_guards_duels_stay_within_the_budget(fmnist_clean):
    """Clean images, black frames (theta0 fails on them too: the guard holds, dueling the
    theta learnt before them against theta0 while the credit pays for it), clean again: the
    forward counter stays within the budget, its bucket, and one audit's overrun; the held
    theta gives way to theta0 once the credit cannot pay for the next duel."""
    model = Policy.load(RESNET, "eva0", {"budget": 1.25}, threads=1)
    black = np.repeat(fmnist_clean[:1] * 0 + fmnist_clean.min(), 16, axis=0)
    stream = [fmnist_clean[i:i + 16] for i in range(0, 1024, 16)] + [black] * 64 + \
        [fmnist_clean[i:i + 16] for i in range(1024, 2048, 16)]
    for x in stream:
        model.step(x)
    stats, samples = model.stats(), 16 * len(stream)
    assert stats["guard"]["pause_verdicts"]["hold"] >= 2
    allowance = (0.25 * BURST_SAMPLES + model.config.guard_warmup + 16) / samples
    assert stats["forwards_per_sample"] <= 1.25 + allowance


def test_samples_in_the_guards_duels_earn_their_credit_too(fmnist_clean):
    """Every sample adds F - 1 to the credit, one the guard's duel serves too: over a duel of
    the adapted theta against theta0 (two forwards a sample) the credit moves by exactly
    (F - 1) n minus the forwards run beyond one a sample (it fell by all of them when only
    samples outside a duel earned, and the budget went unspent)."""
    model = Policy.load(RESNET, "eva0", {"budget": 1.5}, threads=1)
    for i in range(0, 256, 16):
        model.step(fmnist_clean[i:i + 16])
    model.budget.credit = 100.0  # room below the cap, so nothing earned is cut off
    model.state.pause_left = 64  # the guard's pause: theta0 against the adapted theta
    before, credit = model.stats(), model.budget.credit
    for i in range(256, 320, 16):
        model.step(fmnist_clean[i:i + 16])
    after = model.stats()
    samples = after["samples"] - before["samples"]
    extra = after["forwards"] - before["forwards"] - samples
    assert samples == 64 and extra == 64  # dueled: two forwards a sample
    assert model.budget.credit == pytest.approx(credit + 0.5 * samples - extra)


@pytest.mark.integration  # a Fashion-MNIST stream
def test_a_duel_is_lengthened_only_while_the_credit_pays_for_it():
    """Clean and noisy images in turns of 48 samples, a change of stream inside every duel:
    each change lengthens the running duel only while the credit pays for it, else theta0
    wins it; so the credit never goes below one batch's debt and the forward counter stays
    within the budget and its bucket (it lengthened the first duel to the end of the stream,
    two forwards a sample at budget 1.5, 520 forwards in debt)."""
    pre = read_metadata(RESNET).preprocessing
    n, batch = 2048, 16
    clean, noisy = (preprocess_uint8(corrupted_fmnist("test", kind, 1, 0, indices=np.arange(n),
                                                      progress=False)[0], pre)
                    for kind in ("clean", "gauss-0.3"))
    model = Policy.load(RESNET, "eva0", {"budget": 1.5}, threads=1)
    lowest = 0.0
    for i in range(0, n, batch):
        model.step((noisy if (i // 48) % 2 else clean)[i:i + batch])
        lowest = min(lowest, model.budget.credit)
    assert model.stats()["guard"]["audits"] >= 1
    assert lowest >= -batch
    assert model.stats()["forwards_per_sample"] <= forwards_bound(1.5, BURST_SAMPLES, n, batch)


def test_a_budget_of_one_forward_is_the_activation_shift_alone(fmnist_clean):
    """No adaptation: bit for bit the source model with EVA-0's activation shift, one forward
    per sample (on one stream: a change of input also restarts the shift, which the
    non-adapting methods do not watch for)."""
    model = Policy.load(RESNET, "eva0", {"budget": 1.0}, threads=1)
    shift = {k: getattr(model.config, k) for k in ("activation_shift", "shift_window",
                                                   "shift_max")}
    source = Policy.load(RESNET, "noadapt-shift", shift, threads=1)
    for i in range(0, 1024, 16):
        x = fmnist_clean[i:i + 16]
        np.testing.assert_array_equal(model.step(x), source.step(x))
    assert model.stats()["forwards_per_sample"] == 1.0
    np.testing.assert_array_equal(model.state.theta, read_metadata(RESNET).theta0)


def test_a_full_budget_is_the_method_as_it_is(fmnist_clean):
    full = Policy.load(RESNET, "eva0", {"budget": 2.0}, threads=1)
    plain = Policy.load(RESNET, "eva0", threads=1)
    for i in range(0, 512, 16):
        x = fmnist_clean[i:i + 16]
        np.testing.assert_array_equal(full.step(x), plain.step(x))
    np.testing.assert_array_equal(full.state.theta, plain.state.theta)


def test_the_bucket_fill_is_saved_with_the_state(fmnist_clean, tmp_path):
    model = Policy.load(RESNET, "eva0", {"budget": 1.5}, threads=1)
    for i in range(0, 768, 16):
        model.step(fmnist_clean[i:i + 16])
    fill = model.budget.fill
    assert 0 <= fill < 1
    path = model.save_state(tmp_path / "s.npz")
    again = Policy.load(RESNET, "eva0", {"budget": 1.5}, threads=1)
    again.load_state(path)
    assert again.budget.fill == pytest.approx(fill)
    state = again.state_dict()
    with pytest.raises(ValueError, match="budget_fill"):
        again.load_state_dict({**state, "budget_fill": 1.5})
    assert again.budget.fill == pytest.approx(fill)


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
    from eva0_edge.runtime.modelfile import load_onnx, read_metadata, save_onnx, set_metadata

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

    from .studies import load_study

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
