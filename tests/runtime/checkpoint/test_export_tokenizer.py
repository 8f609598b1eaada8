"""The export of `seqpar launch` is a folder a user loads as it is: a run on chat data (a byte-level tokenizer with a
ChatML template, zigzag on 2 gloo ranks) exports its weights with the tokenizer and chat template it trained with, and
AutoTokenizer / AutoModelForCausalLM load it; a run whose tokenizer is a separate --tokenizer folder exports that one;
a run on token files from a folder of weights alone exports no tokenizer (there is none). Then `seqpar eval` on
held-out chats scores what training scored, the assistant's tokens (`--score all`: every token), through the export and
through --tokenizer, equal to plain transformers on the same windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from seqpar_testing import run_ranks
from seqpar_testing.chat import VOCAB, byte_tokenizer, write_chats
from seqpar_testing.train import make_plan

pytest.importorskip("datasets")
SEQ, STEPS, EVAL_LEN, WINDOWS = 64, 3, 64, 3


def _plan(world: int, mode: str, sp: int):
    """The tiny model's plan with the byte tokenizer's vocabulary."""
    from seqpar.plan.launch_plan import LaunchPlan

    data = json.loads(make_plan(world, mode, sp, steps=STEPS, seq_len=SEQ).model_dump_json())
    data["workload"]["model"]["vocab_size"] = VOCAB
    return LaunchPlan.model_validate(data)


def _folders(tmp: Path) -> dict[str, str]:
    """A model folder with its tokenizer, the same weights alone, and the tokenizer alone."""
    from seqpar.runtime.hf.model import build_model

    plan = _plan(1, "data_parallel", 1)
    model = build_model(plan.workload.model, model_path=None, seed=0, rope_theta=None)
    out = {"with_tok": tmp / "model", "weights": tmp / "weights", "tok": tmp / "tok"}
    for name in ("with_tok", "weights"):
        model.save_pretrained(out[name])
    byte_tokenizer(out["with_tok"])
    byte_tokenizer(out["tok"])
    return {k: str(v) for k, v in out.items()}


def launch_and_eval(rank: int, world: int, tmp: str, folders: dict, data: dict) -> dict:
    """Rank body: three runs of seqpar launch's trainer (in-process), then seqpar eval's ranks on the first export."""
    import torch.distributed as dist

    from seqpar.runtime.eval.run import parser as eval_parser
    from seqpar.runtime.eval.run import run as eval_run
    from seqpar.runtime.train.loop import parser, run

    plan_file = Path(tmp) / "plan.json"
    if rank == 0:
        _plan(world, "zigzag_ring_attn", 2).write(plan_file)
    dist.barrier()
    runs = {
        "chat": ["--data", data["train"], "--model-path", folders["with_tok"]],
        "tokenizer_flag": ["--data", data["train"], "--model-path", folders["weights"], "--tokenizer", folders["tok"]],
        "tokens": ["--data", data["tokens"], "--model-path", folders["weights"]],
    }
    for name, argv in runs.items():
        run(parser().parse_args(["--plan", str(plan_file), "--output", f"{tmp}/{name}", "--data-cache", f"{tmp}/cache", *argv]))
        dist.barrier()
    export = f"{tmp}/chat/checkpoints/step-{STEPS:06d}/model"
    reports = {}
    evals = {
        "trained": ["--model-path", export],
        "all": ["--model-path", export, "--score", "all"],
        "tokenizer_flag": ["--model-path", export, "--tokenizer", folders["tok"]],
    }
    for name, argv in evals.items():
        base = ["--plan", str(plan_file), "--output", f"{tmp}/eval-{name}", "--data", data["heldout"], "--seq-len", str(EVAL_LEN)]
        reports[name] = eval_run(eval_parser().parse_args([*base, "--windows", str(WINDOWS), "--buckets", "4", *argv]))
        dist.barrier()
    return reports


@torch.no_grad()
def _reference(model, tok_dir: str, heldout: Path, which: str) -> list[float | None]:
    """Plain transformers on one process: the held-out chats rendered by the tokenizer and concatenated, cut into windows
    of EVAL_LEN + 1 tokens; each window's mean cross-entropy over the targets that are the assistant's tokens
    (transformers' own assistant mask of the template's generation marks), or over all of them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids, mask = [], []
    for line in heldout.read_text().splitlines():
        out = tok.apply_chat_template(json.loads(line)["messages"], return_dict=True, return_assistant_tokens_mask=True)
        ids += out["input_ids"]
        mask += out["assistant_masks"]
    n = EVAL_LEN + 1
    result = []
    for k in range(WINDOWS):
        w, m = torch.tensor(ids[k * n : (k + 1) * n]), torch.tensor(mask[k * n : (k + 1) * n], dtype=torch.bool)
        ce = F.cross_entropy(model(w[None, :-1]).logits[0], w[1:], reduction="none")  # (L,)
        keep = m[1:] if which == "trained" else torch.ones_like(ce, dtype=torch.bool)
        result.append(float(ce[keep].mean()) if keep.any() else None)
    return result


def test_export_loads_with_its_tokenizer_and_eval_scores_what_training_scored(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folders = _folders(tmp_path)
    train = write_chats(tmp_path / "train.jsonl", 24, 0)
    heldout = write_chats(tmp_path / "heldout.jsonl", 8, 5)
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16))
    data = {"train": str(train), "heldout": str(heldout), "tokens": str(tmp_path / "tokens.npy")}
    reports = run_ranks(launch_and_eval, 2, str(tmp_path), folders, data, timeout=600)[0]

    trained_tok = AutoTokenizer.from_pretrained(folders["tok"])
    chat = json.loads(heldout.read_text().splitlines()[0])["messages"]
    for name in ("chat", "tokenizer_flag"):
        export = tmp_path / name / "checkpoints" / f"step-{STEPS:06d}" / "model"
        tok = AutoTokenizer.from_pretrained(export)  # as it is: no --tokenizer, no copying of files
        model = AutoModelForCausalLM.from_pretrained(export)
        assert tok.chat_template == trained_tok.chat_template, name
        assert tok.apply_chat_template(chat) == trained_tok.apply_chat_template(chat), name
        assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|pad|>"), name
        assert model.config.vocab_size == VOCAB and len(tok) <= VOCAB, name
    tokens_export = tmp_path / "tokens" / "checkpoints" / f"step-{STEPS:06d}" / "model"
    assert (tokens_export / "model.safetensors").is_file() and not (tokens_export / "tokenizer.json").exists()

    export = tmp_path / "chat" / "checkpoints" / f"step-{STEPS:06d}" / "model"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float64).eval()
    for name, which in (("trained", "trained"), ("all", "all"), ("tokenizer_flag", "trained")):
        (row,) = reports[name]["lengths"]
        want = _reference(model, str(export), heldout, which)
        assert row["scored"] == which and any(w is not None for w in want)
        for got, ref in zip(row["window_losses"], want):
            assert (got is None) == (ref is None), (name, row["window_losses"], want)
            if ref is not None:
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)
    trained, every = reports["trained"]["lengths"][0], reports["all"]["lengths"][0]
    assert trained["tokens"] < every["tokens"] == WINDOWS * EVAL_LEN  # the assistant's tokens are a part of the windows
