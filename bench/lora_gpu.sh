#!/usr/bin/env bash
# LoRA on one GPU (#35): Llama-3.1-8B shape (SHAPE another), LoRA r=32 on every linear layer, bf16 base, AdamW over the adapters.
#     OUT=/tmp/out bash bench/lora_gpu.sh compare   64K side by side with transformers + peft (gradient checkpointing);
#                                                   where peft runs out of memory there, both again at 32K;
#                                                   compare SEQ: that length only; VARIANTS= picks the side (e.g.
#                                                   seqpar,peft-liger: peft with Liger's kernels and fused loss)
#     OUT=/tmp/out bash bench/lora_gpu.sh max [FLAGS]  seqpar's advertised longest length (--max-seq-len), one step;
#                                                   FLAGS add to the plan's (e.g. "--fused-ops liger")
#     OUT=/tmp/out bash bench/lora_gpu.sh bnb       whether bitsandbytes' 4-bit layers run on this GPU (QLoRA)
#     SHAPE=llama-3.3-70b OUT=/tmp/out bash bench/lora_gpu.sh max "--qlora --fused-ops liger"
#                                                   the 70B QLoRA's advertised longest length, one step (SHAPE: any
#                                                   profile; default llama-3.1-8b)
# (needs peft: pip install 'seqpar[lora]'; bnb needs bitsandbytes)
set -u
PHASE=${1:-compare}
OUT=${OUT:-/tmp/lora_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
case "$(cat "$OUT/gpu.csv")" in *H200*) GPU=${GPU:-h200} ;; *) GPU=${GPU:-h100} ;; esac
FLAGS="--lora-rank 32 --host-ram-gib 125"
SHAPE=${SHAPE:-llama-3.1-8b}
run() {  # SEQ VARIANTS STEPS WARMUP TAG
  timeout ${TSTEP:-300} python3 bench/single_gpu.py --shape "$SHAPE" --gpu "$GPU" --variants "$2" --seq "$1" \
    --steps "$3" --warmup "$4" --optimizer adamw --seqpar-args "$FLAGS" --out "$OUT/lora_$5.json" 2>&1 | tail -4
}
if [ "$PHASE" = compare ]; then  # compare [SEQ]: one length only
  if [ -n "${2:-}" ]; then run "$2" "${VARIANTS:-seqpar,peft}" 2 1 "$2"; else
    run 64k seqpar,peft 2 1 64k
    if grep -q '"oom": true' "$OUT/lora_64k.json" 2>/dev/null; then run 32k seqpar,peft 2 1 32k; fi
  fi
fi
if [ "$PHASE" = max ]; then
  FLAGS="$FLAGS ${2:-}"
  max=$(python3 -m seqpar.cli advise --model "$SHAPE" --gpu "$GPU" --gpus 1 --max-seq-len $FLAGS --json 2>/dev/null \
    | python3 -c "import json,sys; print(json.load(sys.stdin)['data_parallel']['max_seq_len'])")
  echo "advertised longest: $max"
  python3 -m seqpar.cli advise --model "$SHAPE" --gpu "$GPU" --gpus 1 --seq-len $(( max * 105 / 100 )) \
    --mode data_parallel $FLAGS --json > "$OUT/lora_over.json" 2>/dev/null; echo "over rc=$?" > "$OUT/lora_over.rc"
  TSTEP=${TMAX:-900} run "$max" seqpar 1 0 "max$(printf '%s' "${2:-}" | tr -c 'a-z0-9' '_')"
fi
if [ "$PHASE" = bnb ]; then
  python3 - <<'PY' 2>&1 | tail -3
import torch, bitsandbytes as bnb
lin = bnb.nn.Linear4bit(256, 256, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4").cuda()
x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
lin(x).sum().backward()
print("bitsandbytes", bnb.__version__, "nf4 forward and backward on", torch.cuda.get_device_name(), "grad finite:", bool(x.grad.isfinite().all()))
PY
fi
