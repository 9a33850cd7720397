#!/usr/bin/env bash
# The GPU checks and cost tables, in one run on a machine with an NVIDIA GPU and
# onnxruntime-gpu (CUDA 13 build) importable, eva0-edge installed, Fashion-MNIST's t10k files
# under $EVA0_FMNIST_ROOT. Run from the checkout's root. Random-weight models are exported into
# $EVA0_CACHE/bench-models first (or found there). Results go to $1/results.tar (re-written
# after every part, so a run cut short still returns what it finished) and the log to stdout.
# Parts run most important first (correctness, CUDA costs, CUDA accuracy, GPU memory, then the
# same machine's CPU), each under its own time limit. GPU memory needs pynvml (nvidia-ml-py, in
# the [gpu] extra; on the lent machine: its wheel unzipped into .gpu/pylib, carried).
# On CUDA, eva0 is one bound call over all rows and eva0-split the default CUDA mode (split
# sessions through IOBinding, rows per call from the memory budget); both draw the next step's
# perturbations while ORT runs.
#   bash bench/gpu_check.sh OUT_DIR
set -u
out=${1:?usage: gpu_check.sh OUT_DIR}
res=$(mktemp -d)
cli=(python3 -m eva0_edge.cli)
pack() { tar -cf "$out/results.tar" -C "$res" .; }
run() {
  local limit=$1; shift
  echo "== $* (limit ${limit} s)"; local t0=$SECONDS
  timeout "$limit" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; pack
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
python3 -c "import onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())" \
  | tee "$res/ort.txt"
{ nproc; uptime; } | tee "$res/machine.txt"

run 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
# an export started beside this run (holding the lock) finishes first
mkdir -p "${EVA0_CACHE:-/tmp}" && flock "${EVA0_CACHE:-/tmp}/export.lock" true
[ -d .gpu/pylib ] && export PYTHONPATH="$PWD/.gpu/pylib${PYTHONPATH:+:$PYTHONPATH}"
gpu_methods=eva0,eva0-split,eva0-lowmem,zoa,zoa-split
for arch in resnet50_gn vit_base_patch16_224; do
  extra=""
  [ "$arch" = vit_base_patch16_224 ] && extra=",foa"  # foa-iob beside it: two 896-row arenas ran out of GPU memory
  run 150 "${cli[@]}" bench --arch "$arch" --provider cuda --batch-sizes 1,8,32 \
    --methods "$gpu_methods$extra" --repeats 20 --warmup 3 --no-memory \
    --out "$res/bench-$arch-cuda" -q
done
for model in resnet_gn_fmnist vit_fmnist; do
  for provider in cuda cpu; do
    run 90 "${cli[@]}" eval --model "models/$model.onnx" --protocol single --corruptions clean \
      --batch-sizes 1,64 --methods noadapt,eva0 --limit 1000 --provider "$provider" \
      --out "$res/eval-$model-$provider" -q
  done
done
for arch in resnet50_gn vit_base_patch16_224; do
  run 150 "${cli[@]}" bench --arch "$arch" --provider cuda --batch-sizes 32 \
    --methods eva0,eva0-split,eva0-lowmem,zoa-split --repeats 3 --warmup 1 \
    --out "$res/memory-$arch-cuda" -q
done
for arch in resnet50_gn vit_base_patch16_224; do
  run 150 "${cli[@]}" bench --arch "$arch" --provider cpu --batch-sizes 1,8,32 \
    --methods eva0,eva0-split,eva0-lowmem --repeats 5 --warmup 1 --no-memory \
    --out "$res/bench-$arch-cpu" -q
done
