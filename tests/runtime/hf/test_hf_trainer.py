"""transformers' Trainer and TRL's SFTTrainer in seqpar's modes (seqpar.runtime.hf.trainer) on 2 and 4 gloo CPU ranks:
the per-step training losses, gradient norms and the eval loss equal a single-process reference on the same batches (the
same model, AdamW, clipping and accumulation), for data parallel and for every sequence-parallel mode, so they also equal
each other: the eval loss is the same for every sp degree. Then the Trainer against `seqpar launch`'s trainer on 2 and 4
ranks: the same plan, weights, windows, seed, optimizer and schedule give the same losses and gradient norms step for
step, in data parallel and in a sequence-parallel mode, and one eval loss (what is aligned: the comment above
test_trainer_equals_seqpar_launch_and_data_parallel's helpers)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from seqpar_testing import run_ranks, tolerances

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

S, VOCAB, N_TRAIN, N_EVAL, STEPS, LR = 64, 256, 16, 8, 3, 1e-3


def _model():
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=S, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).float()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, S), generator=torch.Generator().manual_seed(seed))  # (n, S)


def _order(n: int, seed: int) -> list[int]:
    """DistributedSampler's epoch-0 permutation (seed + epoch): the same for every number of replicas."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def reference(global_batch: int, accum: int) -> tuple[list[float], list[float], float]:
    """One process: each optimizer step takes the next global_batch x accum examples of the sampler's order, in accum
    micro-batches (each dp group's share of a step is a contiguous run of it, in rank order); loss = token mean."""
    model, train, evals = _model(), _ids(N_TRAIN, 1), _ids(N_EVAL, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    order, losses, norms = _order(N_TRAIN, 0), [], []
    per_step = global_batch * accum
    for step in range(STEPS):
        idx = [order[(step * per_step + i) % N_TRAIN] for i in range(per_step)]
        opt.zero_grad()
        total = 0.0
        for m in range(accum):
            ids = train[idx[m * global_batch : (m + 1) * global_batch]]
            loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())  # the norm before clipping
        opt.step()
        losses.append(total)
    with torch.no_grad():
        eval_loss = model(input_ids=evals, labels=evals).loss.item()
    return losses, norms, eval_loss


def _dp_order(world: int, sp: int, batch: int, accum: int) -> None:
    """The global batch a DistributedSampler over dp groups makes: rank r of dp takes order[r::dp], so one step's
    examples are interleaved across groups. The reference walks order contiguously, which is the same set per step
    only when each group's share is one example per micro-batch or dp is 1: the cases below keep to that."""
    dp = world // sp
    assert dp == 1 or batch == 1


def ranks_main(rank: int, world: int, cases: list[tuple]) -> list:
    from seqpar.runtime.hf.trainer import SeqparArguments, with_seqpar

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # the group already exists (seqpar_testing); accelerate reads the env
    train = datasets.Dataset.from_dict({"input_ids": _ids(N_TRAIN, 1).tolist()})
    evals = datasets.Dataset.from_dict({"input_ids": _ids(N_EVAL, 2).tolist()})
    out = []
    for trainer_kind, mode, sp, uly, batch, accum in cases:
        _dp_order(world, sp, batch, accum)
        common = dict(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
            gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
            weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
            optim="adamw_torch", disable_tqdm=True, gradient_checkpointing=False, bf16=False, ddp_find_unused_parameters=False,
        )  # fmt: skip
        seqpar = SeqparArguments(mode, sp, uly)
        if trainer_kind == "sft":
            from trl import SFTConfig, SFTTrainer

            args = SFTConfig(**common, max_length=S, packing=False, dataset_text_field="input_ids")
            trainer = with_seqpar(SFTTrainer)(model=_model(), args=args, train_dataset=train, eval_dataset=evals,
                                              processing_class=_tokenizer(), seqpar=seqpar)  # fmt: skip
        else:
            args = transformers.TrainingArguments(**common)
            trainer = with_seqpar(transformers.Trainer)(
                model=_model(), args=args, train_dataset=train, eval_dataset=evals, seqpar=seqpar
            )
        trainer.train()
        logged = [h for h in trainer.state.log_history if "loss" in h]
        out.append(([h["loss"] for h in logged], [h["grad_norm"] for h in logged], trainer.evaluate()["eval_loss"]))
    out.append(_refusals(trainer))  # the last trainer: what it refuses, with one line each
    return out


