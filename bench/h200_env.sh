# Source on the GPU machine (device tool) before running seqpar there: installs the carried pydantic wheels
# (and liger-kernel for the baseline) into .site and puts the checkout on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl 2>&1 | grep -v WARNING || true
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
