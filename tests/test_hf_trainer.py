"""transformers' Trainer and TRL's SFTTrainer in seqpar's modes (seqpar.runtime.hf_trainer) on 2 and 4 gloo CPU ranks:
the per-step training losses, gradient norms and the eval loss equal a single-process reference on the same batches (the
same model, AdamW, clipping and accumulation), for data parallel and for every sequence-parallel mode, so they also equal
each other: the eval loss is the same for every sp degree."""

from __future__ import annotations

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
    from seqpar.runtime.hf_trainer import SeqparArguments, with_seqpar

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
    from seqpar.errors import SeqparError

    msgs = []
    odd = datasets.Dataset.from_dict({"input_ids": _ids(3, 3).tolist()})
    ids = _ids(2, 4)
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids).index_fill_(1, torch.tensor([S - 1]), 0)}
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
    assert padded.startswith("the batch is padded (attention_mask holds zeros)")