def _refusals(trainer) -> list[str]:
    from seqpar.plan.errors import SeqparError

    msgs = []
    odd = datasets.Dataset.from_dict({"input_ids": _ids(3, 3).tolist()})
    ids = _ids(2, 4)
    # left padding (right padding is masked out of the loss: seqpar.runtime.hf.trainer.even_rows)
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)}
    for call in (lambda: trainer.evaluate(eval_dataset=odd), lambda: trainer.compute_loss(trainer.model, padded)):
        try:
            call()
            msgs.append("no error")
        except SeqparError as e:
            msgs.append(str(e))
    return msgs


def _tokenizer():
    """A word-level tokenizer over VOCAB ids (SFTTrainer needs one for padding; the data is already token ids)."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB - 1)} | {"<pad>": VOCAB - 1}, unk_token="<pad>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")


# (trainer, mode, sp_degree, ulysses_degree, per-device batch, accumulation); one spawn per world size (a process that
# imports transformers costs tens of seconds here), every case inside it.
TWO = [
    ("trainer", "data_parallel", 1, None, 1, 1),
    ("trainer", "zigzag_ring_attn", 2, None, 2, 1),
    ("trainer", "ulysses_attn", 2, None, 2, 2),
    ("sft", "dist_flash_attn", 2, None, 2, 1),
]
FOUR = [("trainer", "ulysses_attn", 2, None, 1, 2), ("sft", "usp_attn", 4, 2, 4, 1)]


@pytest.mark.parametrize("world,cases", [(2, TWO), (4, FOUR)], ids=["2-ranks", "4-ranks"])
def test_trainer_losses_and_eval_loss_equal_the_reference(world, cases):
    pytest.importorskip("trl")
    results = run_ranks(ranks_main, world, cases, timeout=900)
    tol = tolerances(torch.float32)
    for i, (kind, mode, sp, _, batch, accum) in enumerate(cases):
        ref_losses, ref_norms, ref_eval = reference((world // sp) * batch, accum)
        for rank in range(world):
            losses, norms, eval_loss = results[rank][i]
            what = f"{kind} {mode} sp {sp} rank {rank}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol, msg=what)
            # the gradient itself (AdamW would hide a wrong scale in the losses): its norm before clipping
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **tol, msg=f"grad norm {what}")
            torch.testing.assert_close(torch.tensor(eval_loss), torch.tensor(ref_eval), **tol, msg=f"eval {what}")
    odd_eval, padded = results[0][-1]
    assert "the eval set's 3 examples do not split into batches" in odd_eval
    assert padded.startswith("the batch is padded on the left or inside a row (attention_mask holds a 0 before a 1)")


# --------------------------------------------------------------------------------------------- the Trainer vs seqpar launch
#
# The same training, once by seqpar launch's trainer (seqpar.runtime.train.loop.run, the function torchrun starts on every rank
# of `seqpar launch`, run here in-process on the gloo ranks) and once by with_seqpar(Trainer), for data parallel and a
# sequence-parallel mode. What is aligned, and how:
# - weights: one save_pretrained folder of _model(), read by both (`--model-path` / from_pretrained), fp32;
# - data: a .npy token file (ids 3..255: no EOS id, so one stream cut into seq_len documents, one per window) that the
#   launch reads as packed windows (input_ids, labels with the document's first token -100, position_ids). The Trainer's
#   train set holds the very windows the launch reads (seqpar.runtime.data.windows's batch(step, micro, dp rank)), each placed
#   where the Trainer's DistributedSampler (shuffled with the same seed) reaches it at the same step, micro-batch, dp
#   group and row; eval: N_EVAL held-out windows of a second file;
# - optimizer and schedule: AdamW (betas 0.9/0.999, eps 1e-8, no weight decay, foreach off on CPU in both), a constant
#   learning rate (no warmup), gradient clipping at 1.0, the same accumulation steps;
# - eval: the launch trains only; its exported model (the final checkpoint's save_pretrained) is scored on one process
#   over the held-out windows (HF's own shifted loss), the reference every Trainer's eval_loss must equal, whatever its
#   sp degree (every window scores seq_len - 1 tokens, so the Trainer's mean of batch means is the token mean).

# a larger learning rate than above: 3 steps move the weights well beyond the tolerance (random tokens teach little)
LAUNCH_SEED, LAUNCH_LR, N_HELDOUT = 3, 1e-2, 4


def _token_file(path: str, n: int, seed: int) -> str:
    import numpy as np

    np.save(path, np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.uint16))
    return path


def _launch_plan(world: int, mode: str, sp: int, uly: int | None, mbs: int, ga: int):
    from seqpar.plan.launch_plan import LaunchPlan

    from seqpar_testing.train import make_plan

    data = json.loads(make_plan(world, mode, sp, ulysses=uly or 1, ga=ga, mbs=mbs, steps=STEPS, lr=LAUNCH_LR).model_dump_json())
    data["training"].update(warmup_steps=0, lr_schedule="constant", weight_decay=0.0, grad_clip=1.0, seed=LAUNCH_SEED)
    return LaunchPlan.model_validate(data)


def _trainer_windows(data, dp: int, batch: int, accum: int) -> list[dict]:
    """The launch's windows, in the order the Trainer's sampler must deliver them: DistributedSampler gives dp group g
    the examples perm[g::dp], so row b of its micro-batch j is perm[(j * batch + b) * dp + g]."""
    n = STEPS * accum * dp * batch
    perm = _order(n, LAUNCH_SEED)
    rows: list = [None] * n
    for step in range(STEPS):
        for micro in range(accum):
            j = step * accum + micro
            for g in range(dp):
                got = data.batch(step, micro, g, grad_accum=accum, dp_degree=dp, micro_batch=batch)  # each (batch, S)
                for b in range(batch):
                    rows[perm[(j * batch + b) * dp + g]] = {k: v[b].tolist() for k, v in got.items()}
    return rows


def launch_vs_trainer_main(rank: int, world: int, tmp: str, cases: list[tuple]) -> dict:
    import torch.distributed as dist

    from seqpar.runtime.data.windows import DataOptions, open_training_data
    from seqpar.runtime.hf.trainer import SeqparArguments, with_seqpar
    from seqpar.runtime.train.loop import parser, run

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    model_dir, cache = f"{tmp}/model", f"{tmp}/cache"
    if rank == 0:
        _model().save_pretrained(model_dir)
        _token_file(f"{tmp}/train.npy", 40 * S, 0)
        _token_file(f"{tmp}/heldout.npy", N_HELDOUT * S, 1)
    dist.barrier()
    opts = DataOptions(cache=cache)
    train_data = open_training_data(
        f"{tmp}/train.npy", opts, seq_len=S, vocab_size=VOCAB, seed=LAUNCH_SEED, tokenizer_path=model_dir
    )
    heldout = open_training_data(f"{tmp}/heldout.npy", opts, seq_len=S, vocab_size=VOCAB, seed=0, tokenizer_path=model_dir)
    evals = datasets.Dataset.from_list([{k: v.tolist() for k, v in heldout.window(i).items()} for i in range(N_HELDOUT)])
    results = {}
    for mode, sp, uly, mbs, ga in cases:
        name, dp = f"{mode}-sp{sp}", world // sp
        plan_file, out = f"{tmp}/{name}.json", f"{tmp}/{name}"
        if rank == 0:
            _launch_plan(world, mode, sp, uly, mbs, ga).write(plan_file)
        dist.barrier()
        argv = ["--plan", plan_file, "--output", out, "--data", f"{tmp}/train.npy", "--model-path", model_dir]
        run(parser().parse_args(argv + ["--data-cache", cache]))
        dist.barrier()

        train = datasets.Dataset.from_list(_trainer_windows(train_data, dp, mbs, ga))
        args = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=mbs, per_device_eval_batch_size=1,
            gradient_accumulation_steps=ga, max_steps=STEPS, learning_rate=LAUNCH_LR, lr_scheduler_type="constant",
            weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
            seed=LAUNCH_SEED, optim="adamw_torch", disable_tqdm=True, ddp_find_unused_parameters=False,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = with_seqpar(transformers.Trainer)(
            model=model, args=args, train_dataset=train, eval_dataset=evals, seqpar=SeqparArguments(mode, sp, uly)
        )
        trainer.train()
        logged = [h for h in trainer.state.log_history if "loss" in h]
        hf = {"loss": [h["loss"] for h in logged], "grad_norm": [h["grad_norm"] for h in logged]}
        hf["eval_loss"] = trainer.evaluate()["eval_loss"]
        if rank == 0:
            from seqpar_testing.train import read_metrics

            launched = read_metrics(out)
            results[name] = {
                "launch": {key: [m[key] for m in launched] for key in ("loss", "grad_norm")},
                "launch_eval": _one_process_eval(f"{out}/checkpoints/step-{STEPS:06d}/model", evals),
                "trainer": hf,
            }
        dist.barrier()
    if rank == 0:
        results["untrained"] = _one_process_eval(model_dir, evals)
    return results


def _one_process_eval(model_dir: str, evals) -> float:
    """The token-mean loss of the exported model over the held-out windows, on this process alone."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = {k: torch.tensor(evals[k]) for k in ("input_ids", "labels", "position_ids")}  # each (N, S)
    with torch.no_grad():
        return model(**batch).loss.item()


