"""What the product predicts on one fixed stream, recorded so a refactor can show it changes
nothing, bit for bit.

On a fixed 2048-image Fashion-MNIST stream (test images 0-2047: 512 clean, 512 Gaussian noise
at severity 5, 256 black frames, 768 clean; the testbed's own corruption code: long enough for
the compute budget's 1024-sample burst to run out), for both shipped
models and batch sizes 1 and 16, it runs the product's ``eva0-edge adapt`` (a subprocess, as a
user runs it) under noadapt, noadapt-shift, eva0, eva0 ``--budget 1.5``, zoa and (on the
shipped ViT's prompt variant) foa, and keeps the sha256 of every output file written with
``--logits`` (names, labels, logits), the predicted labels, and a digest of the final state
file (its arrays and scalars; FOA keeps no state file). It then serves the first 96 images
with ``eva0-edge serve`` (synchronous, and ``--async-adapt`` waiting for each pass), eight per
request in order, and keeps the sha256 of the answered logits.

    python tools/prediction_record.py record tools/predictions.json   # before the change
    python tools/prediction_record.py check tools/predictions.json    # after: exit 1 on a diff

NumPy's OpenBLAS picks its kernels by the CPU and by ``OPENBLAS_CORETYPE``, and their float
sums differ in the last bits (the gradient's, so the logits of every adapting run): every run
here pins ``OPENBLAS_CORETYPE=Haswell`` and ``OPENBLAS_L2_SIZE=512``, what this project's
machines set, so any x86-64 host with AVX2 reproduces the record. (It was recorded without them
before; on a host that set them, every EVA-0 run's logits differed, their labels did not.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("resnet_gn_fmnist", "vit_fmnist")
METHODS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("noadapt", ()),
    ("noadapt-shift", ()),
    ("eva0", ()),
    ("eva0@budget1.5", ("--budget", "1.5")),
    ("zoa", ()),
)
BATCHES = (1, 16)
SERVED_IMAGES = 96
SERVED_BATCH = 8
# NumPy's OpenBLAS kernels, pinned (see the module's docstring)
OPENBLAS = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}


def fixed_stream() -> tuple[np.ndarray, np.ndarray]:
    """uint8 images [2048, 32, 32, 3] and their labels [2048]: clean, noise, black, clean."""
    from eva0_edge.bench.testbed.corruptions import corrupt_images
    from eva0_edge.bench.testbed.fashion_mnist import load_fashion_mnist

    images, labels = load_fashion_mnist("test")
    images, labels = np.array(images[:2048]), np.array(labels[:2048])
    images[512:1024] = corrupt_images(images[512:1024], "gaussian_noise", 5, seed=0,
                                      start_index=512)
    images[1024:1280] = 0
    return images, labels


def state_digest(path: Path) -> str:
    """sha256 over a state file's arrays and its metadata (scalars, fingerprint, method); the
    zip container's timestamps left out."""
    h = hashlib.sha256()
    with np.load(path, allow_pickle=False) as archive:
        for name in sorted(archive.files):
            value = archive[name]
            h.update(name.encode())
            h.update(str(value.dtype).encode() + str(value.shape).encode())
            h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def run_adapt(model: Path, method: str, extra: tuple[str, ...], batch: int, stream: Path,
              work: Path) -> dict[str, Any]:
    """One ``eva0-edge adapt`` run: the output's sha256, the labels it predicted, the state's
    digest (None for FOA) and its summary line."""
    out = work / "predictions.jsonl"
    state = work / "state.npz"
    for path in (out, state):
        path.unlink(missing_ok=True)
    keeps_state = not method.startswith("foa")
    command = [sys.executable, "-m", "eva0_edge.cli", "adapt", "--model", str(model),
               "--input", str(stream), "-o", str(out), "--logits", "--method", method,
               "--batch-size", str(batch), "--provider", "cpu", "-q", *extra]
    if keeps_state:
        command += ["--state", str(state)]
    done = subprocess.run(command, capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {
        "output_sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
        "labels": "".join(str(row["label"]) for row in rows),
        "state": state_digest(state) if keeps_state else None,
        "summary": done.stdout.strip().splitlines()[-1].split(" -> ")[0],
    }


def served_logits(model: Path, images: np.ndarray, asynchronous: bool, log: Path) -> str:
    """sha256 of the logits ``eva0-edge serve`` answers for ``images``, SERVED_BATCH per request
    in order; asynchronously, each request waits until the pass on the one before has run."""
    sys.path.insert(0, str(ROOT))
    import tritonclient.http as httpclient

    from tests.fixtures import ServerProcess, http_call

    args = ("--async-adapt",) if asynchronous else ()
    server = ServerProcess(log, *args, "--max-batch", str(SERVED_BATCH), model=model)
    name = model.stem
    h = hashlib.sha256()
    try:
        for start in range(0, len(images), SERVED_BATCH):
            chunk = images[start:start + SERVED_BATCH]
            tensor = httpclient.InferInput("images", [len(chunk)], "BYTES")
            tensor.set_data_from_numpy(np.array([png(image) for image in chunk], dtype=object))
            logits = server.client.infer(name, [tensor]).as_numpy("logits")
            h.update(np.ascontiguousarray(logits, dtype=np.float32).tobytes())
            if asynchronous:
                wait_for_pass(server, name, http_call, start + len(chunk))
    finally:
        server.stop()
    return h.hexdigest()


def png(image: np.ndarray) -> bytes:
    """One uint8 [H, W, 3] image as PNG bytes (lossless)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def wait_for_pass(server: Any, name: str, http_call: Any, served: int) -> None:
    """Until every served sample has been adapted on or dropped (30 s at most)."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        status, body = http_call(server, "GET", f"/v2/models/{name}/adaptation/statistics")
        counts = json.loads(body)["asynchronous"]
        if status == 200 and counts["served_samples"] == served and \
                counts["adapted_samples"] + counts["dropped_samples"] == served and \
                counts["adapting_samples"] == 0 and counts["waiting_samples"] == 0:
            return
        time.sleep(0.02)
    raise RuntimeError(f"the asynchronous server did not finish its pass: {counts}")


def record() -> dict[str, Any]:
    """Every run above, keyed ``model/method/B``, and ``serve/sync`` / ``serve/async``."""
    from eva0_edge.bench.testbed.prompt_variant import prompt_variant

    images, labels = fixed_stream()
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stream = work / "stream.npz"
        np.savez(stream, x=images, y=labels)
        models = {name: ROOT / "models" / f"{name}.onnx" for name in MODELS}
        jobs = [(name, method, extra) for name in MODELS for method, extra in METHODS]
        jobs.append(("vit_fmnist_prompt", "foa", ()))
        for name, label, extra in jobs:
            path = prompt_variant(models["vit_fmnist"]) if name.endswith("_prompt") \
                else models[name]
            method = label.split("@")[0]
            for batch in BATCHES:
                key = f"{name}/{label}/B{batch}"
                runs[key] = run_adapt(path, method, extra, batch, stream, work)
                print(f"{key}: {runs[key]['summary']}", flush=True)
        for asynchronous in (False, True):
            key = f"serve/{'async' if asynchronous else 'sync'}"
            runs[key] = served_logits(models["resnet_gn_fmnist"], images[:SERVED_IMAGES],
                                      asynchronous, work / f"{key.replace('/', '-')}.log")
            print(f"{key}: {runs[key]}", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["record", "check"])
    parser.add_argument("path", type=Path, help="the recording (JSON)")
    args = parser.parse_args()
    os.environ.update(OPENBLAS)  # every run below is a subprocess: adapt, serve
    runs = record()
    if args.mode == "record":
        args.path.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.path}: {len(runs)} runs")
        return
    recorded = json.loads(args.path.read_text())
    changed = sorted(key for key in recorded.keys() | runs.keys()
                     if recorded.get(key) != runs.get(key))
    for key in changed:
        before, now = recorded.get(key), runs.get(key)
        if isinstance(before, dict) and isinstance(now, dict):
            before, now = ({k: v for k, v in run.items() if before.get(k) != now.get(k)}
                           for run in (before, now))
        print(f"CHANGED {key}:\n  recorded {before}\n  now      {now}")
    print(f"{len(recorded) - len(changed)} of {len(recorded)} runs identical")
    raise SystemExit(1 if changed else 0)


if __name__ == "__main__":
    main()
