#!/usr/bin/env bash
# One command from measured, on a machine with N GPUs (or N gloo CPU ranks, the dry run CI runs):
#   1. verify     seqpar verify (the mode's step against data_parallel on the same ranks) for every mode and degree
#                 N allows (bench/multi_gpu_cases.py degrees asks the advisor which);
#   2. bandwidth  all-to-all, all-gather, ring send/recv and all-reduce bandwidth by message size (bench/collectives.py,
#                 nccl-tests' algbw / busbw);
#   3. runs       each mode at three lengths (bench/multi_gpu_cases.py lengths), each from its own plan:
#                 seqpar advise -s L --mode M --sp-degree S -o plan, seqpar launch plan --steps K --no-final-checkpoint;
#   4. report     rows.json (the runs' reports, and the plans of runs out of memory, as `seqpar calibrate` reads them),
#                 seqpar calibrate rows.json, and report.md: one page of predicted against measured.
#
#   bash bench/multi_gpu.sh                              every GPU of this machine, NCCL
#   bash bench/multi_gpu.sh --cpu 2                      the dry run: 2 gloo CPU ranks, the tiny model, tiny shapes
#   bash bench/multi_gpu.sh --stages verify,bandwidth    some stages; later calls add the others to the same --out
#   SEQPAR_BENCH_CPU=2 bash bench/multi_gpu.sh           the same as --cpu 2
#
# Options (GPU default / CPU default):
#   --out DIR             where everything goes (runs/multi_gpu); each step's output is in DIR/logs
#   --model NAME          the runs' model profile (llama-3.1-8b / tiny); random weights, synthetic tokens
#   --verify-model NAME   verify's model (llama-3.2-1b / tiny)     --verify-len N   verify's tokens (4096 / 64)
#   --steps K             optimizer steps per run, the first excluded from tokens/s (3)
#   --modes a,b           these modes only (all registered ones)
#   --stages a,b          of verify,bandwidth,runs,report (all)
#   --step-budget-s S     the longest run's predicted step time (10 / 0.05)
#   --unit N              each length a multiple of N (1024 / 128)
#   --max-bytes SIZE      the largest message (1G / 256K)        --iters N   timed operations per size (20 / 5)
#   --gpu NAME, --host-ram-gib X   the cluster, as seqpar advise takes them (default: probed; host RAM from /proc/meminfo)
# Exit 0 when everything that ran passed (a run out of memory is a measurement), 1 when a verify or a step failed, 2 for
# bad options.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python}
CPU_RANKS=${SEQPAR_BENCH_CPU:-}
OUT=runs/multi_gpu MODEL="" VMODEL="" VLEN="" STEPS=3 MODES="" STAGES=verify,bandwidth,runs,report BUDGET="" UNIT=""
MAX_BYTES="" ITERS="" GPU="" HOST_RAM=""
COMMAND="bash bench/multi_gpu.sh $*"

die() { echo "multi_gpu.sh: $*" >&2; exit 2; }
say() { echo "multi_gpu.sh: $*"; }
while (($#)); do
    [[ $1 == -h || $1 == --help ]] && { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0; }
    (($# >= 2)) || die "$1 needs a value; see bash bench/multi_gpu.sh --help"
    case $1 in
        --cpu) CPU_RANKS=$2 ;;
        --out) OUT=$2 ;;
        --model) MODEL=$2 ;;
        --verify-model) VMODEL=$2 ;;
        --verify-len) VLEN=$2 ;;
        --steps) STEPS=$2 ;;
        --modes) MODES=$2 ;;
        --stages) STAGES=$2 ;;
        --step-budget-s) BUDGET=$2 ;;
        --unit) UNIT=$2 ;;
        --max-bytes) MAX_BYTES=$2 ;;
        --iters) ITERS=$2 ;;
        --gpu) GPU=$2 ;;
        --host-ram-gib) HOST_RAM=$2 ;;
        *) die "unknown option $1; see bash bench/multi_gpu.sh --help" ;;
    esac
    shift 2
