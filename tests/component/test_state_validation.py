"""State bytes are validated before they are used: a re-signed state is still refused when a
value makes no sense, and archive sizes are checked from the headers before decompressing."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from eva0_edge.runtime.policy import Policy
from eva0_edge.runtime.state import StateError, encode_state
from tests.fixtures import SHIPPED_VIT, uniform_batch


def _resigned(model: Policy, **changes) -> bytes:
    """The model's state with ``changes``, re-encoded with a valid checksum and fingerprint."""
    state = model.state.copy()
    for name, value in changes.items():
        setattr(state, name, value)
    return encode_state(state, model.fingerprint, {})




@pytest.fixture(scope="module")
def shifted() -> Policy:
    """The shipped ViT with EVA-0 (its activation shift on), a few steps into a stream."""
    model = Policy.load(SHIPPED_VIT, "eva0", provider="cpu", threads=1)
    for seed in range(4):
        model.step(uniform_batch(16, seed) * 0.5)
    return model


def _far(model: Policy, name: str, scale: float, dtype=np.float32) -> np.ndarray:
    """``name`` moved ``scale`` along a unit direction from where it is."""
    value = getattr(model.state, name).astype(np.float64)
    return (value + scale / np.sqrt(value.size)).astype(dtype)


@pytest.mark.parametrize(
    "changes,match",
    [
        (lambda m: {"theta": np.full(m.metadata.num_params, 1e300)}, "beyond float32's range"),
        (lambda m: {"theta": _far(m, "theta", 1e30)}, "state theta is 1e\\+30 from theta0"),
        (lambda m: {"theta": _far(m, "theta", 100.0)}, "state theta is .* from theta0"),
        (lambda m: {"anchor": _far(m, "anchor", 1e30)}, "state anchor is"),
        (lambda m: {"healthy_theta": _far(m, "healthy_theta", 1e3)}, "state healthy_theta is"),
        (lambda m: {"velocity": _far(m, "velocity", 1e9)}, "state velocity would move theta"),
        (lambda m: {"pause_left": 2**50}, "pause_left = 1125899906842624 exceeds"),
        (lambda m: {"skipped": m.state.step + 1}, "skipped = .* exceeds step"),
        (lambda m: {"shift_mean": _far(m, "shift_mean", 1e6, np.float64),
                    "shift_sq": 1e13}, "state shift_mean is .* from the source head mean"),
        (lambda m: {"shift_sq": 1e6}, r"state shift_sq = 1e\+06 is over"),
        (lambda m: {"shift_sq": 0.0}, "below the squared norm of shift_mean"),
        (lambda m: {"second_moment": m.state.second_moment * 1e6}, "second_moment sums to"),
        (lambda m: {"anchor_credit": 1e300}, "anchor_credit = 1e\\+300 is not below 1"),
        (lambda m: {"balance_in": 1e30}, "balance_in = 1e\\+30 is over"),
        (lambda m: {"balance_out": 1e30}, "balance_out = 1e\\+30 is over"),
        (lambda m: {"center": _far(m, "center", 1e4, np.float64)},
         "state center is .* from the source's logits"),
        (lambda m: {"mean": np.sqrt(m.state.second_moment) + 1.0},
         r"second_moment\[\d+\] = .* is below mean\[\d+\]\^2"),
    ],
)
def test_a_state_the_model_cannot_survive_is_refused(shifted, changes, match):
    """Well-formed, re-signed, finite, and still refused: every field is held to what
    adaptation could have produced on this model (:mod:`eva0_edge.runtime.statelimits`)."""
    before = shifted.state_bytes()
    with pytest.raises(StateError, match=match):
        shifted.load_state_bytes(_resigned(shifted, **changes(shifted)))
    assert shifted.state_bytes() == before


def test_the_limits_hold_what_adaptation_reaches(shifted):
    """The other side: states of every method after a stream of shifted, noisy batches pass."""
    rng = np.random.default_rng(0)
    for method in ("eva0", "zoa", "spsa2-shared", "noadapt-shift"):
        model = Policy.load(SHIPPED_VIT, method, provider="cpu", threads=1)
        for step in range(12):
            batch = uniform_batch(8, step) * 0.3 + rng.normal(0.4, 0.3, (8, 3, 32, 32))
            model.step(np.clip(batch, -1, 1).astype(np.float32))
            model.parse_state_bytes(model.state_bytes())


