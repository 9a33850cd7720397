"""The Open Inference Protocol (KServe v2) inference request and response, with Triton's binary
tensor data extension (so ``tritonclient.http`` works with its defaults).

A request body is a JSON object, optionally followed by binary tensor data; the
``Inference-Header-Content-Length`` header gives the JSON's length in bytes. Inputs carry their
data either as JSON (``data``) or as ``parameters.binary_data_size`` bytes of the binary part, in
input order. BYTES elements are 4-byte little-endian lengths followed by the bytes (binary), or
base64 strings (JSON). Outputs go back as JSON or binary, per ``parameters.binary_data`` on an
output or ``parameters.binary_data_output`` on the request.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_DIMENSION = 2**31 - 1  # no tensor dimension beyond this (ONNX Runtime's int32 limit)
# The JSON part of a request is parsed by Python's json module, which holds the GIL throughout
# and builds one Python object (~32 bytes) per value: its bytes and its values are bounded
# before parsing so that one request can neither stall the health routes nor blow up memory.
# Larger tensors go as binary data (Triton's binary extension; tritonclient's default).
MAX_JSON_BYTES = 16 * 2**20
MAX_JSON_VALUES = 2**18  # one full batch of 64 images of 3 x 32 x 32 as JSON numbers
MAX_ID_CHARS = 1024  # the request id is echoed in the response
MAX_BYTES_ELEMENTS = 4096  # BYTES elements per input (each becomes a Python bytes object)

_NUMPY = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}


class ProtocolError(ValueError):
    """A request the protocol refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class RequestedOutput:
    """One entry of the request's ``outputs``: name, binary or JSON, and its parameters."""

    name: str
    binary: bool
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """A parsed request: inputs by name (numpy arrays; BYTES as a list of ``bytes``)."""

    id: str | None
    inputs: dict[str, np.ndarray | list[bytes]]
    datatypes: dict[str, str]
    outputs: list[RequestedOutput] | None
    binary_output: bool


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIMENSION
        for d in value
    ):
        raise ProtocolError(
            f"input {name!r}: shape must be a list of integers in [0, {MAX_DIMENSION}]"
        )
    return tuple(value)


def _parameters(spec: dict, where: str) -> dict:
    """The ``parameters`` object of ``spec`` ({} when absent); 400 when it is not an object."""
    params = spec.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(f"{where}: 'parameters' must be a JSON object")
    return params


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    out: list = []
    for item in data:
        out.extend(_flatten(item))
    return out


