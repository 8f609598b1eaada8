"""Bad data refused by `seqpar launch` before any rank starts: exit 2, one line naming the file, the value, the rule
and a fix, nothing written to --output (the launcher's data check, seqpar.runtime.launch.run.preflight)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from seqpar.cli import app

from seqpar_testing.cli import one_error_line
from seqpar_testing.data import PLAIN, make_tokenizer
from seqpar_testing.train import make_plan

runner = CliRunner()


def _write(tmp_path, case: str) -> tuple[str, list[str]]:
    """(the --data path, extra flags) of one bad input."""
    p = tmp_path / "d.jsonl"
    if case == "corrupt_npy":
        p = tmp_path / "d.npy"
        p.write_bytes(b"\x93NUMPY\x01\x00garbage" + bytes(range(40)))
    elif case == "empty_npy":
        p = tmp_path / "d.npy"
        np.save(p, np.zeros(0, dtype=np.uint16))
    elif case == "empty_bin":
        p = tmp_path / "d.bin"
        p.write_bytes(b"")
    elif case == "torn_bin":
        p = tmp_path / "d.bin"
        p.write_bytes(b"\x01\x00\x02")  # 1.5 uint16 tokens
    elif case == "negative":
        p = tmp_path / "d.npy"
        np.save(p, np.array([5, 6, -3, 7], dtype=np.int32))
    elif case == "vocab":
        p = tmp_path / "d.npy"
        np.save(p, np.array([5, 6, 7, 300, 8], dtype=np.uint16))
    elif case == "not_utf8":
        p.write_bytes(b'{"text": "w1"}\n{"text": "w2"}\n{"text": "caf\xe9"}\n')
    elif case == "neither":
        p.write_text('{"text": "w1"}\n{"prompt": "w2", "completion": "w3"}\n')
    elif case == "bad_messages":
        p.write_text('{"messages": [{"content": "w1"}]}\n')
    elif case == "not_json":
        p.write_text('{"text": "w1"}\n\n{"text": "w2"\n')
    elif case == "empty_jsonl":
        p.write_text("\n\n")
    elif case == "long":
        p.write_text('{"text": "w1"}\n' + json.dumps({"text": " ".join(["w2"] * 80)}) + "\n")
        return str(p), ["--long-documents", "error"]
    elif case == "no_template":
        p.write_text('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n')
        return str(p), ["--tokenizer", make_tokenizer(tmp_path / "plain", None)]
    elif case == "policy":
        p.write_text('{"text": "w1"}\n')
        return str(p), ["--long-documents", "chop"]
    return str(p), []


CASES = [
    ("corrupt_npy", "d.npy' is not a readable .npy file"),
    ("empty_npy", "d.npy' holds no tokens (shape (0,))"),
    ("empty_bin", "d.bin' is empty (0 bytes)"),
    ("torn_bin", "d.bin' has 3 bytes, not a whole number of uint16 tokens"),
    ("negative", "holds token id -3 at index 2, negative"),
    ("vocab", "holds token id 300 at index 3, outside the model's vocabulary of 256"),
    ("not_utf8", "d.jsonl' line 3 is not UTF-8 (byte 0xe9 at column 14); re-encode the file as UTF-8"),
    ("neither", "d.jsonl' line 2 is neither a text nor a chat row (it has ['completion', 'prompt'])"),
    ("bad_messages", "d.jsonl' line 1 has 'messages' that are not a non-empty list"),
    ("not_json", "d.jsonl' line 3 is not JSON"),
    ("empty_jsonl", "d.jsonl' holds no documents"),
    ("long", "d.jsonl' line 2 is a document of 81 tokens, longer than the window of seq_len 64"),
    ("no_template", "holds chats ('messages'), and the tokenizer"),
    ("policy", "--long-documents 'chop' is not one of split, truncate, error"),
]


@pytest.mark.parametrize("case, match", CASES, ids=[c for c, _ in CASES])
def test_bad_data_is_one_line_exit_2_before_any_rank_starts(tmp_path, case, match):
    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2).write(plan)
    data, extra = _write(tmp_path, case)
    if "--tokenizer" not in extra:
        extra += ["--tokenizer", make_tokenizer(tmp_path / "tok")]
    out = tmp_path / "out"
    args = ["launch", str(plan), "--data", data, "--output", str(out), "--data-cache", str(tmp_path / "cache"), *extra]
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert match in one_error_line(r)
    assert not out.exists()


def test_without_datasets_text_data_names_the_extra_to_install(tmp_path, monkeypatch):
    from seqpar.plan.errors import SeqparError
    from seqpar.runtime.data.windows import DataOptions, open_training_data

    (tmp_path / "d.jsonl").write_text('{"text": "w1"}\n')
    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` meets when it is not installed
    with pytest.raises(
        SeqparError,
        match=r"d.jsonl' is tokenized with the `datasets` package, which is not installed; pip install .*\[runtime\]",
    ):
        open_training_data(str(tmp_path / "d.jsonl"), DataOptions(cache=str(tmp_path / "c")), seq_len=8, vocab_size=256)


def test_a_chat_template_that_is_not_prefix_stable_is_refused_with_its_line(tmp_path):
    from seqpar.plan.errors import SeqparError
    from seqpar.runtime.data.windows import DataOptions, open_training_data

    # an assistant turn rendered one way when last and another way before a later turn (as templates that drop
    # earlier reasoning do): its tokens cannot be found by rendering prefixes
    shifty = PLAIN.replace(
        "{{ m['content'] + ' </s> ' }}{% else %}", "{{ m['content'] + (' </s> ' if loop.last else ' w0 </s> ') }}{% else %}"
    )
    tok = make_tokenizer(tmp_path / "tok", shifty)
    rows = [
        {"text": "w1"},
        {
            "messages": [
                {"role": "user", "content": "w1"},
                {"role": "assistant", "content": "w2"},
                {"role": "user", "content": "w3"},
            ]
        },
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        SeqparError, match=r"d.jsonl' line 2: the chat template renders this conversation other than as its beginnings"
    ):
        open_training_data(
            str(tmp_path / "d.jsonl"), DataOptions(cache=str(tmp_path / "c")), seq_len=8, vocab_size=256, tokenizer_path=tok
        )
