"""The EVA-0 engine on a real exported model: estimator quality, update maths, state, guards."""

from __future__ import annotations

import numpy as np
import pytest

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.session import InputError
from tests.fixtures import SHIPPED_RESNET_GN


@pytest.mark.parametrize("value, match", [(np.nan, "NaN"), (255.0, "range")])
def test_bad_input_to_the_shift_alone_is_refused_before_it_learns(value, match):
    """noadapt-shift (serving only, its activation shift learning) refuses a bad batch before
    the shift's window sees it."""
    path = SHIPPED_RESNET_GN
    model = Policy.load(path, "noadapt-shift", threads=1)
    assert model.shift is not None
    model.step(np.zeros((4, *model.metadata.preprocessing.input_size), np.float32))
    before = model.state_dict()
    bad = np.full((2, *model.metadata.preprocessing.input_size), value, np.float32)
    with pytest.raises(InputError, match=match):
        model.step(bad)
    for key, value_before in before.items():
        np.testing.assert_array_equal(model.state_dict()[key], value_before)


def test_loading_parses_the_file_once(monkeypatch, tmp_path):
    """The runtime reads the metadata from ORT's own parse (no onnx.load of the weights; the
    split sessions' parts are cut once, on first use, then read from the cache), and a file
    that is not ONNX is refused with its name."""
    import onnx

    from eva0_edge.runtime.metadata import ModelFormatError
    from tests.fixtures import MODEL

    def no_second_parse(*args, **kwargs):
        raise AssertionError("onnx.load called on the device path")

    monkeypatch.setenv("EVA0_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    for split in (None, True, False):
        with pytest.raises(ModelFormatError, match="bad.onnx"):
            Policy.load(bad, provider="cpu", split=split)
    assert Policy.load(MODEL, "eva0", provider="cpu").session.parts is not None
    monkeypatch.setattr(onnx, "load", no_second_parse)
    for split in (None, False):
        model = Policy.load(MODEL, "eva0", provider="cpu", split=split)
        assert model.metadata.architecture and model.config.eta > 0
