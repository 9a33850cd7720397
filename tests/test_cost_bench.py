"""The cost benchmark runs on a small model and writes its outputs (no time is asserted)."""

from __future__ import annotations

import json

from eva0_edge.runtime.cli import main


def test_bench_writes_tables_json_and_png(small_vit, tmp_path, capsys):
    from eva0_edge.bench import cost

    report = cost.run_bench(
        str(small_vit.onnx_path), [1, 4], ["eva0", "zoa", "foa"], repeats=2, warmup=1,
        threads=1, memory=True, progress=False,
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


def test_peak_memory_is_measured_in_a_fresh_process(small_vit):
    """A worker reports its own peak, not the (larger, torch-holding) parent's."""
    import numpy as np

    from eva0_edge.bench import cost

    ballast = np.ones(400 * 2**20 // 8)  # +400 MB in this process only
    parent = cost.process_peak_rss_mb()
    child = cost.peak_rss_mb(str(small_vit.onnx_path), "noadapt", 2, 2, 1, None)
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
