#!/usr/bin/env bash
# The heads recipe on one GPU in one call (`multitoken build-heads`), for a device machine that
# has torch, transformers and CUDA but neither this package installed nor the network.
#
#   bash scripts/gpu/build_heads.sh PAYLOAD OUT [smoke]
#
# PAYLOAD holds, in any of its subfolders: gguf-*.whl (transformers reads GGUF with it),
# model.gguf.part-* (the base's GGUF in parts, joined in name order: a call carries at most
# 64 MiB), and the text: train/*.txt, heldout/*.txt. OUT receives the heads
# (heads-TYPE.NN.safetensors, parts under 16 MiB each), every small file in build.tar.gz, and the log.
# `smoke` runs the same recipe on the embedded stories260K for a few seconds instead.
# A call that carries at most 64 MiB with the repo sends the GGUF in parts over calls to one warm
# machine, each part copied out of the repo (a later call drops what it does not carry): for
# example part 00 and the text with the smoke run, then the rest with the full run.
set -euo pipefail
payload=$(realpath "$1"); out=$(realpath "$2"); mode=${3:-full}
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${WORK:-/tmp/build}; mkdir -p "$work"  # the build's own folder (shards, heads dirs), kept between calls
site="$work/site"
# the package as its import root maps it (pyproject's package-dir), without installing it
if [ -e "$site" ] && [ ! -d "$site/multitoken-0.1.0.dist-info" ]; then  # only a shim this script made is replaced
  echo "$site exists and is not this script's package shim: move it away or set WORK to another folder"; exit 2
fi
rm -rf "$site"; mkdir -p "$site/multitoken" "$site/multitoken-0.1.0.dist-info"
# every top-level package as pyproject's package-dir maps it (multitoken.X -> folder X)
pkgs=$("${PY:-python3}" -c "import sys, tomllib; dirs = tomllib.load(open(sys.argv[1], 'rb'))['tool']['setuptools']['package-dir']
print(' '.join(d for name, d in dirs.items() if name.count('.') == 1))" "$repo/pyproject.toml")
for pkg in $pkgs; do ln -s "$repo/$pkg" "$site/multitoken/$pkg"; done
printf 'Metadata-Version: 2.1\nName: multitoken\nVersion: 0.1.0\n' > "$site/multitoken-0.1.0.dist-info/METADATA"
wheel=$(find "$payload" -name "gguf-*.whl" | head -1)
if [ -n "$wheel" ]; then "${PY:-python3}" -m pip install -q --no-index --no-deps --target "$site" "$wheel"; fi
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"${PY:-python3}" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
run() { "${PY:-python3}" -m multitoken.pipeline.cli build-heads --device "${DEVICE:-cuda}" --compute-dtype "${COMPUTE:-bfloat16}" "$@" 2>&1 | tee -a "$out/build.log"; }
# Both stages are bound by launching kernels on an H100 (process CPU seconds = wall seconds at 4,096
# rows and at 32-row steps), so rows per call are what buys throughput; two batches per shard keep
# the greedy / sampled alternation.
if [ "$mode" = smoke ]; then
  run --base embedded:stories260K --data $(find "$payload" -path "*/train/*.txt") --heldout $(find "$payload" -path "*/heldout/*.txt") --out "$work/smoke" \
      --tokens "${SMOKE_TOKENS:-100000}" --heldout-prompts "${HELDOUT:-64}" --new-tokens 48 --distill-batch 512 --shard-rows 1024 --batch-rows 64 \
      --train-seconds "${TRAIN_S:-10}" --warmup 10
else
  if [ ! -f "$work/model.gguf" ]; then cat $(find "$payload" -name "model.gguf.part-*" | sort) > "$work/model.gguf"; fi
  if [ -n "${GGUF_SHA256:-}" ] && ! echo "$GGUF_SHA256  $work/model.gguf" | sha256sum -c --quiet; then
    echo "the joined GGUF is not the one expected (a part missing?): $(ls $(find "$payload" -name 'model.gguf.part-*'))"; rm -f "$work/model.gguf"; exit 3
  fi
  run --base "$work/model.gguf" --data $(find "$payload" -path "*/train/*.txt") --heldout $(find "$payload" -path "*/heldout/*.txt") --out "$work/full" \
      --tokens "${TOKENS:-19000000}" --heldout-prompts "${HELDOUT:-200}" --prompt-stride 1 --new-tokens "${NEW:-64}" --distill-batch "${BATCH:-8192}" \
      --shard-rows 16384 --batch-rows "${ROWS:-256}" --lr 1e-3 --warmup 100 --epochs 3 \
      --distill-seconds "${DISTILL_S:-190}" --train-seconds "${TRAIN_S:-170}"
fi
dest="$work/$([ "$mode" = smoke ] && echo smoke || echo full)"
# the heads in bfloat16 (what ships; eagle3's id maps d2t / t2d kept), in parts under 16 MiB (what a call sends back)
"${PY:-python3}" "$repo/scripts/gpu/split_heads.py" "$out" "$dest"/heads-*
(cd "$dest" && tar czf "$out/build.tar.gz" --exclude=heads.safetensors --exclude=distill .)
ls -la "$out"
