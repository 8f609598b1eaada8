# Source on the GPU machine (device tool), after nothing else, from the repository root, carrying .whl/: bench/h200_env.sh,
# then DeepSpeed from its source archive (.whl/deepspeed-*.tar.gz) against the machine's torch the way CI installs it (no
# isolated build, no ops ahead of time), then its CPU Adam built once (~40 s; later processes load it from
# TORCH_EXTENSIONS_DIR). Used by bench/deepspeed_h200.sh and bench/alst_h200.sh.
source bench/h200_env.sh
t0=$SECONDS
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target .site .whl/deepspeed-*.tar.gz
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"
echo "deepspeed installed and CPU Adam built in $((SECONDS - t0)) s"