done
for stage in ${STAGES//,/ }; do
    [[ $stage =~ ^(verify|bandwidth|runs|report)$ ]] || die "--stages $STAGES: $stage is not a stage; of verify,bandwidth,runs,report"
done
[[ $STEPS =~ ^[0-9]+$ ]] && ((STEPS >= 2)) || die "--steps $STEPS: give 2 or more (the first step is left out of tokens/s)"
has() { [[ ,$STAGES, == *,$1,* ]]; }

if [[ -n $CPU_RANKS ]]; then
    [[ $CPU_RANKS =~ ^[0-9]+$ ]] && ((CPU_RANKS >= 2)) || die "--cpu $CPU_RANKS: give 2 or more ranks, e.g. --cpu 2"
    N=$CPU_RANKS CLUSTER=(--cluster "cpu:$N") CPU_FLAG=(--cpu)
    : "${MODEL:=tiny}" "${VMODEL:=tiny}" "${VLEN:=64}" "${BUDGET:=0.05}" "${UNIT:=128}" "${MAX_BYTES:=256K}" "${ITERS:=5}"
else
    N=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())') || die "torch could not count the GPUs"
    ((N >= 2)) || die "this machine shows $N GPU(s); the bench needs 2 or more (bash bench/multi_gpu.sh --cpu 2: the dry run)"
    if [[ -z $HOST_RAM ]]; then
        HOST_RAM=$("$PYTHON" -c 'from seqpar.advisor.probe import read_host_ram_gib as r; print(r() or "")')
    fi
    CLUSTER=(--gpus "$N") CPU_FLAG=()
    [[ -n $GPU ]] && CLUSTER+=(--gpu "$GPU")
    [[ -n $HOST_RAM ]] && CLUSTER+=(--host-ram-gib "$HOST_RAM")
    : "${MODEL:=llama-3.1-8b}" "${VMODEL:=llama-3.2-1b}" "${VLEN:=4096}" "${BUDGET:=10}" "${UNIT:=1024}" "${MAX_BYTES:=1G}" "${ITERS:=20}"
fi
MODE_FLAG=()
[[ -n $MODES ]] && MODE_FLAG=(--modes "$MODES")
mkdir -p "$OUT/logs" "$OUT/plans" "$OUT/verify" "$OUT/runs" || die "cannot write to --out $OUT"
say "$N ${CPU_RANKS:+gloo CPU }ranks, stages $STAGES, into $OUT"
FAILED=0

# status.tsv: stage, case, seqpar advise's exit code, the job's ('-': not run); the report reads the last line per case
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$OUT/status.tsv"; }
tail_log() { tail -n 5 "$1" | sed 's/^/    /' >&2; }

if has verify; then
    "$PYTHON" "$HERE/multi_gpu_cases.py" degrees --out "$OUT/modes.json" --model "$VMODEL" --seq-len "$VLEN" \
        "${MODE_FLAG[@]}" "${CLUSTER[@]}" >"$OUT/verify_cases.txt" 2>"$OUT/logs/verify_cases.log" \
        || { tail_log "$OUT/logs/verify_cases.log"; die "the verify cases could not be listed"; }
    mapfile -t cases <"$OUT/verify_cases.txt"
    for line in "${cases[@]}"; do
        read -r mode sp u <<<"$line"
        name=$mode-sp$sp
        args=(-s "$VLEN" -m "$VMODEL" --mode "$mode" --sp-degree "$sp" "${CLUSTER[@]}")
        if ((u != 1)); then name+=-u$u args+=(--ulysses-degree "$u"); fi
        plan=$OUT/plans/verify-$name.json log=$OUT/logs/verify-$name.log
        seqpar advise "${args[@]}" -o "$plan" >"$log" 2>&1 </dev/null
        a=$? v=-
        if ((a == 0)); then
            rm -rf "$OUT/verify/$name"
            seqpar verify "$plan" --seq-len "$VLEN" --output "$OUT/verify/$name" >>"$log" 2>&1 </dev/null
            v=$?
        fi
        record verify "$name" "$a" "$v"
        if [[ $a == 0 && $v == 0 ]]; then say "verify $name: passed"; else say "verify $name: FAILED (advise $a, verify $v; $log)"; tail_log "$log"; FAILED=1; fi
    done
    sed 's/^multi_gpu_cases: /multi_gpu.sh: verify: /' "$OUT/logs/verify_cases.log"
