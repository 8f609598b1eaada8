#!/usr/bin/env bash
# On one H100 (device tool, nvidia-h100-x1), from the repository root, carrying .whl/ (pydantic's and liger-kernel's
# wheels, as bench/h200_env.sh installs them): how much of the host-kept matmul outputs' copies (kept_host_layers,
# seqpar/runtime/memory/matmul_keep.py) compute hides, i.e. the cost model's side_copy_overlap, and the GPU tests of the
# kept matmuls. Llama-2-7B shape, 32K tokens, optimizer none, Liger; the default parts ran in 240 s on 2026-12-05.
# The three "same" rows run one plan (the advisor's with --kept-saves matmuls: the first 15 layers selective, the last
# 17 keeping their matmul outputs) and differ only in how many of the 17 hold those outputs in pinned host memory
# (strategy.kept_host_layers 0, 10, 17): the same recomputation, so the step time's difference is the exposed copy time.
#   test     tests/runtime/memory/test_matmul_keep_gpu.py (streams, page-locked blocks, a stated pinned budget, Liger's in-place RoPE)
#   copies   bench/host_copies.py at the sizes of one layer's matmul outputs (pinned GB/s of this machine's PCIe)
#   same0 / same10 / same17   the plan above with kept_host_layers 0 / 10 / 17
#   advised  --kept-host-layers 32: the advisor's own split with host-kept layers (fewer recomputed)
#   stock    stock transformers (gradient checkpointing on every layer)
# At 16K, where every layer's matmul outputs fit on the GPU, the host-kept placement the advisor picks at 32K (the first
# 15 layers on the host, the 17 above on the GPU) against the same layers kept on the GPU, and against recomputing them:
#   all16    no layer checkpointed, all 32 keep their matmul outputs on the GPU (the advisor's 16K plan)
#   host16   the same, the first 15 layers' outputs in pinned host memory: the copies' exposed time, nothing else changed
#   sel16    the first 15 layers selective (recomputed), the 17 above kept: what keeping those 15 saves
#   profile  advised plus one step under the profiler (seqpar launch --profile-step): kernel busy time, gaps, host copies
#            under no kernel, allocator retries; the trace in $OUT/h100_profile
#   ab       profile's row run by another checkout's seqpar package in build/ab (ignored; `git archive <commit> seqpar |
#            tar -x -C build/ab`, carry=[".whl", "build/ab"]): two versions of the runtime on one machine
#   saves    bench/layer_saves.py: per-layer bytes and saved tensors under kept_saves all / matmuls, Liger and not
#   run(command="bash bench/h100_side_copies.sh", kind="nvidia-h100-x1", carry=[".whl"], timeout_s=600)
set -uo pipefail
source bench/h200_env.sh
HERE=$PWD
SA="--fused-ops liger --host-ram-gib 125 --pinned-host-gib 50 --kept-saves matmuls"
K16="checkpointing=full,checkpoint_layers=0"
S16="checkpointing=selective,checkpoint_layers=15,kept_host_layers=0"
run() {
    local tag=$1
    shift
    local out="$OUT/h100_$tag.json" n=2
    while [ -e "$out" ]; do out="$OUT/h100_${tag}_$n.json"; n=$((n + 1)); done # a tag run twice keeps both rows
    python3 "$HERE/bench/single_gpu.py" --gpu h100 --shape llama-2-7b --seq "${SEQ:-32k}" --optimizer none --steps 3 --warmup 1 --timeout 150 \
        "$@" --out "$out" 2>&1 | tail -2
}
for part in "${@:-test copies same0 same10 same17 advised stock}"; do
    for p in $part; do
        case $p in
        test) python3 -m pytest -q -rs tests/runtime/memory/test_matmul_keep_gpu.py 2>&1 | tee "$OUT/h100_gpu_test.log" | tail -8 ;;
        copies) python3 bench/host_copies.py --sizes-gib 1,2 --repeats 3 --out "$OUT/h100_host_copies.json" 2>&1 | tail -4 ;;
        same0) run same0 --variants seqpar --seqpar-args "$SA" --strategy-set kept_host_layers=0 ;;
        same10) run same10 --variants seqpar --seqpar-args "$SA" --strategy-set kept_host_layers=10 ;;
        same17) run same17 --variants seqpar --seqpar-args "$SA" --strategy-set kept_host_layers=17 ;;
        advised) run advised --variants seqpar --seqpar-args "$SA --kept-host-layers 32" ;;
        stock) run stock --variants stock ;;
        profile) run profile --timeout 240 --profile --profile-dir "$OUT/h100_profile" --variants seqpar --seqpar-args "$SA --kept-host-layers 32" ;;
        ab) [ -d build/ab/seqpar ] || { echo "ab: no build/ab/seqpar (git archive <commit> seqpar | tar -x -C build/ab)" >&2; exit 2; }
            ROOT=$PWD; cd build/ab; PYTHONPATH=$ROOT/.site:$ROOT/build/ab run ab --timeout 240 --profile --profile-dir "$OUT/h100_profile_ab" --variants seqpar \
                --seqpar-args "$SA --kept-host-layers 32"; cd "$ROOT" ;;
        all16) SEQ=16k run all16 --variants seqpar --seqpar-args "$SA" --strategy-set "$K16,kept_host_layers=0" ;;
        host16) SEQ=16k run host16 --variants seqpar --seqpar-args "$SA" --strategy-set "$K16,kept_host_layers=15" ;;
        sel16) SEQ=16k run sel16 --variants seqpar --seqpar-args "$SA" --strategy-set "$S16" ;;
        saves) python3 bench/layer_saves.py --out "$OUT/h100_layer_saves.json" 2>&1 | tail -4 ;;
        *) echo "unknown part $p: use test, copies, same0, same10, same17, advised, stock, profile, ab, all16, host16, sel16, saves" >&2; exit 2 ;;
        esac
    done
done