def _archive(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buf.getvalue()


def _limits_and_state():
    from eva0_edge.runtime.state import AdaptState
    from eva0_edge.runtime.statelimits import StateLimits

    limits = StateLimits(theta0=np.zeros(4, dtype=np.float32), theta_radius=5.0, eta=0.5,
                         max_pause=100, shift_source=np.array([10.0, 0.0]), shift_radius=5.0,
                         shift_square_max=400.0, feature_energy=8.0,
                         center_source=np.array([1.0, 0.0, 0.0]), center_radius=5.0)
    state = AdaptState.initial(np.zeros(4), 3, 2, seed=0)
    state.stat_weight = 0.5
    state.shift_mean, state.shift_sq = np.array([10.0, 0.0]), 100.0
    state.shift_recent, state.shift_recent_sq = np.array([10.0, 0.0]), 100.0
    return limits, state


@pytest.mark.parametrize("field,value,ok,bad", [
    ("theta", "vector", [3.0, 4.0, 0.0, 0.0], [3.0, 4.001, 0.0, 0.0]),
    ("anchor", "vector", [0.0, 0.0, 3.0, -4.0], [0.0, 0.0, 3.0, -4.001]),
    ("healthy_theta", "vector", [5.0, 0.0, 0.0, 0.0], [5.001, 0.0, 0.0, 0.0]),
    ("velocity", "vector", [6.0, 8.0, 0.0, 0.0], [6.0, 8.01, 0.0, 0.0]),  # eta x 10 = 5
    ("pause_left", "scalar", 100, 101),
    ("second_moment", "vector", [5.0, 3.0], [5.0, 3.001]),  # energy 8
    ("shift_mean", "vector", [13.0, 4.0], [13.0, 4.001]),  # 5 from the source mean [10, 0]
    ("shift_sq", "scalar", 400.0, 400.1),
    ("shift_recent", "vector", [7.0, -4.0], [7.0, -4.001]),
    ("shift_recent_sq", "scalar", 400.0, 400.1),
    ("center", "vector", [4.0, 0.0, 4.0], [4.0, 0.0, 4.001]),  # 5 from [1, 0, 0]
])
def test_every_limit_holds_its_bound_itself_and_refuses_past_it(field, value, ok, bad):
    """A state exactly on a bound loads; a hair past it is refused, naming the field."""
    limits, state = _limits_and_state()
    convert = (lambda v: np.asarray(v, dtype=getattr(state, field).dtype)) if value == "vector" \
        else (lambda v: type(getattr(state, field))(v))
    if field in ("shift_mean", "shift_recent"):  # a mean needs the square of its samples
        state.shift_sq = state.shift_recent_sq = 400.0
    setattr(state, field, convert(ok))
    limits.check(state)
    setattr(state, field, convert(bad))
    with pytest.raises(StateError, match=field):
        limits.check(state)


def test_a_window_square_below_its_means_norm_is_refused_within_rounding_only():
    limits, state = _limits_and_state()
    state.shift_mean, state.shift_sq = np.array([10.0, 0.0]), 100.0  # equal: one sample
    limits.check(state)
    import dataclasses

    unshifted = dataclasses.replace(limits, shift_source=None)
    state.shift_mean, state.shift_sq = np.array([1e-7, 0.0]), 0.0  # 1e-14 below: rounding
    unshifted.check(state)
    state.shift_mean = np.array([10.0, 0.0])
    state.shift_sq = 99.5
    with pytest.raises(StateError, match="below the squared norm of shift_mean"):
        limits.check(state)
    state.shift_sq = 100.0
    state.shift_recent, state.shift_recent_sq = np.array([12.0, 0.0]), 143.0
    with pytest.raises(StateError, match="below the squared norm of shift_recent"):
        limits.check(state)


def _plain_dict() -> dict:
    from eva0_edge.runtime.state import AdaptState

    return AdaptState.initial(np.linspace(-1, 1, 4), 3, 2, seed=5).to_dict()


@pytest.mark.parametrize("ready,weight", [(True, 1.0), (False, 0.0)])
def test_a_version_one_state_loads_with_its_defaults(ready, weight):
    from eva0_edge.runtime.state import AdaptState

    old = _plain_dict()
    for name in ("stat_weight", "healthy_theta", "coef_scale", "coef_weight", "clipped_coefs",
                 "clipped_steps", "guard_trips", "pause_left", "frozen", "budget_fill"):
        old.pop(name)
    old["moments_ready"] = ready
    state = AdaptState.from_dict(old)
    assert state.stat_weight == weight and state.moments_ready is ready
    np.testing.assert_array_equal(state.healthy_theta, old["theta"])
    assert (state.coef_scale, state.coef_weight, state.clipped_coefs, state.guard_trips,
            state.pause_left, state.frozen, state.budget_fill) == (0.0, 0.0, 0, 0, 0, False, 1.0)
    new = {**_plain_dict(), "stat_weight": 0.25, "moments_ready": True}
    assert AdaptState.from_dict(new).stat_weight == 0.25  # the newer field wins
    with pytest.raises(StateError, match="lacks"):
        AdaptState.from_dict({k: v for k, v in _plain_dict().items() if k != "step"})


@pytest.mark.parametrize("name,value,ok", [
    ("step", 2**53, True), ("step", 2**53 + 1, False), ("step", True, False),
    ("step", 3.0, False), ("step", -1, False), ("seed", np.int64(7), True),
    ("seed", 2**63 - 1, True), ("seed", 2**63, False),
    ("stat_weight", 1.0, True), ("stat_weight", 1.5, False), ("stat_weight", True, False),
    ("stat_weight", -0.1, False), ("stat_weight", float("nan"), False),
    ("coef_scale", 1e30, True), ("coef_scale", float("inf"), False),
    ("coef_scale", "1", False), ("frozen", 1, False),
    ("skipped", 3, True), ("skipped", 4, False), ("clipped_steps", 3, True),
    ("clipped_steps", 4, False), ("guard_trips", 3, True), ("guard_trips", 4, False),
])
def test_every_scalar_of_a_state_is_checked(name, value, ok):
    """(The step counters count steps: at most ``step``, 3 here.)"""
    from eva0_edge.runtime.state import AdaptState

    values = {**_plain_dict(), "step": 3, name: value}
    if ok:
        assert getattr(AdaptState.from_dict(values), name) == value
    else:
        with pytest.raises(StateError, match=name):
            AdaptState.from_dict(values)


def test_shift_windows_hold_at_most_their_size_the_rest_exactly():
    from eva0_edge.runtime.state import AdaptState, check_state_sizes

    sizes = {"theta": 4, "shift_mean": 2, "shift_recent": 2}
    state = AdaptState.from_dict(_plain_dict())
    state.shift_mean = np.zeros(2)
    check_state_sizes(state, sizes)  # a full window
    state.shift_mean = np.zeros(0)
    check_state_sizes(state, sizes)  # an empty one
    state.shift_recent = np.zeros(3)
    with pytest.raises(StateError, match="shift_recent has 3 values"):
        check_state_sizes(state, sizes)
    with pytest.raises(StateError, match="theta has shape"):
        check_state_sizes(state, {"theta": 5})


def test_a_state_file_round_trips_and_a_missing_or_foreign_one_is_named(tmp_path):
    from eva0_edge.runtime.state import (
        AdaptState,
        encode_state,
        read_state_file,
        write_state_file,
    )

    state = AdaptState.from_dict(_plain_dict())
    path = write_state_file(tmp_path / "s.npz", encode_state(state, "fp-a", {"method": "eva0"}))
    loaded, info = read_state_file(path, "fp-a")
    np.testing.assert_array_equal(loaded.theta, state.theta)
    assert info["method"] == "eva0"
    with pytest.raises(StateError, match=f"{path}: .*another model"):
        read_state_file(path, "fp-b")
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        read_state_file(tmp_path / "missing.npz")


def test_an_empty_long_window_does_not_skip_the_short_windows_check():
    limits, state = _limits_and_state()
    state.shift_mean, state.shift_sq = np.zeros(0), 0.0
    state.shift_recent, state.shift_recent_sq = np.array([12.0, 0.0]), 100.0
    with pytest.raises(StateError, match="below the squared norm of shift_recent"):
        limits.check(state)


UNPICKLED: list[str] = []


class Marker:
    """Records being unpickled: a state must never unpickle anything."""

    def __init__(self) -> None:
        self.tag = 1  # a state to set: unpickling calls __setstate__

    def __setstate__(self, state) -> None:
        UNPICKLED.append("unpickled")


def _reencoded(meta_changes=None, arrays=None, drop=()) -> bytes:
    """A state archive re-written with ``meta_changes`` / ``arrays`` (the checksum kept)."""
    from eva0_edge.runtime.state import AdaptState

    data = encode_state(AdaptState.from_dict(_plain_dict()), "fp", {"method": "eva0"})
    with np.load(io.BytesIO(data)) as npz:
        meta = json.loads(str(npz["__meta__"]))
        members = {k: npz[k] for k in npz.files if k != "__meta__"}
    meta.update(meta_changes or {})
    for name in drop:
        meta.pop(name)
    members.update(arrays or {})
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.array(json.dumps(meta)), **members)
    return buf.getvalue()


