"""The README's with_seqpar recipe on chat data, as a user runs it: TRL's SFTTrainer with packing (wrapped: rows cut at
max_length, the epoch's last row short; bfd: padding-free rows of whole conversations), assistant-only loss, a byte-level
tokenizer and a whole epoch, on 2 gloo ranks. Every sequence-parallel mode trains the epoch, and its per-step losses and
gradient norms equal sp=1's within 1e-4 on the same batches: the short last row is padded to the mode's split with
masked labels (``uneven_rows="pad"``), or left out and counted (``"drop"``).

How the batches line up: data parallel at sp=1 on 2 ranks (one row per rank, the rank's token mean, averaged over the
ranks) reads, step for step, what a sequence-parallel group of 2 reads in 2 accumulated micro-batches of one row (the
sampler's order perm[2j], perm[2j+1]); the Trainer averages the micro-batches' means the same way. The slow set adds
two rows per micro-batch (a full row beside the short one: right padding, masked) and padding-free BFD rows, against
TRL's SFTTrainer alone on one process (its own collator, attention mask and loss)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from seqpar_testing import run_ranks

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

MAX_LEN, TOL = 128, dict(rtol=1e-4, atol=1e-4)
N_CHATS, SEED = 28, 0  # 4313 tokens: 33 rows of 128 and a last row of 89, which no sp=2 mode splits (89 is odd)


def sft_main(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    from trl import SFTConfig, SFTTrainer

    from seqpar.runtime.hf.trainer import SeqparArguments, with_seqpar

    from seqpar_testing.chat import byte_tokenizer, conversations, tiny_llama

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    tok = byte_tokenizer(tempfile.mkdtemp())
    train = datasets.Dataset.from_list(conversations(N_CHATS, SEED))
    out = []
    for mode, sp, uly, batch, accum, packing, uneven in cases:
        args = SFTConfig(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
            num_train_epochs=1, learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, optim="adamw_torch",
            disable_tqdm=True, activation_checkpointing=False, bf16=False, ddp_find_unused_parameters=False,
            max_length=MAX_LEN, packing=True, packing_strategy=packing, assistant_only_loss=True,
        )  # fmt: skip
        common = dict(model=tiny_llama(), args=args, train_dataset=train, processing_class=tok)
        if mode is None:  # TRL alone: its own loader, collator and loss
            trainer = SFTTrainer(**common)
        else:
            trainer = with_seqpar(SFTTrainer)(**common, seqpar=SeqparArguments(mode, sp, uly, uneven_rows=uneven))
        rows = [len(r) for r in trainer.train_dataset["input_ids"]]
        trainer.train()
        logged = [h for h in trainer.state.log_history if "loss" in h]
        out.append(
            {
                "loss": [h["loss"] for h in logged],
                "grad_norm": [h["grad_norm"] for h in logged],
                "steps": trainer.state.global_step,
                "epoch": trainer.state.epoch,
                "rows": rows,
                "dropped": getattr(trainer, "seqpar_dropped", {}).get("training"),
            }
        )
    return out


def _same(got: dict, ref: dict, what: str) -> None:
    assert got["steps"] == ref["steps"] and got["epoch"] == pytest.approx(1.0), (what, got["steps"], ref["steps"])
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), **TOL, msg=f"{what} {key}")


# (mode, sp_degree, ulysses_degree, per-device batch, accumulation, packing_strategy, uneven_rows)
REF_DP = ("data_parallel", 1, None, 1, 1, "wrapped", "pad")  # 2 ranks, one row each: the sp=1 reference
ZIGZAG = ("zigzag_ring_attn", 2, None, 1, 2, "wrapped", "pad")
DROP = ("zigzag_ring_attn", 2, None, 1, 2, "wrapped", "drop")


def test_wrapped_packing_whole_epoch_equals_sp1_and_drop_counts():
    """A whole epoch of wrapped packing at zigzag sp=2 (its last row of 89 tokens, not a multiple of 2 * sp, once stopped
    the run: "seq_len 89 is not divisible by 2*sp_degree = 4") equals data parallel's sp=1 step for step; with
    uneven_rows="drop" the short row is left out and counted."""
    ref, zigzag, drop = run_ranks(sft_main, 2, [REF_DP, ZIGZAG, DROP], timeout=600)[0]
    assert ref["rows"][-1] == 89 and len(ref["rows"]) == 34 and set(ref["rows"][:-1]) == {MAX_LEN}  # the short row exists
    assert ref["steps"] == 17
    _same(zigzag, ref, "zigzag_ring_attn sp 2")
    assert drop["dropped"] == {"rows": 1, "tokens": 89, "kept_rows": 33}
    assert drop["steps"] == 17 and drop["epoch"] == pytest.approx(1.0)  # 33 rows in micro-batches of one, 2 per step
    assert all(torch.isfinite(torch.tensor(drop["loss"])))


SLOW_TWO = [
    ("ulysses_attn", 2, None, 1, 2, "wrapped", "pad"),
    ("dist_flash_attn", 2, None, 1, 2, "wrapped", "pad"),
    ("usp_attn", 2, 1, 1, 2, "wrapped", "pad"),
    ("usp_attn", 2, 2, 1, 2, "wrapped", "pad"),
    ("zigzag_ring_attn", 2, None, 2, 1, "wrapped", "pad"),  # a full row beside the short one: right padding
    ("ulysses_attn", 2, None, 2, 1, "wrapped", "pad"),
    ("zigzag_ring_attn", 2, None, 2, 1, "bfd", "pad"),  # padding-free rows: flattened, any length
    ("dist_flash_attn", 2, None, 2, 1, "bfd", "pad"),
]
SLOW_ONE = [(None, 1, None, 2, 1, "wrapped", None), (None, 1, None, 2, 1, "bfd", None)]  # TRL alone, one process


@pytest.mark.slow
def test_every_mode_whole_epoch_equals_one_process():
    """Every mode, one row per micro-batch against data parallel at sp=1; two rows per micro-batch (wrapped and BFD)
    against TRL's SFTTrainer alone on one process."""
    one = run_ranks(sft_main, 1, SLOW_ONE, timeout=600)[0]
    two = run_ranks(sft_main, 2, [REF_DP, *SLOW_TWO], timeout=900)[0]
    ref_dp, got = two[0], two[1:]
    refs = {("wrapped", 2): one[0], ("bfd", 2): one[1]}
    for case, r in zip(SLOW_TWO, got):
        mode, sp, uly, batch, _, packing, _ = case
        _same(r, ref_dp if batch == 1 else refs[(packing, batch)], f"{mode} sp {sp} ulysses {uly} batch {batch} {packing}")


