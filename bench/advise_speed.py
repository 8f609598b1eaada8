"""How fast `seqpar advise` answers: the full cost-model search for 8 GPUs, and whether torch was imported.

    python bench/advise_speed.py

Measures in a fresh interpreter (imports included, as a user's `seqpar advise` pays them) and in-process (search only).
Target: under 1 s on a 2-core CPU for the full search of 8 GPUs, no torch import.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

CASES = [("llama-2-7b", 32768), ("llama-2-7b", 524288), ("llama-3.2-1b", 131072)]


def fresh(model: str, seq_len: int) -> float:
    code = (
        "import time, sys; t = time.perf_counter()\n"
        "from seqpar.advisor.cluster import default_cluster\n"
        "from seqpar.advisor.request import AdviseRequest\n"
        "from seqpar.advisor.search import advise_by_cost\n"
        "from seqpar.profiles import get_model\n"
        f"advise_by_cost(AdviseRequest(model=get_model({model!r}), seq_len={seq_len}, cluster=default_cluster()))\n"
        "assert 'torch' not in sys.modules, 'the advisor imported torch'\n"
        "print(time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> int:
    from seqpar.advisor.cluster import default_cluster
    from seqpar.advisor.request import AdviseRequest
    from seqpar.advisor.search import advise_by_cost
    from seqpar.profiles import get_model

    print(f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}\n")
    print("| model | seq_len | fresh process (imports + search), s | search only, median of 5, s |")
    print("|---|---|---|---|")
    worst = 0.0
    for model, n in CASES:
        req = AdviseRequest(model=get_model(model), seq_len=n, cluster=default_cluster())
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            advise_by_cost(req)
            runs.append(time.perf_counter() - t)
        f = fresh(model, n)
        worst = max(worst, f)
        print(f"| {model} | {n} | {f:.3f} | {statistics.median(runs):.3f} |")
    print(
        f"worst fresh-process time {worst:.3f} s ({'under' if worst < 1 else 'OVER'} 1 s); torch imported: {'torch' in sys.modules}"
    )
    return 0 if worst < 1 and "torch" not in sys.modules else 1


if __name__ == "__main__":
    sys.exit(main())
