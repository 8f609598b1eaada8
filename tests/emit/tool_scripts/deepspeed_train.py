"""A DeepSpeed user's training script, as `seqpar advise --emit deepspeed` tells the user to run it:
``deepspeed --num_gpus N deepspeed_train.py --deepspeed plan.deepspeed.json``. It builds nothing the JSON says (engine,
ZeRO stage, batch sizes, clipping, AdamW, Ulysses' degree) and keeps what the emitted notes leave to the script: the
model, the data, the loss, and a warmup or cosine schedule (transformers', from the plan's training section: ``--plan``).
Ulysses is DeepSpeed's ALST recipe (deepspeed 0.19.8 ``runtime/sequence_parallel/ulysses_sp.py``):
``UlyssesSPAttentionHF.register_with_transformers`` and the ``UlyssesSPDataLoaderAdapter`` that shards each rank's batch
over the sequence group in turn, the loss being the token mean over the group's shards (the recipe's weighted
all-gather).

The data are fixed windows (input_ids, labels, position_ids) read from ``--batches``: ``batches[step][micro][dp_rank]``.
Under the adapter each rank's loader sample is trained by the whole group in turn, so sequence rank r loads the windows
of steps r, r + sp, ... Prints one JSON line per optimizer step on rank 0: {"step", "loss", "lr"}.
"""

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

p = argparse.ArgumentParser()
p.add_argument("--deepspeed", required=True)
p.add_argument("--local_rank", type=int, default=0)
p.add_argument("--model", required=True)
p.add_argument("--batches", required=True)
p.add_argument("--plan", required=True)
args = p.parse_args()

torch.set_num_threads(1)
cfg = json.load(open(args.deepspeed))
deepspeed.init_distributed(dist_backend="gloo")
sp = cfg.get("sequence_parallel_size", 1)
mpu = None
if sp > 1:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=args.model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sp,
        micro_batch_size=cfg["train_micro_batch_size_per_gpu"],
        seq_length_is_variable=True,
    )
model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", dtype=torch.float32)
t = json.load(open(args.plan))["training"]  # the schedule the emitted notes leave to the script
if t["lr_schedule"] == "cosine":
    schedule = lambda opt: get_cosine_schedule_with_warmup(opt, t["warmup_steps"], t["steps"])  # noqa: E731
else:
    schedule = lambda opt: get_constant_schedule_with_warmup(opt, t["warmup_steps"])  # noqa: E731
engine, optimizer, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu, lr_scheduler=schedule
)

batches = json.load(open(args.batches))
rank, world = dist.get_rank(), dist.get_world_size()
dp_rank, sp_rank = rank // sp, rank % sp
ga = engine.gradient_accumulation_steps()
steps = len(batches)
# (step, micro) -> this rank's window; under Ulysses sequence rank r loads every sp-th one (the adapter trains each in turn)
rows = [batches[s][m][dp_rank] for s in range(steps) for m in range(ga)]
n = len(rows)
if sp > 1:  # the adapter takes a row from every sequence rank at a time: each gets as many (the spare one is not trained)
    rows = (rows + rows[-1:] * (-n % sp))[sp_rank::sp]
loader = DataLoader([{k: torch.tensor([v]) for k, v in r.items()} for r in rows], batch_size=None)
if sp > 1:
    loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=sp_rank, sp_group=mpu.get_sequence_parallel_group(),
                                        sp_world_size=sp, device=engine.device)  # fmt: skip

step_loss = 0.0
for i, batch in enumerate(loader):
    if i == n:
        break
    if sp > 1:
        shift_labels = batch.pop("shift_labels")
        out = engine(**batch, use_cache=False)
        logits = out.logits.float()
        good = (shift_labels != -100).sum()
        loss_sum = torch.nn.functional.cross_entropy(
            logits.view(-1, logits.size(-1)), shift_labels.view(-1), ignore_index=-100, reduction="sum"
        )
        group = mpu.get_sequence_parallel_group()
        sums = torch.distributed.nn.functional.all_gather(loss_sum, group=group)
        goods = torch.distributed.nn.functional.all_gather(good, group=group)
        loss = sum(sums) / sum(goods)
    else:
        loss = engine(**batch, use_cache=False).loss
    engine.backward(loss)
    lr = optimizer.param_groups[0]["lr"]
    engine.step()
    # the world mean of the micro-batch losses (every rank of a sequence group holds its group's loss)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    step_loss += float(mean) / world / ga
    if (i + 1) % ga == 0:
        if rank == 0:
            print(json.dumps({"step": (i + 1) // ga, "loss": step_loss, "lr": lr}), flush=True)
        step_loss = 0.0