# --------------------------------------------------------------------------------------------- the batch, on one process


def test_even_rows_masks_right_padding_pads_to_the_split_and_refuses_left_padding():
    from seqpar.plan.errors import SeqparError
    from seqpar.runtime.hf.trainer import even_rows

    ids = torch.arange(1, 11).reshape(2, 5)  # (2, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    got = even_rows({"input_ids": ids, "attention_mask": mask}, 4)
    assert got["input_ids"].shape == (2, 8) and got["position_ids"] is None
    assert got["labels"].tolist() == [[1, 2, 3, 4, 5, -100, -100, -100], [6, 7, 8, -100, -100, -100, -100, -100]]
    pos = torch.tensor([[0, 1, 2, 0, 1]])  # padding-free: one row of two documents
    got = even_rows({"input_ids": ids[:1], "labels": ids[:1], "position_ids": pos}, 4)
    assert got["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]  # the padding: a document of its own
    same = even_rows({"input_ids": ids[:, :4]}, 4)
    assert same["labels"] is None and same["input_ids"] is not None  # nothing to mask or pad: prepare_inputs' default
    left = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.raises(SeqparError, match=r"padded on the left or inside a row \(attention_mask holds a 0 before a 1\)"):
        even_rows({"input_ids": ids, "attention_mask": left}, 1)


@torch.no_grad()
def test_a_row_that_scores_nothing_counts_nothing():
    """A packed row with no assistant token beside one with some (real chat data at any max_length): the batch's loss is
    the mean over the scored tokens, as TRL's own loss counts them, not an error."""
    from seqpar.runtime.hf.trainer import even_rows
    from seqpar.runtime.parallel.inputs import prepare_inputs
    from seqpar.runtime.parallel.loss import loss as group_loss

    from seqpar_testing.chat import VOCAB, tiny_llama

    model = tiny_llama().eval()
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))  # (2, 6)
    labels = ids.clone()
    labels[1] = -100  # row 1: a user turn only
    labels[0, :2] = -100
    rows = even_rows({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}, 1)
    shard = prepare_inputs(rows["input_ids"], "data_parallel", 0, 1, labels=rows["labels"], require_scored=False)
    got = group_loss(model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits, shard["labels"])
    logits = model(input_ids=ids).logits[:, :-1].reshape(-1, VOCAB)
    want = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
