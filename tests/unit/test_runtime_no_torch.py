"""The device runtime must import and run with torch absent."""

from __future__ import annotations

from tests.fixtures import run_without_torch


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