def test_a_state_file_records_its_version_checksum_and_info():
    from eva0_edge.runtime.state import STATE_VERSION, decode_state

    data = _reencoded()
    with np.load(io.BytesIO(data)) as npz:
        meta = json.loads(str(npz["__meta__"]))
    assert meta["version"] == STATE_VERSION and meta["info"] == {"method": "eva0"}
    assert decode_state(data, "fp")[1] == {"method": "eva0"}
    assert decode_state(_reencoded(drop=("info",)))[1] == {}
    assert decode_state(_reencoded({"info": [1, 2]}))[1] == {}
    decode_state(_reencoded(drop=("version",)))  # before versions were written: version 0


@pytest.mark.parametrize("change,match", [
    ({"version": 99}, "newer than this runtime"),
    ({"version": True}, "version must be an integer"),
    ({"version": "3"}, "version must be an integer"),
    ({"scalars": [1]}, "no scalars"),
])
def test_a_state_with_bad_metadata_is_refused(change, match):
    from eva0_edge.runtime.state import decode_state

    with pytest.raises(StateError, match=match):
        decode_state(_reencoded(change))


def test_the_checksum_covers_values_dtype_and_shape():
    from eva0_edge.runtime.state import decode_state

    theta = _plain_dict()["theta"]
    flipped = theta.copy()
    flipped[0] += 1.0
    same_bytes = np.frombuffer(theta.tobytes(), dtype=np.float64)  # 4 float32 as 2 float64
    same_shape = theta.view(np.int32)  # the same bytes and shape, another dtype
    for changed in (flipped, same_bytes, same_shape, theta.reshape(2, 2)):
        with pytest.raises(StateError, match="checksum"):
            decode_state(_reencoded(arrays={"theta": changed}))


