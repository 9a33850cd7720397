#!/usr/bin/env bash
# Source on the lent GPU machine from the checkout's root (no network there): rebuilds
# onnxruntime-gpu from the pack carried in .gpu/ (../shared/gpu/README.md), makes the checkout
# importable as eva0_edge (a link tree under /tmp/pkg mirroring pyproject's package-dir) and
# points the testbed at Fashion-MNIST's files when they were carried in .data/fmnist. Prints
# the versions a run records.
#   . bench/gpu_env.sh
# a warm machine keeps /tmp/ort from the call before (the pack need not travel again)
[ -f /tmp/ort/env.sh ] || python3 .gpu/unpack-ort-gpu.py .gpu /tmp/ort >/dev/null || return 1
. /tmp/ort/env.sh
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/eva0_edge
cp -r src/eva0_edge/. /tmp/pkg/eva0_edge/
for part in runtime exporter quant bench fleet; do ln -s "$PWD/$part" "/tmp/pkg/eva0_edge/$part"; done
export PYTHONPATH=/tmp/pkg:$PWD:$PYTHONPATH EVA0_CACHE=${EVA0_CACHE:-/tmp/eva0-cache} PYTHONUNBUFFERED=1
mkdir -p "$EVA0_CACHE"
if [ -d .data/fmnist ]; then export EVA0_FMNIST_ROOT=$PWD/.data/fmnist; fi
python3 - <<'PY'
import cupy, onnxruntime as ort, numpy, sys
print("python", sys.version.split()[0], "numpy", numpy.__version__)
print("onnxruntime", ort.__version__, ort.get_available_providers()[:2])
print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "driver", cupy.cuda.runtime.driverGetVersion())
PY
