"""State bytes are validated before they are used: a re-signed state is still refused when a
value makes no sense, and archive sizes are checked from the headers before decompressing."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from eva0_edge.runtime.engine import AdaptiveModel
from eva0_edge.runtime.state import StateError, encode_state
from tests.conftest import uniform_batch


@pytest.fixture()
def adapted(calibrated_vit) -> AdaptiveModel:
    model = AdaptiveModel.load(calibrated_vit, "eva0", provider="cpu")
    model.step(uniform_batch(4))
    return model


def _resigned(model: AdaptiveModel, **changes) -> bytes:
    """The model's state with ``changes``, re-encoded with a valid checksum and fingerprint."""
    state = model.state.copy()
    for name, value in changes.items():
        setattr(state, name, value)
    return encode_state(state, model.fingerprint, {})


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"theta": "nan"}, "NaN"),
        ({"center": "inf"}, "NaN or infinite"),
        ({"step": "abc"}, "step must be an integer"),
        ({"step": -1}, "out of range"),
        ({"stat_weight": 3.0}, "out of range"),
        ({"coef_scale": float("nan")}, "out of range"),
        ({"seed": True}, "seed must be an integer"),
    ],
)
def test_resigned_nonsense_is_refused_and_the_state_kept(adapted, changes, match):
    values = {}
    for name, value in changes.items():
        if value in ("nan", "inf"):
            array = getattr(adapted.state, name).copy()
            array[0] = float(value)
            value = array
        values[name] = value
    before = adapted.state_dict()
    with pytest.raises(StateError, match=match):
        adapted.load_state_bytes(_resigned(adapted, **values))
    np.testing.assert_array_equal(adapted.state.theta, before["theta"])
    assert adapted.state.step == before["step"]


def test_oversized_members_are_refused_from_the_headers(adapted):
    """A 16 MiB theta that compresses to a few KB is refused before decompressing."""
    meta = {"version": 2, "fingerprint": adapted.fingerprint, "scalars": {}, "sha256": ""}
    buf = io.BytesIO()
    huge = np.zeros(2**22, dtype=np.float32)
    np.savez_compressed(buf, __meta__=np.array(json.dumps(meta)), theta=huge)
    data = buf.getvalue()
    assert len(data) < 2**16
    with pytest.raises(StateError, match="unpacks to"):
        adapted.parse_state_bytes(data)
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.array(json.dumps(meta)), surprise=np.zeros(3))
    with pytest.raises(StateError, match="unknown member"):
        adapted.parse_state_bytes(buf.getvalue())
    with pytest.raises(StateError, match="unreadable"):
        adapted.parse_state_bytes(b"")


def test_a_valid_state_round_trips(adapted, calibrated_vit):
    fresh = AdaptiveModel.load(calibrated_vit, "eva0", provider="cpu")
    fresh.install_state(fresh.parse_state_bytes(adapted.state_bytes()))
    np.testing.assert_array_equal(fresh.state.theta, adapted.state.theta)
