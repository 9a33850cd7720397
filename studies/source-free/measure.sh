#!/bin/bash
# The test-split measurement of the source-free mode (results/source-free/): NoAdapt and EVA-0
# on the shipped files, the source-free mode (eva0-dagger, and eva0 on the set-up file) on
# never-calibrated copies (stripped.py), the paper's EVA-0-dagger (free_shift=0) at B = 16;
# continual at B 1/16/64 (500 images per corruption), clean at B 1/4/16/64 (2000 images).
#   bash studies/source-free/measure.sh [OUT_ROOT]   (run from the repository root)
set -euo pipefail
out=${1:-results/source-free}
tmp=$(mktemp -d)
eval_() { .venv/bin/eva0-edge eval --dataset fmnist-c --severity 5 --threads 1 -q "$@"; }
for m in vit_fmnist resnet_gn_fmnist mobilenet_bn_fmnist; do
  .venv/bin/python studies/source-free/stripped.py models/$m.onnx $tmp/$m.onnx
  eval_ --model models/$m.onnx --protocol continual --batch-sizes 1,16,64 --limit 500 \
    --methods noadapt,eva0 --out $out/$m-continual
  eval_ --model $tmp/$m.onnx --protocol continual --batch-sizes 1,16,64 --limit 500 \
    --methods eva0-dagger,eva0 --out $out/$m-continual-source-free
  eval_ --model $tmp/$m.onnx --protocol continual --batch-sizes 16 --limit 500 \
    --methods eva0-dagger --set free_shift=0 --out $out/$m-continual-paper-dagger
  eval_ --model models/$m.onnx --protocol single --corruptions clean --batch-sizes 1,4,16,64 \
    --limit 2000 --methods noadapt,eva0 --out $out/$m-clean
  eval_ --model $tmp/$m.onnx --protocol single --corruptions clean --batch-sizes 1,4,16,64 \
    --limit 2000 --methods eva0-dagger,eva0 --out $out/$m-clean-source-free
done
.venv/bin/python studies/source-free/summary.py $out
