#!/usr/bin/env bash
# On the H200 (device tool), from the repository root, carrying .whl/ (pydantic's wheels and hjson's, as bench/h200_env.sh
# expects, and DeepSpeed's source archive deepspeed-*.tar.gz): install DeepSpeed against the machine's torch the way CI
# does (no isolated build, no ops ahead of time), build its CPU Adam once (~40 s; the zero3_offload rows need it), then
# run the ZeRO rows into $OUT/deepspeed_h200.json. About 8 minutes: ~1 for the installs and the build, --budget-s for runs.
#   run(command="bash bench/deepspeed_h200.sh", carry=[".whl"], timeout_s=600)
set -euo pipefail
source bench/h200_deepspeed_env.sh  # bench/h200_env.sh, DeepSpeed from .whl, its CPU Adam built
python3 bench/deepspeed_h200.py --out "${OUT:-.}/deepspeed_h200.json" --budget-s "${BUDGET_S:-400}" "$@"
