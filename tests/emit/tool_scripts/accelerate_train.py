"""An accelerate user's training script, as `seqpar advise --emit accelerate` tells the user to run it:
``accelerate launch --config_file plan.accelerate.yaml accelerate_train.py``. The accelerate YAML carries the engine,
the processes and the parallelism; the script keeps what the emitted notes leave to it (the model, the data, AdamW with
the plan's learning rate, schedule and clipping, the loss), read from the plan (``--plan``). The data are fixed windows
(input_ids, labels, position_ids) from ``--batches``: ``batches[step][micro][dp_rank]``, this process's data-parallel
rank being ``accelerator.process_index`` (the data-parallel plans this script runs have no sequence groups).

Prints {"processes", "distributed_type"} once, then one JSON line per optimizer step on the main process:
{"step", "loss", "lr"}, the loss being the mean over processes, as seqpar's trainer reports it.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

p = argparse.ArgumentParser()
p.add_argument("--plan", required=True)
p.add_argument("--model", required=True)
p.add_argument("--batches", required=True)
args = p.parse_args()

torch.set_num_threads(1)
plan = json.load(open(args.plan))
t, s = plan["training"], plan["strategy"]
accelerator = Accelerator(gradient_accumulation_steps=s["gradient_accumulation_steps"])
state = {"processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type).split(".")[-1]}
accelerator.print(json.dumps(state), flush=True)
torch.manual_seed(t["seed"])
model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=t["learning_rate"], weight_decay=t["weight_decay"])
if t["lr_schedule"] == "cosine":
    scheduler = get_cosine_schedule_with_warmup(optimizer, t["warmup_steps"], t["steps"])
else:
    scheduler = get_constant_schedule_with_warmup(optimizer, t["warmup_steps"])
model, optimizer = accelerator.prepare(model, optimizer)  # the schedule steps once per optimizer step, outside accelerate

batches = json.load(open(args.batches))
for step, micros in enumerate(batches):
    total = 0.0
    for micro in micros:
        row = micro[accelerator.process_index % len(micro)]
        batch = {k: torch.tensor([v], device=accelerator.device) for k, v in row.items()}
        with accelerator.accumulate(model):
            loss = model(**batch, use_cache=False).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), t["grad_clip"])
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            optimizer.zero_grad()
        total += float(accelerator.reduce(loss.detach(), "mean")) / len(micros)
    scheduler.step()
    accelerator.print(json.dumps({"step": step + 1, "loss": total, "lr": lr}), flush=True)
