"""Issue 48 item 3, the rough edges a user with their own model meets first (the parts that need
no model file): the classifier head read in every form an exporter or quantizer leaves it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from eva0_edge.runtime.head import HeadError, read_head
from eva0_edge.runtime.metadata import Segment

K, D = 5, 8  # classes, head-input width
RNG = np.random.default_rng(0)
W = RNG.normal(size=(K, D)).astype(np.float32)
B = RNG.normal(size=K).astype(np.float32)
METADATA = SimpleNamespace(feature_layout=[Segment("head_input", 0, D)])


def _graph(nodes: list, initializers: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``features`` [N, D] -> ``nodes`` -> ``logits`` [N, K]."""
    graph = helper.make_graph(
        nodes, "head",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", D])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", K])],
        [numpy_helper.from_array(value, name) for name, value in initializers.items()],
    )
    return helper.make_model(graph)


def _int8(weight: np.ndarray, axis: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-channel symmetric int8 codes of ``weight`` along ``axis``: the initializers of a
    DequantizeLinear ``w_q, w_s, w_z`` and the weight they dequantize to."""
    other = tuple(i for i in range(weight.ndim) if i != axis)
    scale = (np.abs(weight).max(axis=other) / 127).astype(np.float32)
    shape = [1] * weight.ndim
    shape[axis] = -1
    codes = np.round(weight / scale.reshape(shape)).astype(np.int8)
    return ({"w_q": codes, "w_s": scale, "w_z": np.zeros_like(scale, np.int8)},
            codes.astype(np.float64) * scale.reshape(shape))


def _qdq(x: str, out: str) -> list:
    """QuantizeLinear -> DequantizeLinear of activation ``x`` into ``out`` (uint8, 128)."""
    return [helper.make_node("QuantizeLinear", [x, "a_s", "a_z"], [f"{x}_q"]),
            helper.make_node("DequantizeLinear", [f"{x}_q", "a_s", "a_z"], [out])]


ACT = {"a_s": np.float32(0.05), "a_z": np.uint8(128)}
MATMUL_W = {"w": W.T.copy()}
CONV_W = {"w": W.reshape(K, D, 1, 1)}
SHAPE = {"shape": np.array([-1, D, 1, 1], np.int64)}


def _conv(bias: bool) -> list:
    return [helper.make_node("Reshape", ["features", "shape"], ["x4"]),
            helper.make_node("Conv", ["x4", "w", "b"] if bias else ["x4", "w"], ["y4"]),
            helper.make_node("Flatten", ["y4"], ["logits"])]


FLOAT_FORMS = {
    "gemm": ([helper.make_node("Gemm", ["features", "w", "b"], ["logits"], transB=1)],
             {"w": W, "b": B}, True),
    "gemm without C": ([helper.make_node("Gemm", ["features", "w"], ["logits"], transB=1)],
                       {"w": W}, False),
    "gemm, B not transposed": ([helper.make_node("Gemm", ["features", "w"], ["logits"])],
                               MATMUL_W, False),
    "matmul + add": ([helper.make_node("MatMul", ["features", "w"], ["y"]),
                      helper.make_node("Add", ["y", "b"], ["logits"])],
                     {**MATMUL_W, "b": B}, True),
    "add, bias first": ([helper.make_node("MatMul", ["features", "w"], ["y"]),
                         helper.make_node("Add", ["b", "y"], ["logits"])],
                        {**MATMUL_W, "b": B}, True),
    "matmul, the bias dropped": ([helper.make_node("MatMul", ["features", "w"], ["logits"])],
                                 MATMUL_W, False),
    "1x1 conv": (_conv(True), {**CONV_W, "b": B, **SHAPE}, True),
    "1x1 conv without bias": (_conv(False), {**CONV_W, **SHAPE}, False),
}


@pytest.mark.parametrize("form", list(FLOAT_FORMS))
def test_every_float_head_form_is_read_with_its_bias_or_a_zero_one(form):
    nodes, initializers, has_bias = FLOAT_FORMS[form]
    head = read_head(_graph(nodes, initializers), METADATA)
    np.testing.assert_array_equal(head.weight, W)
    np.testing.assert_array_equal(head.bias, B if has_bias else np.zeros(K))
    assert head.segment == slice(0, D) and head.norm is None


def _quantized_forms() -> dict[str, tuple[list, dict, np.ndarray]]:
    """What quant/'s QDQ encodings make of the forms: int8 weights behind DequantizeLinear, the
    input and the logits through a quantize/dequantize pair (the bias, when any, float)."""
    matmul_codes, matmul_w = _int8(W.T, axis=1)
    conv_codes, conv_w = _int8(W.reshape(K, D, 1, 1), axis=0)
    dq_matmul = helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=1)
    dq_conv = helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=0)
    dq_gemm = helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], axis=1)
    return {
        "int8 matmul, the bias dropped": (
            [*_qdq("features", "xq"), dq_matmul,
             helper.make_node("MatMul", ["xq", "w"], ["y"]), *_qdq("y", "logits")],
            {**matmul_codes, **ACT}, matmul_w.T),
        "int8 matmul + add": (
            [*_qdq("features", "xq"), dq_matmul, helper.make_node("MatMul", ["xq", "w"], ["y"]),
             helper.make_node("Add", ["y", "b"], ["logits"])],
            {**matmul_codes, **ACT, "b": B}, matmul_w.T),
        "int8 gemm without C": (
            [*_qdq("features", "xq"), dq_gemm, helper.make_node("Gemm", ["xq", "w"], ["y"]),
             *_qdq("y", "logits")],
            {**matmul_codes, **ACT}, matmul_w.T),
        "int8 1x1 conv without bias, output requantized": (
            [*_qdq("features", "xq"), helper.make_node("Reshape", ["xq", "shape"], ["x4"]),
             dq_conv, helper.make_node("Conv", ["x4", "w"], ["y4"]), *_qdq("y4", "y4q"),
             helper.make_node("Flatten", ["y4q"], ["logits"])],
            {**conv_codes, **ACT, **SHAPE}, conv_w.reshape(K, D)),
    }


@pytest.mark.parametrize("form", list(_quantized_forms()))
def test_every_quantized_head_form_is_read(form):
    nodes, initializers, weight = _quantized_forms()[form]
    head = read_head(_graph(nodes, initializers), METADATA)
    np.testing.assert_allclose(head.weight, weight, rtol=1e-12)
    np.testing.assert_array_equal(head.bias, B if "add" in form else np.zeros(K))


@pytest.mark.parametrize("nodes, initializers, message", [
    ([helper.make_node("Mul", ["features", "s"], ["logits"])], {"s": np.float32(2)}, "Mul node"),
    ([helper.make_node("Reshape", ["features", "shape"], ["x4"]),
      helper.make_node("Conv", ["x4", "w"], ["y4"], pads=[1, 1, 1, 1]),
      helper.make_node("Flatten", ["y4"], ["logits"])],
     {"w": np.zeros((K, D, 3, 3), np.float32), **SHAPE}, "1x1"),
    ([helper.make_node("MatMul", ["features", "w"], ["y"]),
      helper.make_node("Relu", ["y"], ["r"]),
      helper.make_node("Add", ["r", "b"], ["logits"])], {**MATMUL_W, "b": B}, "constant bias"),
])
def test_a_head_that_is_not_affine_is_refused_in_words(nodes, initializers, message):
    with pytest.raises(HeadError, match=message):
        read_head(_graph(nodes, initializers), METADATA)


# --set values: words for booleans and None, coerced to the field's type, refused in words


@pytest.mark.parametrize("text, value", [
    ("true", True), ("TRUE", True), ("Yes", True), ("on", True), ("True", True),
    ("false", False), ("No", False), ("OFF", False), ("none", None), ("NULL", None),
    ("None", None), ("0.001", 0.001), ("256", 256), ("1e-3", 1e-3), (" 2 ", 2),
    ("[1, 1, 1, 1]", [1, 1, 1, 1]), ("[on, off, none]", [True, False, None]),
    ("groupnorm", "groupnorm"), ("", ""),
])
def test_a_set_value_reads_words_numbers_and_lists(text, value):
    from eva0_edge.runtime.config import parse_key_values

    parsed = parse_key_values([f"key={text}"])["key"]
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("item, key, value", [
    ("guard=on", "guard", True), ("guard=1", "guard", True), ("guard=0", "guard", False),
    ("forwards=4.0", "forwards", 4), ("shift_max=none", "shift_max", None),
    ("guard_audit=null", "guard_audit", None), ("eta=1", "eta", 1),
])
def test_a_set_value_is_coerced_to_the_fields_type(item, key, value):
    from argparse import Namespace

    from eva0_edge.runtime.cli import method_overrides
    from eva0_edge.runtime.config import AdaptConfig

    config = AdaptConfig().updated(method_overrides(Namespace(set=[item], budget=None)))
    assert getattr(config, key) == value and type(getattr(config, key)) is type(value)


def test_foa_settings_take_the_words_too():
    from eva0_edge.runtime.config import parse_key_values
    from eva0_edge.runtime.foa import FOAConfig

    config = FOAConfig().updated(parse_key_values(["shift=off", "forwards=6.0", "budget=null"]))
    assert config.shift is False and config.forwards == 6 and config.budget is None


@pytest.mark.parametrize("item, message", [
    ("eta=abc", "hyper-parameter eta must be a number, got 'abc'"),
    ("eta=none", "hyper-parameter eta must be a number, got None"),
    ("guard=2", "hyper-parameter guard must be a boolean (true/false, yes/no, on/off), got 2"),
    ("guard=maybe", "hyper-parameter guard must be a boolean"),
    ("forwards=2.5", "hyper-parameter forwards must be an integer, got 2.5"),
    ("forwards=true", "hyper-parameter forwards must be an integer, got True"),
    ("shift_max=far", "hyper-parameter shift_max must be a number or none, got 'far'"),
])
def test_a_set_value_of_the_wrong_type_is_refused_naming_key_and_type(item, message):
    from eva0_edge.runtime.config import AdaptConfig, parse_key_values

    with pytest.raises(ValueError) as err:
        AdaptConfig().updated(parse_key_values([item]))
    assert message in str(err.value)


def test_a_tuning_grid_reads_values_as_set_does():
    from eva0_edge.bench.testbed.tuning import parse_grid

    assert parse_grid(["guard=on,OFF", "shift_max=none,2"]) == [
        {"guard": True, "shift_max": None}, {"guard": True, "shift_max": 2},
        {"guard": False, "shift_max": None}, {"guard": False, "shift_max": 2},
    ]


def test_a_listening_url_brackets_ipv6_hosts():
    from eva0_edge.runtime.server.runner import free_port, listening_url

    assert listening_url(("127.0.0.1", 8000)) == "http://127.0.0.1:8000/"
    assert listening_url(("::1", 8000, 0, 0)) == "http://[::1]:8000/"
    assert 0 < free_port("127.0.0.1") < 65536