fi

if has bandwidth; then
    log=$OUT/logs/bandwidth.log
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$N" "$HERE/collectives.py" "${CPU_FLAG[@]}" \
        --out "$OUT/bandwidth.jsonl" --max-bytes "$MAX_BYTES" --iters "$ITERS" >"$log" 2>&1 </dev/null
    b=$?
    record bandwidth all - "$b"
    if ((b == 0)); then say "bandwidth: $(wc -l <"$OUT/bandwidth.jsonl") rows in $OUT/bandwidth.jsonl"; else say "bandwidth: FAILED ($log)"; tail_log "$log"; FAILED=1; fi
fi

if has runs; then
    "$PYTHON" "$HERE/multi_gpu_cases.py" lengths --out "$OUT/lengths.json" --model "$MODEL" --unit "$UNIT" \
        --step-budget-s "$BUDGET" "${MODE_FLAG[@]}" "${CLUSTER[@]}" >"$OUT/run_cases.txt" 2>"$OUT/logs/run_cases.log" \
        || { tail_log "$OUT/logs/run_cases.log"; die "the run lengths could not be chosen"; }
    mapfile -t cases <"$OUT/run_cases.txt"
    for line in "${cases[@]}"; do
        read -r mode sp len <<<"$line"
        name=$mode-$len plan=$OUT/plans/run-$mode-$len.json log=$OUT/logs/run-$mode-$len.log
        seqpar advise -s "$len" -m "$MODEL" --mode "$mode" --sp-degree "$sp" "${CLUSTER[@]}" -o "$plan" >"$log" 2>&1 </dev/null
        a=$? r=-
        if ((a == 0)); then
            rm -rf "$OUT/runs/$name"
            seqpar launch "$plan" --steps "$STEPS" --no-final-checkpoint --output "$OUT/runs/$name" >>"$log" 2>&1 </dev/null
            r=$?
        fi
        record run "$name" "$a" "$r"
        if [[ $a == 0 && $r == 0 ]]; then say "run $name: done"; else say "run $name: advise $a, launch $r ($log)"; tail_log "$log"; fi
    done
    sed 's/^multi_gpu_cases: /multi_gpu.sh: runs: /' "$OUT/logs/run_cases.log"
fi

if has report; then
    rows=$("$PYTHON" "$HERE/multi_gpu_report.py" rows "$OUT") || die "the rows could not be collected"
    rm -f "$OUT/calibrate.json"
    if ((rows > 0)); then
        seqpar calibrate "$OUT/rows.json" --json -o "$OUT/coefficients.json" >"$OUT/calibrate.json.part" \
            2>"$OUT/logs/calibrate.log" </dev/null && mv "$OUT/calibrate.json.part" "$OUT/calibrate.json"
        c=$?
        record calibrate rows - "$c"
        ((c == 0)) || { say "calibrate: FAILED ($OUT/logs/calibrate.log)"; tail_log "$OUT/logs/calibrate.log"; FAILED=1; }
    fi
    "$PYTHON" "$HERE/multi_gpu_report.py" report "$OUT" --command "$COMMAND" || FAILED=1
    say "$rows rows for seqpar calibrate in $OUT/rows.json; the report: $OUT/report.md"
fi
exit $FAILED
