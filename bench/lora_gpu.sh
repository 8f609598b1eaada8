#!/usr/bin/env bash
# LoRA on one GPU (#35): Llama-3.1-8B shape, LoRA r=32 on every linear layer, bf16 base, AdamW over the adapters.
# 64K side by side with transformers + peft (gradient checkpointing), then seqpar's advertised longest length, one step.
#     OUT=/tmp/out bash bench/lora_gpu.sh          (needs peft: pip install 'seqpar[lora]')
set -u
OUT=${OUT:-/tmp/lora_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
case "$(cat "$OUT/gpu.csv")" in *H200*) GPU=${GPU:-h200} ;; *) GPU=${GPU:-h100} ;; esac
FLAGS="--lora-rank 32 --host-ram-gib 125"
timeout ${T64:-300} python3 bench/single_gpu.py --shape llama-3.1-8b --gpu "$GPU" --variants seqpar,peft --seq 64k \
  --steps 2 --warmup 1 --optimizer adamw --seqpar-args "$FLAGS" --out "$OUT/lora_64k.json" 2>&1 | tail -3
max=$(python3 -m seqpar.cli advise --model llama-3.1-8b --gpu "$GPU" --gpus 1 --max-seq-len $FLAGS --json 2>/dev/null \
  | python3 -c "import json,sys; print(json.load(sys.stdin)['data_parallel']['max_seq_len'])")
echo "advertised longest: $max"
timeout ${TMAX:-280} python3 bench/single_gpu.py --shape llama-3.1-8b --gpu "$GPU" --variants seqpar --seq "$max" \
  --steps 1 --warmup 0 --optimizer adamw --seqpar-args "$FLAGS" --out "$OUT/lora_max.json" 2>&1 | tail -2
