"""The device runtime must import and run with torch absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is not available on the device")
            return None
    sys.meta_path.insert(0, _NoTorch())
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300,
    )


def test_runtime_imports_without_torch():
    result = run_without_torch(
        """
        import importlib, pkgutil
        import eva0_edge.runtime as runtime
        for info in pkgutil.walk_packages(runtime.__path__, "eva0_edge.runtime."):
            importlib.import_module(info.name)  # the server subpackage included
        assert "torch" not in sys.modules
        assert "ray" not in sys.modules  # the fleet's engine stays out of the device runtime
        tools = [m for m in sys.modules
                 if m.split(".")[:2] in (["eva0_edge", "bench"], ["eva0_edge", "exporter"],
                                         ["eva0_edge", "quant"], ["eva0_edge", "fleet"])]
        assert not tools, tools  # the device runtime never reaches into the tool packages
        try:
            import torch  # noqa: F401
        except ImportError:
            print("blocked")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "blocked" in result.stdout


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
        x = np.zeros((2, 3, 32, 32), dtype=np.float32)
        for name in ("foa", "foa-dagger@5", "eva0-clubs@4"):
            model = load_method({str(prompt_vit.onnx_path)!r}, name, provider="cpu")
            assert model.step(x).shape == (2, 10)
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