def test_members_are_checked_from_their_headers():
    from eva0_edge.runtime.state import decode_state

    sizes = {name: value.size for name, value in _plain_dict().items()
             if isinstance(value, np.ndarray)}
    sizes["shift_mean"] = sizes["shift_recent"] = 2
    decode_state(_reencoded(), sizes=sizes)
    for bad in (np.arange(4), np.zeros((2, 2))):  # ints, 2-D: refused before loading
        with pytest.raises(StateError, match="declares"):
            decode_state(_reencoded(arrays={"theta": bad}), sizes=sizes)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        with np.load(io.BytesIO(_reencoded())) as npz:
            for name in npz.files:
                with archive.open(f"{name}.npy", "w") as member:
                    value = np.array([str(npz[name])]) if name == "__meta__" else npz[name]
                    np.lib.format.write_array(member, value, version=(2, 0))
    with pytest.raises(StateError, match="'__meta__' must hold one string"):
        decode_state(buf.getvalue(), sizes=sizes)


def test_a_version_2_npy_member_loads():
    from eva0_edge.runtime.state import decode_state

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive, np.load(io.BytesIO(_reencoded())) as npz:
        for name in npz.files:
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, npz[name], version=(2, 0))
    sizes = {name: value.size for name, value in _plain_dict().items()
             if isinstance(value, np.ndarray)}
    state, _ = decode_state(buf.getvalue(), sizes=sizes)
    np.testing.assert_array_equal(state.theta, _plain_dict()["theta"])


def test_a_pickled_member_is_never_unpickled():
    from eva0_edge.runtime.state import decode_state

    data = _reencoded(arrays={"theta": np.array([Marker()], dtype=object)})
    with pytest.raises(StateError):
        decode_state(data)
    assert UNPICKLED == []


