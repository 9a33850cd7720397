"""State bytes are validated before they are used: a re-signed state is still refused when a
value makes no sense, and archive sizes are checked from the headers before decompressing."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.state import StateError
from tests.component.test_state_validation import _archive, _resigned
from tests.fixtures import uniform_batch


@pytest.fixture()
def adapted(calibrated_vit) -> Policy:
    model = Policy.load(calibrated_vit, "eva0", provider="cpu")
    model.step(uniform_batch(4))
    return model


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
    fresh = Policy.load(calibrated_vit, "eva0", provider="cpu")
    fresh.install_state(fresh.parse_state_bytes(adapted.state_bytes()))
    np.testing.assert_array_equal(fresh.state.theta, adapted.state.theta)


def _npy(header: dict, payload: bytes = b"") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + payload


@pytest.mark.parametrize(
    "members,match",
    [
        ({"theta.npy": _npy({"descr": "<f4", "fortran_order": False, "shape": (2**40,)})},
         "declares a float32 array of shape \\[1099511627776\\]"),
        ({"theta.npy": _npy({"descr": "|O", "fortran_order": False, "shape": (3,)})},
         "Python objects"),
        ({"theta.npy": _npy({"descr": "<i8", "fortran_order": False, "shape": (3,)}, b"\0" * 24)},
         "declares a int64 array"),
        ({"theta.npy": b"not an array"}, "not a readable array"),
        ({"__meta__.npy": _npy({"descr": "<f8", "fortran_order": False, "shape": (1,)},
                               b"\0" * 8)}, "must hold one string"),
    ],
)
def test_array_headers_are_read_before_any_array_is_allocated(adapted, members, match):
    with pytest.raises(StateError, match=match):
        adapted.parse_state_bytes(_archive(members))


@pytest.mark.parametrize(
    "meta,match",
    [
        ([1, 2], "must be a JSON object"),
        ({"version": "3"}, "version must be an integer"),
        ({"version": 2.5}, "version must be an integer"),
        ({"version": 99}, "newer than this runtime"),
    ],
)
def test_crafted_metadata_is_refused_by_name(adapted, meta, match):
    arrays = {name: getattr(adapted.state, name) for name in ("theta", "anchor", "center", "mean",
              "second_moment", "velocity", "healthy_theta")}
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.array(json.dumps(meta)), **arrays)
    with pytest.raises(StateError, match=match):
        adapted.parse_state_bytes(buf.getvalue())
