#!/usr/bin/env bash
# The GPU checks and cost tables, in one run on a machine with an NVIDIA GPU and
# onnxruntime-gpu (CUDA 13 build) importable, eva0-edge importable, Fashion-MNIST's t10k files
# under $EVA0_FMNIST_ROOT. Run from the checkout's root. Random-weight models are exported into
# $EVA0_CACHE/bench-models first (or found there). Results go to $1/results.tar (re-written
# after every part, so a run cut short still returns what it finished; log.txt holds the log,
# which also goes to stdout).
# Parts (all by default, in this order, each under its own time limit):
#   tests    tests/integration/test_cuda.py (CUDA agrees with the CPU on the shipped models;
#            the device step's stream test needs Fashion-MNIST's test split)
#   costs    bench on CUDA, ResNet50-GN and ViT-B, batch 1/8/32, 20 interleaved repetitions:
#            EVA-0 and ZOA in the default mode (the device step), EVA-0's host step, one call
#   layers   the same at the recommended layer sets (ResNet50-GN stage 3, ViT-B blocks 6-11)
#   budget   bench on CUDA: noadapt-shift and default-mode EVA-0 (and its host step) at compute
#            budgets 1.25 and 1.5 (settled schedule, mean time, measured forwards per sample,
#            a served batch's time), batch 1/8/32
#   graphs   ORT's CUDA graphs on and off (studies/device-step/probe.py) on both exports
#   memory   GPU memory (NVML, each method in its own process) at batch 32
#   profile  cProfile of 20 default-mode EVA-0 steps at batch 32 (the host part of the step)
#   (after costs / layers / memory / budget: bench/gpu_summary.py writes the tables, gpu.md and
#   gpu.json)
#   eval     clean-stream accuracy of the shipped models on CUDA and on the CPU
#   cpu      the same machine's CPU cost tables
# GPU memory needs pynvml (nvidia-ml-py, in the [gpu] extra).
# On CUDA, eva0-onecall is one bound call over all rows and eva0-split the default CUDA mode (split
# sessions through IOBinding, rows per call from the memory budget); both run the device step
# (runtime/device_step.py: the batch, perturbations, rows, losses and gradient on the GPU), and
# -hoststep the step on the host (the CPU's numbers, the next step's perturbations drawn while
# ORT runs). On the lent GPU machine, source bench/gpu_env.sh first.
#   bash bench/gpu_check.sh OUT_DIR [PART ...]
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [PART ...]}
shift
parts=" ${*:-tests costs layers budget graphs memory profile eval cpu} "
res=$(mktemp -d)
cli=(python3 -m eva0_edge.cli)
archs=(resnet50_gn vit_base_patch16_224)
declare -A recommended=([resnet50_gn]=3 [vit_base_patch16_224]=6-11)  # docs/results/layers.md
want() { [[ $parts == *" $1 "* ]]; }
pack() { tar -cf "$out/results.tar" -C "$res" .; }
run() {  # the part's output goes to stdout and to log.txt in the results
  local limit=$1; shift
  {
    echo "== $* (limit ${limit} s)"; local t0=$SECONDS
    timeout "$limit" "$@"; echo "== exit $? after $((SECONDS - t0)) s"
  } 2>&1 | tee -a "$res/log.txt"
  pack
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
python3 -c "import onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())" \
  | tee "$res/ort.txt"
{ nproc; uptime; } | tee "$res/machine.txt"

want tests && run 300 python3 -m pytest -q -s -p no:cacheprovider tests/integration/test_cuda.py
# an export started beside this run (holding the lock) finishes first
mkdir -p "${EVA0_CACHE:-/tmp}" && flock "${EVA0_CACHE:-/tmp}/export.lock" true
if want costs; then
  for arch in "${archs[@]}"; do
    run 150 "${cli[@]}" bench --arch "$arch" --provider cuda --batch-sizes 1,8,32 \
      --methods noadapt-hoststep,eva0-split,eva0-split-hoststep,eva0-onecall,zoa-split \
      --repeats 20 --warmup 3 --no-memory --out "$res/bench-$arch-cuda" -q
  done
fi
if want layers; then
  for arch in "${archs[@]}"; do
    run 150 "${cli[@]}" bench --arch "$arch" --adapt "${recommended[$arch]}" --provider cuda \
      --batch-sizes 1,8,32 --methods eva0-split,eva0-split-hoststep,eva0-onecall,zoa-split \
      --repeats 20 --warmup 3 --no-memory --out "$res/layers-$arch-cuda" -q
  done
fi
if want budget; then
  for arch in "${archs[@]}"; do
    run 150 "${cli[@]}" bench --arch "$arch" --provider cuda --batch-sizes 1,8,32 \
      --methods noadapt-shift,eva0-split,eva0-split-hoststep --budgets 1.25,1.5 --repeats 40 \
      --warmup 3 --no-memory --out "$res/budget-$arch-cuda" -q
  done
fi
if want graphs; then
  exports=${EVA0_CACHE:-$HOME/.cache/eva0-edge}/bench-models
  run 120 python3 studies/device-step/probe.py "$exports"/{resnet50_gn,vit_base_patch16_224}-seed0.onnx \
    > "$res/graphs.txt"
  grep -v "^.\[" "$res/graphs.txt" | grep -v "^$"
fi
if want memory; then
  for arch in "${archs[@]}"; do
    run 150 "${cli[@]}" bench --arch "$arch" --provider cuda --batch-sizes 32 \
      --methods eva0-onecall,eva0-split,eva0-split-hoststep --repeats 3 --warmup 1 \
      --out "$res/memory-$arch-cuda" -q
  done
fi
if want profile; then
  for arch in "${archs[@]}"; do
    run 60 python3 studies/step-profile/step_profile.py --arch "$arch" --method eva0-split \
      --provider cuda --batch 32 --steps 20 > "$res/profile-$arch.txt"
    head -40 "$res/profile-$arch.txt"
  done
fi
if want costs || want layers || want memory || want budget; then  # the GPU tables: gpu.md, gpu.json
  run 30 python3 -m eva0_edge.bench.gpu_summary "$res"
fi
if want eval; then
  for model in resnet_gn_fmnist vit_fmnist; do
    for provider in cuda cpu; do
      run 90 "${cli[@]}" eval --model "models/$model.onnx" --protocol single \
        --corruptions clean --batch-sizes 1,64 --methods noadapt,eva0 --limit 1000 \
        --provider "$provider" --out "$res/eval-$model-$provider" -q
    done
  done
fi
if want cpu; then
  for arch in "${archs[@]}"; do
    run 150 "${cli[@]}" bench --arch "$arch" --provider cpu --batch-sizes 1,8,32 \
      --methods eva0-onecall,eva0-split,eva0-lowmem --repeats 5 --warmup 1 --no-memory \
      --out "$res/bench-$arch-cpu" -q
  done
fi
