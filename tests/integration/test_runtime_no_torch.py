"""The device runtime must import and run with torch absent."""

from __future__ import annotations

from tests.fixtures import run_without_torch


def test_info_runs_without_torch(small_vit):
    result = run_without_torch(
        f"""
        from eva0_edge.cli import main
        assert main(["info", {str(small_vit.onnx_path)!r}]) == 0
        assert "torch" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr
    assert "family vit" in result.stdout


def test_prompt_methods_run_without_torch(prompt_vit):
    result = run_without_torch(
        f"""
        import numpy as np
        from eva0_edge.runtime.methods import load_method
        from eva0_edge.runtime.session import SessionSettings
        x = np.zeros((2, 3, 32, 32), dtype=np.float32)
        for name in ("foa", "foa-dagger@5", "eva0-clubs@4"):
            model = load_method({str(prompt_vit.onnx_path)!r}, name,
                                session=SessionSettings(provider="cpu"))
            assert model.step(x).shape == (2, 10)
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
