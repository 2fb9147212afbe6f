#!/usr/bin/env bash
# The engine on a CUDA GPU, in one short run: exactness against transformers on the
# GPU (tests/unit/test_hf_checkpoint.py, fp32 and bf16; with it n-gram and draft-model
# speculation, seeds, grammars and the engine core child on the device), then `duet bench engine`
# (ours against transformers `generate`, bf16, same run) on random-weight Llama
# checkpoints of three sizes (bench/random_checkpoint.py: the embedded model's shape,
# Llama-3.2-1B's and Llama-3.1-8B's). Needs torch with CUDA, transformers,
# safetensors, tokenizers, pydantic and llguidance; no Ray. Results in $OUT.
#
#     OUT=/tmp/gpu bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"

$PY -m pytest -q -p no:cacheprovider -p no:warnings -rs tests/unit/test_hf_checkpoint.py 2>&1 | tee "$OUT/tests.log"

bench() {  # seconds allowed, shape, then extra `bench engine` flags
    local limit=$1 shape=$2; shift 2
    local dir=/tmp/ckpt-$shape
    $PY -m bench.random_checkpoint "$dir" --shape "$shape" --device cuda &&
        timeout "$limit" $PY -m cluster.cli bench engine --model "$dir" --device cuda --dtype bfloat16 \
            --json "$OUT/engine-$shape.json" "$@" 2>&1 | grep -v "^Loading weights"
    rm -rf "$dir"
}
bench 120 smollm2-135m --prompt-len 128 --output-len 128 --batches 1 8 32 --prefill-len 512
bench 150 llama-3.2-1b --prompt-len 128 --output-len 128 --batches 1 8 32 --prefill-len 512
bench 240 llama-3.1-8b --prompt-len 128 --output-len 64 --batches 1 32 --prefill-len 1024 --repeats 2
