#!/usr/bin/env bash
# On the H200 (device tool), from the repository root, carrying .whl/ (pydantic's, hjson's and liger-kernel's wheels, as
# bench/h200_env.sh installs them, and DeepSpeed's source archive deepspeed-*.tar.gz): install DeepSpeed against the
# machine's torch (no isolated build, no ops ahead of time), build its CPU Adam once (~40 s; every length's process then
# loads it from TORCH_EXTENSIONS_DIR), then run bench/alst_h200.py with the arguments given. ~1 minute before the runs.
#   run(command="bash bench/alst_h200.sh --max-seq --start 96k --step 16k --budget-s 460 --out $OUT/alst_h200.json", carry=[".whl"])
set -euo pipefail
source bench/h200_deepspeed_env.sh  # bench/h200_env.sh, DeepSpeed from .whl, its CPU Adam built
python3 bench/alst_h200.py "$@"
