#!/usr/bin/env bash
# Issue 48's targets on models trained here but exported and calibrated as a user would.
# Reproduce: bash studies/own-model/run.sh [MODEL...]   (from the repository root; resumable:
# a stage whose results exist is skipped). Models (in this order by default):
#   resnet_gn-timm  mobilenet_bn-onnx  mobilenet_bn-timm  vit-timm     (the user's files)
#   resnet_gn-shipped  mobilenet_bn-shipped  vit-shipped                 (models/*.onnx)
# AFTER_TUNE=1 bash studies/own-model/run.sh MODEL...: the tuned user files on clean test images.
# Big files go to $W (default /tmp/own-model), results (JSON/MD) to results/own-model/.
set -euo pipefail
W=${W:-/tmp/own-model}
R=results/own-model
E=".venv/bin/eva0-edge"
PY=.venv/bin/python
export OMP_NUM_THREADS=1
CLEAN_LIMIT=${CLEAN_LIMIT:-5000}      # test clean images for (a)
HOSTILE_LIMIT=${HOSTILE_LIMIT:-1000}  # images per domain of the hostile stream
CORR_LIMIT=${CORR_LIMIT:-200}         # images per corruption for (b)
mkdir -p "$W" "$R"
log() { echo "[$(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)] $*" | tee -a "$R/run.log"; }

# ---- data: the validation split's clean images (held-out train images), never the test split
[ -f "$W/data/labelled.npz" ] || $PY studies/own-model/make_data.py "$W/data"
[ -f "$W/labels.txt" ] || $PY -c "from eva0_edge.bench.testbed.fashion_mnist import CLASS_NAMES; \
open('$W/labels.txt','w').write('\n'.join(CLASS_NAMES)+'\n')"

arch_of() { case $1 in resnet_gn*) echo resnet_gn_fmnist;; vit*) echo vit_fmnist;;
                       mobilenet_bn*) echo mobilenet_bn_fmnist;; esac; }

export_user() {  # $1 = model tag -> $W/$1.onnx (uncalibrated)
  local m=$1 a; a=$(arch_of "$m")
  [ -f "$W/$m.onnx" ] && return
  case $m in
    *-timm)  # timm export: the architecture registered with timm by the user (own_cli.py)
      $PY studies/own-model/own_cli.py export --arch "own_$a" --checkpoint "models/$a.pth" \
        --input-size 3,32,32 --labels "$W/labels.txt" -o "$W/$m.onnx" -q ;;
    *-onnx)  # a plain torch.onnx file, then the graph rewriter
      $PY studies/own-model/torch_to_onnx.py "$a" "models/$a.pth" "$W/$m.plain.onnx"
      $E export --onnx "$W/$m.plain.onnx" --labels "$W/labels.txt" \
        --mean 0.21910754282252673,0.21910754282252673,0.21910754282252673 \
        --std 0.3318746582784273,0.3318746582784273,0.3318746582784273 -o "$W/$m.onnx" -q ;;
  esac
}

eval_a() {  # $1 tag, $2 model file, $3 stage name
  local d="$R/$1-$3"; mkdir -p "$d"
  $E info "$2" > "$d/info.txt"
  $PY studies/own-model/check_policy.py "$2" "$d/policy-stats.json" 2>/dev/null | tail -1
  [ -f "$d/clean/results.json" ] || { log "$1 $3: clean B 1,4,16,64"
    $E eval --model "$2" --split test --corruptions clean --limit "$CLEAN_LIMIT" \
      --batch-sizes 1,4,16,64 --methods noadapt,eva0 --threads 1 -q --out "$d/clean" >/dev/null; }
  [ -f "$d/hostile/results.json" ] || { log "$1 $3: hostile black,clean,noise,clean B 1"
    $E eval --model "$2" --split test --protocol continual --corruptions black,clean,noise,clean \
      --limit "$HOSTILE_LIMIT" --batch-size 1 --methods noadapt,eva0 --threads 1 -q \
      --out "$d/hostile" >/dev/null; }
}

eval_b() {
  local d="$R/$1-$3"; mkdir -p "$d"
  $E info "$2" > "$d/info.txt"
  for p in continual single; do
    [ -f "$d/$p/results.json" ] || { log "$1 $3: $p B 1,4,16,64"
      $E eval --model "$2" --split test --protocol $p --limit "$CORR_LIMIT" \
        --batch-sizes 1,4,16,64 --methods noadapt,eva0 --threads 1 -q --out "$d/$p" >/dev/null; }
  done
}

run_user() {
  local m=$1 raw="$W/$1.onnx" cal="$W/$1.cal.onnx" tuned="$W/$1.tuned.onnx"
  export_user "$m"
  mkdir -p "$R/$m-calibrate" "$R/$m-tune"
  [ -f "$cal" ] || { log "$m: calibrate"
    $E calibrate --model "$raw" --data "$W/data/calib.npz" -o "$cal" -q \
      --fit-log "$R/$m-calibrate/fit-log.json" | tee "$R/$m-calibrate/calibrate.txt"; }
  eval_a "$m" "$cal" calibrate
  [ -f "$tuned" ] || { log "$m: tune"
    $E tune --model "$cal" --data "$W/data/labelled.npz" -o "$tuned" --threads 1 -q \
      --log "$R/$m-tune/tune-log.json" | tee "$R/$m-tune/tune.txt"; }
  eval_b "$m" "$tuned" tune
  log "$m: done"
}

run_shipped() {
  local m=$1 f="models/$(arch_of "$1").onnx"
  eval_a "$m" "$f" shipped
  eval_b "$m" "$f" shipped
  log "$m: done"
}

after_tune() {  # the tuned file on clean images too (not a target of its own: tune's clean margin)
  local m=$1 tuned="$W/$1.tuned.onnx" d="$R/$1-tune"
  $PY studies/own-model/check_policy.py "$tuned" "$d/policy-stats.json" 2>/dev/null | tail -1
  [ -f "$d/clean/results.json" ] || { log "$m tune: clean B 1,4,16,64 (limit ${AFTER_LIMIT:-2000})"
    $E eval --model "$tuned" --split test --corruptions clean --limit "${AFTER_LIMIT:-2000}" \
      --batch-sizes 1,4,16,64 --methods noadapt,eva0 --threads 1 -q --out "$d/clean" >/dev/null; }
}
if [ "${AFTER_TUNE:-0}" = 1 ]; then for m in ${*}; do after_tune "$m"; done; exit 0; fi

MODELS=${*:-resnet_gn-timm resnet_gn-shipped mobilenet_bn-onnx mobilenet_bn-timm mobilenet_bn-shipped vit-timm vit-shipped}
for m in $MODELS; do
  case $m in *-shipped) run_shipped "$m" ;; *) run_user "$m" ;; esac
done
log "all done: $MODELS"
$PY studies/own-model/tables.py > studies/own-model/tables.md || true
