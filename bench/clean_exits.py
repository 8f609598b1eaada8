"""Clean exits: run each way of training on 2 gloo CPU ranks N times and count the runs that did not exit cleanly.

A rank that finished its work must exit 0: a scheduler reads an abort at interpreter exit ("terminate called without an
active exception", SIGABRT, exit status 134 or -6) as a failed job. Three paths, each a fresh ``torchrun
--nproc-per-node 2`` per run, on a tiny Llama written once into the work folder:

- ``readme``: the README's "Use seqpar in your own training loop" example, with only what a CPU needs changed (the
  substitutions tests/cli/test_first_hour_readme.py makes);
- ``trl_ds``: TRL's SFTTrainer under ``with_seqpar`` (zigzag_ring_attn, sp 2) on DeepSpeed ZeRO-2 (DeepSpeed's CPU
  accelerator over gloo), then ``evaluate``, as the README's Trainer recipe reads;
- ``with_seqpar``: transformers' Trainer under ``with_seqpar`` (zigzag_ring_attn, sp 2) on gloo (DDP), then ``evaluate``.

    python bench/clean_exits.py --runs 50 --out bench/results/clean_exits.json [--paths readme,trl_ds,with_seqpar]
    python bench/clean_exits.py --runs 1 --paths readme --gdb      # the aborting thread's stack, when one aborts
    python bench/clean_exits.py --runs 10 --cores /tmp/cores       # or a core file of each abort, for gdb python CORE

A run counts as clean when torchrun exits 0 and no rank printed "terminate called" (torchrun exits 0 when every rank
does). The JSON holds, per path, the runs, the unclean ones with their exit status and the last lines of their output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The README example as written for GPUs, and what a CPU run needs instead (tests/cli/test_first_hour_readme.py's CPU).
README_CPU = [
    ('dist.init_process_group("nccl")', 'dist.init_process_group("gloo")'),
    ('torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))', "pass"),
    (".cuda()", ""),
    ('"Qwen/Qwen2.5-0.5B"', "MODEL"),
    ("(1, 32768)", "(1, 64)"),
    ("range(10)", "range(2)"),
]

TRAINER = """
import os, sys, tempfile
import torch, torch.distributed as dist
import datasets, transformers
import seqpar

MODEL, KIND = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")  # as torchrun and accelerate leave it for the Trainer
S, VOCAB = 64, 256
ids = lambda n, seed: torch.randint(0, VOCAB, (n, S), generator=torch.Generator().manual_seed(seed)).tolist()
train = datasets.Dataset.from_dict({"input_ids": ids(8, 1)})
held_out = datasets.Dataset.from_dict({"input_ids": ids(4, 2)})
common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=3,
              learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
model = transformers.AutoModelForCausalLM.from_pretrained(MODEL)
sp = seqpar.SeqparArguments(mode="zigzag_ring_attn", sp_degree=2)
if KIND == "trl_ds":
    from tokenizers import Tokenizer, models
    from trl import SFTConfig, SFTTrainer

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB - 1)} | {"<pad>": VOCAB - 1}, unk_token="<pad>"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")
    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    args = SFTConfig(**common, max_length=S, packing=False, dataset_text_field="input_ids", deepspeed=ds)
    trainer = seqpar.with_seqpar(SFTTrainer)(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                                             processing_class=tok, seqpar=sp)
else:
    args = transformers.TrainingArguments(**common)
    trainer = seqpar.with_seqpar(transformers.Trainer)(model=model, args=args, train_dataset=train,
                                                       eval_dataset=held_out, seqpar=sp)
trainer.train()
print("eval_loss", trainer.evaluate()["eval_loss"])
"""


def write_scripts(work: Path) -> dict[str, list[str]]:
    """The tiny model and one script per path; path -> the script's argv after torchrun's own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = work / "model"
    if not (model / "config.json").is_file():
        cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        LlamaForCausalLM(LlamaConfig(**cfg, num_key_value_heads=2, max_position_embeddings=256)).save_pretrained(model)
    readme = (ROOT / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "train_sp.py" in b]
    for gpu, cpu in README_CPU:
        if gpu not in example:
            raise SystemExit(f"the README example changed ({gpu!r} is gone): update README_CPU")
        example = example.replace(gpu, cpu)
    (work / "train_sp.py").write_text(f"MODEL = {str(model)!r}\n" + example)
    (work / "trainer.py").write_text(TRAINER)
    return {
        "readme": [str(work / "train_sp.py")],
        "trl_ds": [str(work / "trainer.py"), str(model), "trl_ds"],
        "with_seqpar": [str(work / "trainer.py"), str(model), "with_seqpar"],
    }


def _cores_on() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(script: list[str], work: Path, gdb: bool, timeout: float, cores: Path | None = None) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    if gdb:  # each rank under gdb: a rank that aborts prints every thread's stack
        torchrun += ["--no-python", "gdb", "-q", "-batch", "-ex", "run", "-ex", "thread apply all bt", "--args", sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.monotonic()
    cwd = work
    if cores is not None:  # a rank that aborts leaves its core here (kernel.core_pattern "core": the process's folder)
        cwd = cores / f"run-{time.time_ns()}"
        cwd.mkdir(parents=True)
    try:
        p = subprocess.run(
            torchrun + script,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=_cores_on if cores is not None else None,
        )
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    aborts = text.count("terminate called")
    if cores is not None and not any(cwd.glob("core*")):
        cwd.rmdir()
    return {"rc": rc, "aborts": aborts, "seconds": round(time.monotonic() - t0, 1), "text": text}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--paths", default="readme,trl_ds,with_seqpar")
    p.add_argument("--out", default=None, help="JSON results (written after every run)")
    p.add_argument("--work", default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--gdb", action="store_true", help="run the ranks under gdb and keep the output of every unclean run")
    p.add_argument("--cores", default=None, help="keep a core file of every rank that aborts under this folder (gdb reads it)")
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="clean_exits-"))
    work.mkdir(parents=True, exist_ok=True)
    scripts = write_scripts(work)
    results = {"runs": a.runs, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "paths": {}}
    for path in a.paths.split(","):
        res = results["paths"][path] = {"runs": 0, "unclean": 0, "nonzero": 0, "terminate_called": 0, "failures": []}
        for i in range(a.runs):
            r = run_once(scripts[path], work, a.gdb, a.timeout, Path(a.cores) if a.cores else None)
            res["runs"] += 1
            res["nonzero"] += r["rc"] != 0
            res["terminate_called"] += r["aborts"] > 0
            if r["rc"] != 0 or r["aborts"]:
                res["unclean"] += 1
                keep = r["text"] if a.gdb else r["text"][-3000:]
                res["failures"].append({"run": i, "rc": r["rc"], "aborts": r["aborts"], "tail": keep})
            print(f"{path} run {i + 1}/{a.runs}: rc {r['rc']}, terminate called x{r['aborts']}, {r['seconds']} s", flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"{path}: {res['unclean']} unclean of {res['runs']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
