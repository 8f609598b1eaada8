#!/usr/bin/env bash
# The OOM gate on one GPU (#34): what torch can allocate, and what is live at a step's peak for the plan that ran out of
# memory on an H100 (Llama-3.1-8B, bf16 AdamW, checkpoint offload + tiled MLP + Liger + chunked loss), at a small scale
# (4 layers of the 8B shape, 160K): seqpar launch --profile-step writes the allocator's memory_peak next to the
# prediction.
#     OUT=/tmp/out bash bench/oom_gate.sh find
#     OUT=/tmp/out bash bench/oom_gate.sh verify "llama-3.1-8b|--optimizer adamw-bf16 --fused-ops liger --host-ram-gib 125" ...
set -u
PHASE=${1:-find}
shift || true
OUT=${OUT:-/tmp/oom_gate}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
case "$(cat "$OUT/gpu.csv")" in *H200*) GPU=${GPU:-h200} ;; *) GPU=${GPU:-h100} ;; esac
if [ "$PHASE" = find ]; then
  python3 bench/capacity.py --out "$OUT/capacity.json" 2>&1 | tail -5
  mkdir -p /tmp/l8b4
  python3 - <<'PY'
import json
from seqpar.profiles import get_model
m = get_model("llama-3.1-8b")
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden_size,
       "intermediate_size": m.intermediate_size, "num_hidden_layers": 4, "num_attention_heads": m.num_attention_heads,
       "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim, "vocab_size": m.vocab_size,
       "rope_theta": m.rope_theta, "max_position_embeddings": m.max_position_embeddings, "tie_word_embeddings": False,
       "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
open("/tmp/l8b4/config.json", "w").write(json.dumps(cfg))
PY
  FLAGS="--fused-ops liger --host-ram-gib 125 --checkpointing offload --tiled-mlp --loss-impl chunked"
  timeout 200 python3 bench/single_gpu.py --shape /tmp/l8b4/config.json --gpu "$GPU" --variants seqpar --seq 160k \
    --steps 1 --warmup 0 --optimizer adamw-bf16 --seqpar-args "$FLAGS" --profile --profile-dir "$OUT/prof_4l_160k" \
    --out "$OUT/l4_160k.json" 2>&1 | tail -3
  find "$OUT" -name '*.json.gz' -size +40M -delete  # traces too large to bring back; the summaries stay
fi
if [ "$PHASE" = verify ]; then
  # each argument: "MODEL|ADVISE FLAGS": the advertised maximum (seqpar advise --max-seq-len) trains one step here, and
  # the maximum + 5% is predicted not to fit (the advisor's own answer, recorded beside the run)
  for spec in "$@"; do
    model=${spec%%|*}; flags=${spec#*|}
    tag=$(echo "$model $flags" | tr -c 'A-Za-z0-9.-' '_' | cut -c1-80)
    max=$(python3 -m seqpar.cli advise --model "$model" --gpu "$GPU" --gpus 1 --max-seq-len $flags --json 2>/dev/null \
      | python3 -c "import json,sys; print(json.load(sys.stdin)['data_parallel']['max_seq_len'])")
    over=$(( max * 105 / 100 ))
    python3 -m seqpar.cli advise --model "$model" --gpu "$GPU" --gpus 1 --seq-len "$over" --mode data_parallel $flags \
      --json > "$OUT/over_$tag.json" 2>/dev/null; echo "over rc=$?" >> "$OUT/over_$tag.json.rc"
    opt=$(echo "$flags" | sed -n 's/.*--optimizer \([a-z0-9-]*\).*/\1/p'); opt=${opt:-adamw-bf16}
    rest=$(echo "$flags" | sed 's/--optimizer [a-z0-9-]*//')
    echo "== $model max $max ($flags)"
    timeout ${VERIFY_TIMEOUT:-280} python3 bench/single_gpu.py --shape "$model" --gpu "$GPU" --variants seqpar --seq "$max" \
      --steps 1 --warmup 0 --optimizer "$opt" --seqpar-args "$rest" --out "$OUT/max_$tag.json" 2>&1 | tail -2
  done
fi