def _decode_bytes_binary(raw: memoryview, count: int, name: str) -> list[bytes]:
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise ProtocolError(f"input {name!r}: truncated BYTES element length")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise ProtocolError(f"input {name!r}: BYTES element longer than its data")
        if len(items) == count:
            raise ProtocolError(f"input {name!r}: more BYTES elements than its shape's {count}")
        items.append(bytes(raw[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise ProtocolError(f"input {name!r}: {len(items)} BYTES elements for shape of {count}")
    return items


def _decode_bytes_json(data: Any, count: int, name: str) -> list[bytes]:
    flat = _flatten(data)
    if len(flat) != count or not all(isinstance(v, str) for v in flat):
        raise ProtocolError(f"input {name!r}: expected {count} base64 strings")
    try:
        return [base64.b64decode(v, validate=True) for v in flat]
    except (binascii.Error, ValueError) as err:
        raise ProtocolError(f"input {name!r}: BYTES data is not valid base64 ({err})") from None


def _decode_tensor(
    spec: dict, raw: memoryview | None, name: str
) -> np.ndarray | list[bytes]:
    shape = _shape(spec.get("shape"), name)
    datatype = spec.get("datatype")
    if not isinstance(datatype, str):
        raise ProtocolError(f"input {name!r}: 'datatype' must be a string, got "
                            f"{type(datatype).__name__}")
    count = math.prod(shape)
    if datatype == "BYTES":
        if count > MAX_BYTES_ELEMENTS:
            raise ProtocolError(
                f"input {name!r}: {count} BYTES elements, over the server's limit of "
                f"{MAX_BYTES_ELEMENTS}", 413,
            )
        if raw is not None:
            return _decode_bytes_binary(raw, count, name)
        return _decode_bytes_json(spec.get("data"), count, name)
    if datatype not in _NUMPY:
        raise ProtocolError(f"input {name!r}: unknown datatype {datatype!r}")
    dtype = np.dtype(_NUMPY[datatype]).newbyteorder("<")
    if raw is not None:
        if len(raw) != count * dtype.itemsize:
            raise ProtocolError(
                f"input {name!r}: {len(raw)} bytes of binary data for shape {list(shape)} "
                f"{datatype} ({count * dtype.itemsize} bytes)"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    flat = _flatten(spec.get("data"))
    if len(flat) != count:
        raise ProtocolError(f"input {name!r}: {len(flat)} values for shape {list(shape)}")
    try:
        return np.asarray(flat, dtype=_NUMPY[datatype]).reshape(shape)
    except (TypeError, ValueError, OverflowError) as err:
        raise ProtocolError(f"input {name!r}: data does not fit {datatype} ({err})") from None


def _check_json_length(length: int) -> None:
    """Refuse a JSON part over :data:`MAX_JSON_BYTES` bytes before it is copied or read (413)."""
    if length > MAX_JSON_BYTES:
        raise ProtocolError(
            f"the request's JSON part is {length} bytes, over the server's limit of "
            f"{MAX_JSON_BYTES}; send tensors as binary data (parameters.binary_data_size)", 413,
        )


def _check_json_size(head: bytes | bytearray) -> None:
    """Refuse a JSON part with more than :data:`MAX_JSON_VALUES` values (every value but a
    container's first follows a comma; containers are counted by their opening bracket),
    before anything is parsed (413)."""
    values = head.count(b",") + head.count(b"[") + head.count(b"{")
    if values > MAX_JSON_VALUES:
        raise ProtocolError(
            f"the request's JSON part holds up to {values} values, over the server's limit of "
            f"{MAX_JSON_VALUES}; send tensors as binary data (parameters.binary_data_size)", 413,
        )


def parse_infer_request(body: bytes | bytearray, header_length: str | None) -> InferRequest:
    """Parse an inference request body. Raises :class:`ProtocolError` naming the problem."""
    view = memoryview(body)
    head: bytes | bytearray
    if header_length is not None:
        try:
            json_length = int(header_length)
        except ValueError:
            raise ProtocolError(f"{HEADER_LENGTH} is not an integer: {header_length!r}") from None
        if not 0 < json_length <= len(body):
            raise ProtocolError(f"{HEADER_LENGTH} {json_length} does not fit the body")
        _check_json_length(json_length)
        head, binary = bytes(view[:json_length]), view[json_length:]
    else:
        _check_json_length(len(body))
        head, binary = body, view[:0]
    _check_json_size(head)
    try:
        request = json.loads(head)
    except (ValueError, RecursionError) as err:  # bad JSON, huge integers, deep nesting
        raise ProtocolError(f"request is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise ProtocolError("request must be a JSON object with an 'inputs' list")
    inputs: dict[str, np.ndarray | list[bytes]] = {}
    datatypes: dict[str, str] = {}
    offset = 0
    for spec in request["inputs"]:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError("every input needs a 'name'")
        name = spec["name"]
        if name in inputs:
            raise ProtocolError(f"input {name!r} given twice")
        size = _parameters(spec, f"input {name!r}").get("binary_data_size")
        raw = None
        if size is not None:
            if (not isinstance(size, int) or isinstance(size, bool) or size < 0
                    or offset + size > len(binary)):
                raise ProtocolError(f"input {name!r}: binary_data_size {size!r} exceeds the body")
            raw, offset = binary[offset : offset + size], offset + size
        elif "data" not in spec:
            raise ProtocolError(f"input {name!r} has neither 'data' nor binary data")
        inputs[name] = _decode_tensor(spec, raw, name)
        datatypes[name] = spec["datatype"]
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes of binary data belong to no input")
    params = _parameters(request, "request")
    binary_output = bool(params.get("binary_data_output", False))
    outputs: list[RequestedOutput] | None = None
    if request.get("outputs") is not None:
        if not isinstance(request["outputs"], list):
            raise ProtocolError("'outputs' must be a list")
        outputs = []
        for spec in request["outputs"]:
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ProtocolError("every requested output needs a 'name'")
            if any(spec["name"] == seen.name for seen in outputs):
                raise ProtocolError(f"output {spec['name'][:100]!r} requested twice")
            out_params = _parameters(spec, f"output {spec['name']!r}")
            outputs.append(RequestedOutput(
                spec["name"], bool(out_params.get("binary_data", binary_output)), out_params
            ))
    request_id = request.get("id")
    if request_id is not None and (
        not isinstance(request_id, (str, int)) or isinstance(request_id, bool)
        or len(str(request_id)) > MAX_ID_CHARS
    ):
        raise ProtocolError(f"'id' must be a string of at most {MAX_ID_CHARS} characters")
    return InferRequest(
        str(request_id) if request_id is not None else None, inputs, datatypes, outputs,
        binary_output,
    )


def _datatype(array: np.ndarray) -> str:
    if array.dtype == object:
        return "BYTES"
    for name, dtype in _NUMPY.items():
        if array.dtype == np.dtype(dtype):
            return name
    raise TypeError(f"no protocol datatype for {array.dtype}")


def _binary(array: np.ndarray) -> bytes:
    if array.dtype == object:
        parts = []
        for item in array.reshape(-1):
            data = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(data)) + data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def _json_data(array: np.ndarray) -> list:
    if array.dtype == object:
        return [v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    return array.reshape(-1).tolist()


def encode_infer_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: list[tuple[str, np.ndarray, bool]],
) -> tuple[bytes, dict[str, str]]:
    """Serialise ``(name, array, binary)`` outputs; returns the body and extra headers."""
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        response["id"] = request_id
    entries, chunks = [], []
    for name, array, binary in outputs:
        entry: dict[str, Any] = {
            "name": name, "datatype": _datatype(array), "shape": list(array.shape),
        }
        if binary:
            chunk = _binary(array)
            entry["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            entry["data"] = _json_data(array)
        entries.append(entry)
    response["outputs"] = entries
    head = json.dumps(response, separators=(",", ":")).encode()
    if not chunks:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(chunks), {
        "Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head)),
    }
