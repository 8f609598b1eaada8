#!/usr/bin/env bash
# On the H200 (device tool), from the repository root, carrying .whl/ (pydantic's and liger-kernel's wheels, as
# bench/h200_env.sh installs them): kept_saves matmuls (seqpar/runtime/memory/matmul_keep.py) measured side by side with stock
# transformers and the advisor's plan without it, Llama-2-7B shape, 64K tokens, optimizer none, Liger, ~11 minutes of
# device time in all. First the GPU test (the streams, the page-locked blocks, a stated pinned budget and Liger's in-place
# RoPE the CPU tests cannot reach), then five runs of bench/single_gpu.py, each its own process, rows in $OUT/kept_<tag>.json:
#   host      --kept-saves matmuls --kept-host-layers 10 (10 kept layers' matmul outputs in pinned host memory)
#   host75    --kept-saves matmuls --kept-host-layers 32 --pinned-host-gib 75: the advisor picks the host count and split
#             with 75 of the 125 GiB page-lockable (15 host-kept layers, none recomputed: 5,601 tokens/s predicted at side_copy_overlap 0.93)
#   matmuls   the advisor's plan with --kept-saves matmuls (the kept layers keep only their matmul outputs)
#   split     the advisor's plan as it chooses today (selective, the last layers fully kept)
#   stock     stock transformers (gradient checkpointing on every layer), the baseline
#   profile   host75 plus one step under the profiler (seqpar launch --profile-step; not a default part): the row
#             carries the step's summary (kernel busy time, idle gaps, host copies under no kernel, allocator retries),
#             $OUT/profile_host75 its trace
#   ab        the profile row run by another checkout's seqpar package, carried in build/ab (ignored):
#             `git archive <commit> seqpar | tar -x -C build/ab`, run(..., carry=[".whl", "build/ab"]): an A/B of two
#             versions of the runtime on one machine (not a default part)
#   copies    bench/host_copies.py (not a default part): copy bandwidth, page-locked by cudaHostAlloc and by cudaHostRegister
#   saves     bench/layer_saves.py (not a default part): each decoder layer's saved tensors and GPU bytes under
#             kept_saves all / matmuls, Liger and not, at the GPU test's small shape, to $OUT/h200_layer_saves.json
# Each seqpar row carries the plan's prediction and the run report's kept_matmuls bytes (GPU / host / recomputed), so
# the host copies' overlap (coefficients' side_copy_overlap, 0.93 fitted on one H100: bench/h100_side_copies.sh) can be
# checked on the H200 (bench/fit_side_copy.py, given a row that keeps nothing in host memory).
# Every plan states its pinned budget (--pinned-host-gib; 50 = the default 40% of the declared 125 GiB host), so the
# runtime pins what the advisor priced, whatever RAM the VM reports at start.
# Arguments pick the parts, in the order given (default: all six, which pass one call's 600 s: split in two calls).
#   run(command="bash bench/h200_kept_matmuls.sh test host host75", carry=[".whl"], timeout_s=600)
#   run(command="bash bench/h200_kept_matmuls.sh matmuls split stock", carry=[".whl"], timeout_s=600)
set -uo pipefail
source bench/h200_env.sh
HERE=$PWD
SA="--fused-ops liger --host-ram-gib 125"
run() {
    local tag=$1
    shift
    local out="$OUT/kept_$tag.json" n=2
    while [ -e "$out" ]; do out="$OUT/kept_${tag}_$n.json"; n=$((n + 1)); done # a tag run twice keeps both rows
    python3 "$HERE/bench/single_gpu.py" --shape llama-2-7b --seq 64k --optimizer none --steps 2 --warmup 1 --timeout 170 "$@" \
        --out "$out" 2>&1 | tail -3
}
for part in "${@:-test host host75 matmuls split stock}"; do
    for p in $part; do
        case $p in
        test) python3 -m pytest -q -rs tests/runtime/memory/test_matmul_keep_gpu.py 2>&1 | tee "$OUT/kept_gpu_test.log" | tail -15 ;;
        host) run host --variants seqpar --seqpar-args "$SA --pinned-host-gib 50 --kept-saves matmuls --kept-host-layers 10" ;;
        host75) run host75 --variants seqpar --seqpar-args "$SA --pinned-host-gib 75 --kept-saves matmuls --kept-host-layers 32" ;;
        matmuls) run matmuls --variants seqpar --seqpar-args "$SA --pinned-host-gib 50 --kept-saves matmuls" ;;
        split) run split --variants seqpar --seqpar-args "$SA --pinned-host-gib 50" ;;
        stock) run stock --variants stock ;; # its 2026-12-02/03 rows: 4,103-4,165 tokens/s, 54.1 GiB
        saves) python3 bench/layer_saves.py --out "$OUT/h200_layer_saves.json" 2>&1 | tail -4 ;;
        profile) run profile --timeout 300 --profile --profile-dir "$OUT/profile_host75" --variants seqpar \
            --seqpar-args "$SA --pinned-host-gib 75 --kept-saves matmuls --kept-host-layers 32" ;;
        ab) [ -d build/ab/seqpar ] || { echo "ab: no build/ab/seqpar (git archive <commit> seqpar | tar -x -C build/ab)" >&2; exit 2; }
            ROOT=$PWD; cd build/ab; PYTHONPATH=$ROOT/.site:$ROOT/build/ab run ab --timeout 300 --profile --profile-dir "$OUT/profile_ab" --variants seqpar \
                --seqpar-args "$SA --pinned-host-gib 75 --kept-saves matmuls --kept-host-layers 32"; cd "$ROOT" ;;
        copies) python3 bench/host_copies.py --sizes-gib 1,4 --repeats 2 --out "$OUT/h200_host_copies.json" 2>&1 | tail -5 ;;
        *) echo "unknown part $p: use test, host, host75, matmuls, split, stock, saves, profile, ab, copies" >&2; exit 2 ;;
        esac
    done
done