# (mode, sp_degree, ulysses_degree, micro-batch per rank, accumulation): with sp ranks per group, a micro-batch of sp
# windows per group reads the same windows per step as data parallel's one per rank.
LAUNCH_TWO = [("data_parallel", 1, None, 1, 2), ("zigzag_ring_attn", 2, None, 2, 2)]
LAUNCH_FOUR = [("data_parallel", 1, None, 1, 1), ("usp_attn", 4, 2, 4, 1)]


# 4 ranks (usp ulysses 2 x ring 2) are the slow set: the Trainer's 4-rank layouts are the reference test's above
@pytest.mark.parametrize(
    "world,cases", [(2, LAUNCH_TWO), pytest.param(4, LAUNCH_FOUR, marks=pytest.mark.slow)], ids=["2-ranks", "4-ranks"]
)
def test_trainer_equals_seqpar_launch_and_data_parallel(tmp_path, world, cases):
    got = run_ranks(launch_vs_trainer_main, world, str(tmp_path), cases, timeout=600)[0]
    untrained = got.pop("untrained")
    tol = tolerances(torch.float32)
    ref = got["data_parallel-sp1"]
    for name, r in got.items():
        for key in ("loss", "grad_norm"):
            want = torch.tensor(ref["launch"][key], dtype=torch.float64)
            assert len(want) == STEPS
            for who in ("launch", "trainer"):  # step for step: seqpar launch, the Trainer, each vs launch's data parallel
                torch.testing.assert_close(torch.tensor(r[who][key], dtype=torch.float64), want, **tol, msg=f"{name} {who} {key}")
        # eval: the same value for every sp degree, the Trainer's and the launch's exported model's alike (not x sp)
        for value, who in ((r["trainer"]["eval_loss"], "trainer"), (r["launch_eval"], "launch")):
            torch.testing.assert_close(torch.tensor(value), torch.tensor(ref["launch_eval"]), **tol, msg=f"{name} {who} eval")
    # the updates were applied (else equal eval losses would prove little): the held-out loss moved from the untrained one
    assert abs(ref["launch_eval"] - untrained) > 100 * (tol["atol"] + tol["rtol"] * untrained), (ref["launch_eval"], untrained)