def test_array_fields_are_one_dimensional_floats_kept_in_their_dtypes():
    from eva0_edge.runtime.state import AdaptState

    big = np.finfo(np.float32).max
    state = AdaptState.from_dict({**_plain_dict(), "theta": np.array([big, 0, 0, 0], np.float64)})
    assert state.theta.dtype == np.float32 and state.theta[0] == big  # float32's edge fits
    assert state.center.dtype == np.float64
    for name, value, match in [
        ("theta", np.zeros((2, 2)), "1-D float"),
        ("theta", np.arange(4), "1-D float"),
        ("second_moment", np.array([1.0, -1e-9]), "negative"),
        ("theta", np.array([float(big) * 2.0, 0, 0, 0]), "float32's range"),
    ]:
        with pytest.raises(StateError, match=match):
            AdaptState.from_dict({**_plain_dict(), name: value})


def test_a_member_may_unpack_to_its_float64_size_plus_a_header_and_no_more(tmp_path):
    """The limit is 8 bytes per element plus ``_NPY_HEADER_BYTES`` (1024), exactly; a state
    file read with sizes is held to it."""
    from eva0_edge.runtime.state import (
        _NPY_HEADER_BYTES,
        check_member_sizes,
        read_state_file,
        write_state_file,
    )

    def archive(total: int) -> bytes:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": "<f8", "fortran_order": False, "shape": (4,)})
        member = header.getvalue() + b"\0" * (total - len(header.getvalue()))
        return _archive({"theta.npy": member})

    limit = 4 * 8 + _NPY_HEADER_BYTES
    check_member_sizes(archive(limit), {"theta": 4})
    with pytest.raises(StateError, match=f"unpacks to {limit + 1} bytes"):
        check_member_sizes(archive(limit + 1), {"theta": 4})
    path = write_state_file(tmp_path / "big.npz", archive(limit + 1))
    with pytest.raises(StateError, match="unpacks to"):
        read_state_file(path, sizes={"theta": 4})


def test_an_initial_state_holds_theta_in_float32_and_its_seed():
    from eva0_edge.runtime.state import AdaptState

    state = AdaptState.initial(np.linspace(-1, 1, 4), 3, 2, seed=9)  # float64 given
    assert state.theta.dtype == state.anchor.dtype == state.velocity.dtype == np.float32
    assert state.healthy_theta.dtype == np.float32 and state.seed == 9


def test_an_empty_bank_writes_no_bank_members_and_a_full_one_all_of_them():
    """A reader that knows no bank (a version-3 reader's sizes, the fleet's) takes a state with
    an empty bank; a state with a bank keeps every bank array through a round trip."""
    from eva0_edge.runtime.state import BANK_ARRAYS, AdaptState, decode_state

    state = AdaptState.from_dict(_plain_dict())
    data = encode_state(state, "fp", {})
    assert not {f"{name}.npy" for name in BANK_ARRAYS} & set(zipfile.ZipFile(io.BytesIO(data))
                                                           .namelist())
    sizes = {name: getattr(state, name).size or 4 for name in
             ("theta", "anchor", "velocity", "healthy_theta", "center", "mean",
              "second_moment", "shift_mean", "shift_recent")}
    loaded, _ = decode_state(data, "fp", sizes)
    np.testing.assert_array_equal(loaded.theta, state.theta)
    for name in BANK_ARRAYS:
        setattr(state, name, np.arange(3, dtype=np.float64) + 1)
    loaded, _ = decode_state(encode_state(state, "fp", {}))
    for name in BANK_ARRAYS:
        np.testing.assert_array_equal(getattr(loaded, name), getattr(state, name))


def test_a_server_reads_back_its_own_state_after_traffic_at_the_counters_limit():
    """A state installed at the counters' limit steps on, and what it writes is read back: the
    written counters saturate at 2^53 (issue 50: a step of 2^63 - 1 was accepted, four requests
    later the server's own state was refused and every snapshot with it)."""
    from eva0_edge.runtime.policy import Policy
    from eva0_edge.runtime.state import COUNT_LIMIT, decode_state
    from tests.fixtures import SHIPPED_RESNET_GN, uniform_batch

    policy = Policy.load(SHIPPED_RESNET_GN, "eva0", {"guard": False}, seed=0, provider="cpu")
    state = policy.state
    state.step = state.skipped = state.clipped_steps = COUNT_LIMIT - 1
    for i in range(4):
        policy.step(uniform_batch(4, seed=i))
    assert policy.state.step == COUNT_LIMIT + 3
    read, _ = decode_state(policy.state_bytes())
    assert read.step == COUNT_LIMIT and read.skipped <= read.step
