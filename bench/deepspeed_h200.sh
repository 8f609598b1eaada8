#!/usr/bin/env bash
# On the H200 (device tool), from the repository root, carrying .whl/ (pydantic's wheels and hjson's, as bench/h200_env.sh
# expects, and DeepSpeed's source archive deepspeed-*.tar.gz): install DeepSpeed against the machine's torch the way CI
# does (no isolated build, no ops ahead of time), build its CPU Adam once (~40 s; the zero3_offload rows need it), then
# run the ZeRO rows into $OUT/deepspeed_h200.json. About 8 minutes: ~1 for the installs and the build, --budget-s for runs.
#   run(command="bash bench/deepspeed_h200.sh", carry=[".whl"], timeout_s=600)
set -euo pipefail
source bench/h200_env.sh
t0=$SECONDS
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target .site .whl/deepspeed-*.tar.gz
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"
echo "deepspeed installed and CPU Adam built in $((SECONDS - t0)) s"
python3 bench/deepspeed_h200.py --out "${OUT:-.}/deepspeed_h200.json" --budget-s "${BUDGET_S:-400}" "$@"
