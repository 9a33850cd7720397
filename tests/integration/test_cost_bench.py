"""The cost benchmark runs on a small model and writes its outputs (no time is asserted)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eva0_edge.cli import main
from tests.fixtures import MODEL, SHIPPED_VIT


def test_bench_writes_tables_json_and_png(small_vit, prompt_vit, tmp_path, capsys):
    from eva0_edge.bench import cost

    report = cost.run_bench(
        str(small_vit.onnx_path), [1, 4], ["eva0", "zoa", "foa"], repeats=2, warmup=1,
        threads=1, memory=True, progress=False, prompt_model=str(prompt_vit.onnx_path),
    )
    cost.write_outputs(report, tmp_path)
    data = json.loads((tmp_path / "cost.json").read_text())
    rows = data["rows"]
    assert [(r["method"], r["batch"]) for r in rows] == [
        (m, b) for b in (1, 4) for m in ("noadapt", "eva0", "zoa", "foa")
    ]
    for r in rows:
        assert r["ms_per_sample"] > 0 and r["peak_rss_mb"] > 0
        assert len(r["samples"]) == 2
    noadapt = [r for r in rows if r["method"] == "noadapt"]
    assert all(r["ratio_to_noadapt"] == 1.0 for r in noadapt)
    eva0 = [r for r in rows if r["method"] == "eva0"]
    assert all(0.0 <= r["outside_ort_share"] <= 1.0 for r in eva0)
    assert data["environment_start"]["onnxruntime"]
    assert "| eva0 | 4 |" in (tmp_path / "cost.md").read_text()
    assert (tmp_path / "cost.png").stat().st_size > 10_000


def test_bench_budget_rows_measure_their_forwards(calibrated_vit, tmp_path):
    """A budget row runs the controller's settled schedule: at 1.5 every other batch is
    adapted on (8 repetitions: 12 forwards per sample of 8), at 1.25 every fourth; NoAdapt
    and noadapt-shift read 1, full-rate EVA-0 2, from the forward counter."""
    from eva0_edge.bench import cost

    report = cost.run_bench(
        str(calibrated_vit), [2], ["noadapt-shift", "eva0"], repeats=8, warmup=0,
        threads=1, memory=False, progress=False, budgets=[1.25, 1.5],
    )
    forwards = {r["method"]: r["forwards_per_sample"] for r in report["rows"]}
    assert forwards == {"noadapt": 1.0, "noadapt-shift": 1.0, "eva0": 2.0,
                        "eva0 budget 1.25": 1.25, "eva0 budget 1.5": 1.5}
    assert report["budgets"] == [1.25, 1.5]
    budgeted = {r["method"]: r for r in report["rows"]}["eva0 budget 1.5"]
    assert budgeted["ms_per_sample"] == pytest.approx(sum(budgeted["samples"]) / 8)  # the mean
    cost.write_outputs(report, tmp_path)
    assert "| eva0 budget 1.5 | 2 |" in (tmp_path / "cost.md").read_text()


def test_budget_rows_go_up_to_each_methods_own_forwards():
    from eva0_edge.bench.cost import cost_cases

    names = [name for name, _, _ in cost_cases(["noadapt", "eva0", "foa@5", "tent"], [1.5, 4])]
    assert names == ["noadapt", "eva0", "foa@5", "tent", "eva0 budget 1.5", "foa@5 budget 1.5",
                     "foa@5 budget 4"]


def test_bench_refuses_a_budget_below_one_forward(small_vit, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", str(small_vit.onnx_path), "--budgets", "1.5,0.5"])
    assert exit_info.value.code == 2
    assert "a budget must be >= 1 forward per sample, got 0.5" in capsys.readouterr().err


def test_peak_memory_is_measured_in_a_fresh_process(small_vit):
    """A worker reports its own peak, not the (larger, torch-holding) parent's."""
    import numpy as np

    from eva0_edge.bench import cost
    from eva0_edge.bench.testbed.machine import process_peak_rss_mb

    ballast = np.ones(400 * 2**20 // 8)  # +400 MB in this process only
    parent = process_peak_rss_mb()
    child = cost.process_memory(str(small_vit.onnx_path), "noadapt", 2, 2, 1, None)["peak_rss_mb"]
    assert 0 < child < parent - 300
    del ballast


def test_bench_cli_with_tent_on_random_timm_arch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EVA0_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert main(["bench", "--arch", "vit_tiny_patch16_224", "--batch-sizes", "2", "--methods",
                 "eva0,tent", "--repeats", "1", "--warmup", "1", "--no-memory",
                 "--out", str(out), "-q"]) == 0
    rows = json.loads((out / "cost.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["noadapt", "eva0", "tent"]


def test_bench_refuses_unknown_method(small_vit, capsys):
    assert main(["bench", "--model", str(small_vit.onnx_path), "--methods", "magic"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_ort_profile_sums_kernel_time_by_operator(small_resnet_gn, tmp_path):
    from tests.fixtures import load_study

    ort_profile = load_study("ort-profile", "ort_profile")

    ort_profile.main(["--model", str(small_resnet_gn.onnx_path), "--batch", "2", "--steps", "2",
                      "--threads", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "profile.json").read_text())
    ops = {r["op"]: r for r in report["rows"]}
    assert {"Conv", "LayerNormalization"} <= set(ops)  # GN lowered to LayerNormalization
    assert ops["Conv"]["eva0_ms"] > 0 and ops["Conv"]["noadapt_ms"] > 0  # times: never compared
    assert report["total_eva0_ms"] == pytest.approx(sum(r["eva0_ms"] for r in report["rows"]))
    assert "| Conv |" in (tmp_path / "profile.md").read_text()


def test_quantize_reports_its_own_peak_memory_not_its_parents(tmp_path):
    """The quantize worker is spawned from a parent holding 400 MB more (as the speed table's
    parent holds the exported ViT-B): it reports its own peak."""
    import multiprocessing

    from eva0_edge.bench import quant_eval
    from eva0_edge.bench.testbed.machine import process_peak_rss_mb

    vit = SHIPPED_VIT
    calibration = tmp_path / "calibration.npy"
    np.save(calibration, quant_eval.calibration_images(str(vit))[:8])
    ballast = np.ones(400 * 2**20 // 8)
    ballast[::512] = 2.0  # touched: resident
    parent = process_peak_rss_mb()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        cost = pool.apply(quant_eval._quantize_measured, (
            str(vit), str(tmp_path / "q.onnx"), 8, str(calibration), "ptq4vit", False))
    assert 50 < cost["peak_rss_mib"] < parent - 300
    del ballast


def test_the_paired_gap_counts_only_the_images_the_two_files_disagree_on():
    from eva0_edge.bench.testbed.report import paired_gap

    integer = np.array([1, 1, 1, 0, 1, 0, 1, 1, 0, 0], bool)
    fake = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 0], bool)  # b = 3, c = 1 of N = 10
    assert paired_gap(integer, fake) == pytest.approx((20.0, 20.0, 3, 1))
    assert paired_gap(fake, fake)[:2] == (0.0, 0.0)


def test_quant_and_serve_benchmarks_write_their_outputs(tmp_path):
    from eva0_edge.bench import quant_eval, serve_load

    model = str(MODEL)
    quant_eval.main(["accuracy", "--model", model, "--limit", "20", "--paired-limit", "40",
                     "--threads", "1", "--out", str(tmp_path / "acc")])
    report = json.loads((tmp_path / "acc" / "quant_accuracy.json").read_text())
    assert set(report["results"]) == {"fp32", "w8a8", "w8a8 fake", "w6a6", "w6a6 fake"}
    assert set(report["integer_vs_fake"]) == {"w8a8", "w6a6"}
    assert report["paired_images"] == 40
    for gap in report["integer_vs_fake"].values():
        assert gap["clean_only_integer_right"] + gap["clean_only_fake_right"] <= 40
        assert gap["corrupted_gap_se"] >= 0
    assert len(report["results"]["w6a6"]["eva0"]["corrupted"]) == 15
    assert isinstance(report["claim"]["holds"], bool)
    quant_eval.main(["speed", "--model", model, "--batch-sizes", "1,4", "--repeats", "1",
                     "--warmup", "1", "--threads", "1", "--out", str(tmp_path / "speed")])
    speed = json.loads((tmp_path / "speed" / "quant_speed.json").read_text())
    files = {"fp32", "ptq4vit w8a8", "ptq4vit w6a6", "ptq4vit w8a8 fake", "int8 w8a8"}
    assert {r["precision"] for r in speed["rows"]} == files == set(speed["size_mib"])
    assert {(r["precision"], r["batch"]) for r in speed["rows"]} == {
        (f, b) for f in files for b in (1, 4)}
    assert all(c["peak_rss_mib"] > 50 for c in speed["quantize"].values())  # a real process
    assert (tmp_path / "speed" / "quant_speed.png").stat().st_size > 10_000
    serve_load.main(["--model", model, "--concurrency", "1,2", "--methods", "eva0",
                     "--requests", "3", "--warmup", "4", "--threads", "1",
                     "--delays", "adaptive,fixed", "--out", str(tmp_path / "load")])
    report = json.loads((tmp_path / "load" / "serve_load.json").read_text())
    assert [(r["delay"], r["concurrency"]) for r in report["rows"]] == [
        ("adaptive", 1), ("adaptive", 2), ("fixed", 1), ("fixed", 2)
    ]
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 for r in report["rows"])
    # the warmup is neither timed nor counted: the server's samples are the timed requests'
    assert [r["samples"] for r in report["rows"]] == [3, 6, 3, 6]
    # the server's own counter over each load: EVA-0 adapts (> 1), two forwards at most
    assert all(1.0 < r["forwards_per_sample"] <= 2.0 for r in report["rows"])
    assert (tmp_path / "load" / "serve_load.png").stat().st_size > 10_000


def test_serve_load_sends_the_corrupted_stream_in_order(tmp_path):
    from eva0_edge.bench import serve_load
    from eva0_edge.bench.testbed.datasets import TEST_SEED, corrupted_fmnist
    from eva0_edge.runtime.modelfile import read_metadata
    from eva0_edge.runtime.preprocess import preprocess_uint8

    metadata = read_metadata(MODEL)
    images = serve_load.stream_images(metadata, "gaussian_noise", batch=1)
    pixels, _ = corrupted_fmnist("test", "gaussian_noise", 5, TEST_SEED, progress=False)
    assert images.shape == (10000, *metadata.preprocessing.input_size)
    np.testing.assert_array_equal(images[:64], preprocess_uint8(pixels[:64],
                                                                metadata.preprocessing))
    assert serve_load.stream_images(metadata, "random", batch=3).shape[0] == 3
    assert serve_load.serve_options("eva0+async@1.5") == (
        "eva0", ("--async-adapt", "--budget", "1.5"))
    assert serve_load.serve_options("eva0@2") == ("eva0", ("--budget", "2.0"))
    assert serve_load.serve_options("noadapt") == ("noadapt", ())
    serve_load.main(["--model", str(MODEL), "--concurrency", "2", "--methods",
                     "noadapt,eva0+async@1.5", "--requests", "3", "--warmup", "1",
                     "--threads", "1", "--stream", "gaussian_noise", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "serve_load.json").read_text())
    assert report["stream"] == "gaussian_noise"
    assert [(r["method"], r["requests"]) for r in report["rows"]] == [
        ("noadapt", 6), ("eva0+async@1.5", 6)]
    assert "gaussian_noise severity-5 test images" in (tmp_path / "serve_load.md").read_text()


def test_serve_load_rounds_rotate_so_every_setting_runs_once_in_every_position():
    from eva0_edge.bench.serve_load import round_order

    sweep = ["noadapt", "noadapt-shift", "eva0+async@1.5"]
    order = round_order(sweep, 6)
    assert [r for r, _ in order] == [r for r in range(6) for _ in sweep]
    rounds = [[s for r, s in order if r == i] for i in range(6)]
    assert all(sorted(settings) == sorted(sweep) for settings in rounds)
    for position in range(len(sweep)):  # each setting twice in each position over six rounds
        assert sorted(settings[position] for settings in rounds) == sorted(sweep * 2)


def test_serve_load_table_is_the_median_of_interleaved_rounds(tmp_path):
    """Three rounds: medians of every measure, and the ratio to NoAdapt taken within each
    round (a slow round slows both) before the median."""
    from eva0_edge.bench import serve_load
    from eva0_edge.bench.testbed.machine import environment

    def row(index: int, method: str, images: float, p50: float) -> dict:
        return {"round": index, "method": method, "delay": "adaptive", "replicas": 0,
                "concurrency": 16, "batch": 1, "images_per_s": images, "p50_ms": p50,
                "p99_ms": 2 * p50, "rows_per_step": 10.0,
                "forwards_per_sample": None if method == "noadapt" else 1.5}

    rounds = [(100, 10, 90, 11), (50, 20, 50, 20), (120, 8, 60, 16)]  # round 1 slow for both
    report = {"rows": [r for i, (a, pa, b, pb) in enumerate(rounds)
                       for r in (row(i, "noadapt", a, pa), row(i, "eva0+async", b, pb))]}
    noadapt, adapting = serve_load.summary(report)
    assert (noadapt["images_per_s"], noadapt["p50_ms"], noadapt["images_vs_noadapt"]) == (
        100, 10, 1.0)
    assert noadapt["forwards_per_sample"] is None and adapting["forwards_per_sample"] == 1.5
    assert adapting["images_per_s"] == 60 and adapting["rounds"] == 3
    assert adapting["images_vs_noadapt"] == pytest.approx(0.9)  # of 0.9, 1.0, 0.5
    assert adapting["p50_vs_noadapt"] == pytest.approx(1.1)  # of 1.1, 1.0, 2.0
    assert adapting["p99_vs_noadapt"] == pytest.approx(1.1)  # p99 is 2 x p50 in each
    assert adapting["images_vs_noadapt_range"] == pytest.approx((0.5, 1.0))
    env = environment()
    report = {**report, "architecture": "a", "model": "m.onnx", "rounds": 3, "threads": 1,
              "max_delay_ms": 10.0, "environment_start": env, "environment_end": env}
    table = serve_load.markdown(report)
    assert ("| eva0+async | adaptive | plain | 16 | 1 | 60.0 | 0.90 (0.50-1.00) | 16.0 | "
            "1.10 (1.00-2.00) | 32.0 | 1.10 (1.00-2.00) |") in table
    assert "| noadapt | adaptive | plain | 16 | 1 | 100.0 | 1.00 | 10.0 | 1.00 | 20.0 | 1.00 |" \
        in table
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(report))
    serve_load.main(["--report", str(saved), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "serve_load.md").read_text() == table


def test_blackbox_table_runs_every_budget_and_writes_outputs(tmp_path):
    from eva0_edge.bench import blackbox

    vit = SHIPPED_VIT
    blackbox.main(["--model", str(vit), "--fps", "2,4", "--limit", "16",
                   "--batch-size", "16", "--threads", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "blackbox.json").read_text())
    assert report["forwards_per_sample"] == {
        m: {"2": 2.0, "4": 4.0} for m in ("foa-dagger", "eva0-clubs")
    }
    for row in report["accuracy"].values():
        assert all(0 <= v <= 100 for v in row.values())
    assert "| eva0-clubs |" in (tmp_path / "blackbox.md").read_text()
    assert (tmp_path / "blackbox.png").stat().st_size > 10_000
    assert "noadapt (prompt model)" in json.loads((tmp_path / "results.json").read_text())[
        "results"]


def test_serve_load_takes_its_load_from_perf_analyzer(tmp_path):
    """``--client perf_analyzer``: Triton's load generator drives the server (make
    perf-analyzer); the rows are its throughput and latency, the server's forward counts."""
    from eva0_edge.bench import serve_load

    serve_load.main(["--model", str(MODEL), "--concurrency", "1,2", "--methods", "noadapt,eva0",
                     "--requests", "20", "--threads", "1", "--client", "perf_analyzer",
                     "--out", str(tmp_path / "load")])
    report = json.loads((tmp_path / "load" / "serve_load.json").read_text())
    assert report["client"] == "perf_analyzer"
    assert [(r["method"], r["concurrency"]) for r in report["rows"]] == [
        ("noadapt", 1), ("noadapt", 2), ("eva0", 1), ("eva0", 2)]
    for row in report["rows"]:
        assert row["images_per_s"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0
        assert row["requests"] >= 20 * row["concurrency"]  # at least one window's count
    assert {r["forwards_per_sample"] for r in report["rows"][:2]} == {1.0}
    eva0 = [r["forwards_per_sample"] for r in report["rows"][2:]]
    assert eva0[0] > 1.0 and all(1.0 <= f <= 2.0 for f in eva0)  # then the guard may pause:
    # the requests repeat one random image
