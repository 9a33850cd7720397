"""Triton's protocol extensions that its own clients use before their first request (read-only):
model configuration (``GET /v2/models/{name}/config``), the model repository index
(``POST /v2/repository/index``) and inference statistics (``GET /v2/models/{name}/stats``,
``GET /v2/models/stats``). Loading and unloading models (the rest of the repository
extension) is not served: one server serves one model, and such a request is a protocol error
naming the route."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from .context import MODEL_VERSION, ServerContext
from .protocol import ProtocolError
from .tensors import IMAGES, PIXELS

EXTENSIONS = ("model_configuration", "model_repository", "statistics")


def model_config(ctx: ServerContext) -> dict:
    """The model configuration as Triton's ``config`` route gives it: the batched input (dims
    without the batch), the outputs, the dynamic batcher's delay. The inputs are the
    metadata's, which a client sends all at once (perf_analyzer generates each); the other way
    in, ``images`` (PNG / JPEG bytes, one element a row), is named in ``parameters``."""
    metadata, options = ctx.model.metadata, ctx.options
    c, h, w = metadata.preprocessing.input_size
    k = metadata.num_classes
    return {
        "name": options.name,
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": options.max_batch,
        "input": [
            {"name": PIXELS, "data_type": "TYPE_FP32", "format": "FORMAT_NCHW",
             "dims": [c, h, w], "optional": False},
        ],
        "parameters": {IMAGES: {"string_value": (
            "optional input instead of pixel_values: BYTES [B], one encoded PNG or JPEG a "
            "row, preprocessed by the server")}},
        "output": [
            {"name": "logits", "data_type": "TYPE_FP32", "dims": [k]},
            {"name": "probabilities", "data_type": "TYPE_FP32", "dims": [k]},
            {"name": "labels", "data_type": "TYPE_STRING", "dims": [-1]},
        ],
        "dynamic_batching": {
            "max_queue_delay_microseconds": int(options.max_delay_ms * 1000),
        },
        "instance_group": [{"count": 1, "kind": "KIND_GPU" if ctx.model.session.device ==
                            "cuda" else "KIND_CPU"}],
    }


def triton_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    named = [Depends(ctx.check_name)]

    @router.get("/v2/models/{name}/config", dependencies=named)
    @router.get("/v2/models/{name}/versions/{version}/config", dependencies=named)
    async def config() -> dict:
        return model_config(ctx)

    @router.post("/v2/repository/index")
    async def repository_index() -> list:
        state = "READY" if ctx.ready.is_set() and ctx.worker.alive else "UNAVAILABLE"
        return [{"name": ctx.options.name, "version": MODEL_VERSION, "state": state}]

    @router.post("/v2/repository/models/{name}/load")
    @router.post("/v2/repository/models/{name}/unload")
    async def load_or_unload(name: str) -> None:
        raise ProtocolError(f"this server serves one model ({ctx.options.name!r}) and loads or "
                            "unloads none", 400)

    def stats() -> dict:
        entry = ctx.inference.model_stats(ctx.options.name, MODEL_VERSION,
                                          ctx.worker.executions)
        return {"model_stats": [entry]}

    @router.get("/v2/models/stats")
    async def all_stats() -> dict:
        return stats()

    @router.get("/v2/models/{name}/stats", dependencies=named)
    @router.get("/v2/models/{name}/versions/{version}/stats", dependencies=named)
    async def model_stats() -> dict:
        return stats()

    return router
