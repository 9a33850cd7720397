"""The bench's GPU memory reading, behind a stand-in for NVML: the process's own bytes when
NVML lists its PID, the device's growth otherwise; a peak caught between two readings; the
table and the ratios built from them."""

from __future__ import annotations

import pytest

from eva0_edge.bench import cost


def test_bench_table_and_ratios_carry_gpu_memory(monkeypatch, small_vit):
    """run_bench on CUDA records every method's GPU memory and its ratio to NoAdapt's (the
    memory workers stand in: no GPU here)."""
    gpu = {"noadapt": 800.0, "eva0": 880.0}

    def worker(model_path, method, batch, steps, threads, spec, prompt, provider):
        assert provider == "cpu"
        return {"peak_rss_mb": 100.0, "gpu_load_mb": 700.0, "gpu_peak_mb": gpu[method],
                "gpu_source": "process"}

    monkeypatch.setattr(cost, "process_memory", worker)
    report = cost.run_bench(str(small_vit.onnx_path), [2], ["eva0"], repeats=1, warmup=0,
                            progress=False)
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["eva0"]["gpu_ratio_to_noadapt"] == pytest.approx(1.10)
    table = cost.markdown(report)
    assert "GPU peak x NoAdapt" in table and "| 700 / 880 | 1.10 |" in table
