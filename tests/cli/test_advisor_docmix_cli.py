"""`seqpar advise` / `check` / `explain` with packed documents: --doc-lens, --mean-doc-len, --data (+ --eos-id).

Every source of the same lengths gives the same mix in the plan; bad input is one line on stderr and exit 2 with nothing
written; the advisor reads data files without importing torch.
"""

from __future__ import annotations

import array
import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from seqpar.advisor.doc_lens import mix_from_counts
from seqpar.cli import app

LENGTHS = [16, 16, 300, 1200, 5000, 40000]  # 40000: longer than the 32K window, split into window-sized pieces
H200 = ["--gpu", "h200", "--gpus", "8"]


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def advise_json(runner, *args):
    r = runner.invoke(app, ["advise", "--seq-len", "32k", *H200, "--json", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def expected_histogram(lengths):
    return [list(b) for b in mix_from_counts(sorted((n, lengths.count(n)) for n in set(lengths)), "x").histogram]


def test_every_lengths_file_format_gives_the_same_mix(runner, tmp_path):
    (tmp_path / "lines.txt").write_text("\n".join(map(str, LENGTHS)) + "\n\n")
    (tmp_path / "list.json").write_text(json.dumps(LENGTHS))
    (tmp_path / "hist.csv").write_text("length,count\n16,2\n300,1\n1200,1\n5000,1\n40000,1\n7,0\n")
    want = expected_histogram(LENGTHS)
    for name in ("lines.txt", "list.json", "hist.csv"):
        mix = advise_json(runner, "--doc-lens", str(tmp_path / name))["workload"]["doc_lens"]
        assert mix["histogram"] == want and mix["documents"] == 6 and name in mix["source"], name
        assert mix["mean_tokens"] == pytest.approx(sum(LENGTHS) / 6)
        assert 0 < mix["sum_sq_fraction"] < 1


def test_mean_doc_len_and_the_plan_it_writes(runner, tmp_path):
    out = tmp_path / "plan.json"
    dense = advise_json(runner, "--mode", "zigzag_ring_attn")
    r = runner.invoke(
        app, ["advise", "--seq-len", "32k", *H200, "--mode", "zigzag_ring_attn", "--mean-doc-len", "2048", "-o", str(out)]
    )
    assert r.exit_code == 0, r.stderr
    assert "documents: long-tail model" in r.stderr and "of one document per window" in r.stderr
    plan = json.loads(out.read_text())
    mix = plan["workload"]["doc_lens"]
    assert mix["mean_tokens"] == pytest.approx(2048, rel=1e-4) and mix["documents"] is None
    assert plan["prediction"]["tokens_per_s"] > dense["prediction"]["tokens_per_s"]
    assert plan["prediction"]["peak_memory_gib"] == dense["prediction"]["peak_memory_gib"]
    e = runner.invoke(app, ["explain", str(out)], terminal_width=200)
    assert e.exit_code == 0 and "Packed documents" in e.stdout and "busiest rank / mean" in e.stdout
    assert "packed, mean 2,048 tokens" in e.stdout
    c = runner.invoke(app, ["check", str(out), "--json"])
    assert c.exit_code == 0 and json.loads(c.stdout)["prediction"] == plan["prediction"]
    # the plan re-checked on another mix: shorter documents, less attention, more tokens/s
    c2 = runner.invoke(app, ["check", str(out), "--mean-doc-len", "256", "--json"])
    assert c2.exit_code == 0, c2.stderr
    assert json.loads(c2.stdout)["prediction"]["tokens_per_s"] > plan["prediction"]["tokens_per_s"]


def test_check_from_flags_uses_the_mix(runner):
    args = ["check", "--seq-len", "128k", *H200, "--mode", "ulysses_attn", "--json"]
    dense = json.loads(runner.invoke(app, args).stdout)["prediction"]
    r = runner.invoke(app, [*args, "--mean-doc-len", "4096"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["prediction"]["tokens_per_s"] > dense["tokens_per_s"]


def test_data_samples(runner, tmp_path):
    np = pytest.importorskip("numpy")
    texts = ["a" * 60, "b" * 3, "c" * 4000]
    jsonl = tmp_path / "d.jsonl"
    rows = [{"text": t} for t in texts] + [
        {"messages": [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 41}]}
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    want = [math.ceil(len(t) / 4) + 1 for t in texts] + [math.ceil(81 / 4) + 2 * 4]  # characters/4 (+EOS, +4 per message)
    mix = advise_json(runner, "--data", str(jsonl))["workload"]["doc_lens"]
    assert mix["histogram"] == expected_histogram(want) and "characters/4" in mix["source"]

    eos, docs = 2, [[5] * 99 + [2], [7] * 9 + [2], [9] * 2999 + [2], [4] * 30]  # the last one ends the file without an EOS
    ids = [t for d in docs for t in d]
    (tmp_path / "t.bin").write_bytes(array.array("H", ids).tobytes())  # llama-2-7b's 32000 ids fit uint16
    np.save(tmp_path / "t.npy", np.array(ids, dtype=">i4"))  # a big-endian int32 .npy
    for name in ("t.bin", "t.npy"):
        mix = advise_json(runner, "--data", str(tmp_path / name), "--eos-id", str(eos))["workload"]["doc_lens"]
        assert mix["histogram"] == expected_histogram([100, 10, 3000, 30]) and mix["documents"] == 4, name
    assert advise_json(runner, "--data", "synthetic")["workload"]["doc_lens"] is None


BAD = [
    (["--doc-lens", "{empty}"], "is empty"),
    (["--doc-lens", "{words}"], "line 2: 'abc' is not an integer document length"),
    (["--doc-lens", "{zero}"], "document length 0 is not positive"),
    (["--doc-lens", "{negative}"], "document length -3 is not positive"),
    (["--doc-lens", "{jsonbad}"], "JSON item '12' is not an integer"),
    (["--doc-lens", "{csvbad}"], "count -1 is negative"),
    (["--doc-lens", "{missing}"], "does not exist"),
    (["--mean-doc-len", "0"], "--mean-doc-len 0 must be a positive number of tokens"),
    (["--mean-doc-len", "-5"], "--mean-doc-len -5 must be a positive number of tokens"),
    (["--mean-doc-len", "40000"], "--mean-doc-len 40000 is longer than the window (seq_len 32768)"),
    (["--mean-doc-len", "512", "--doc-lens", "{empty}"], "--doc-lens and --mean-doc-len both describe the document lengths"),
    (["--eos-id", "2"], "--eos-id 2 is for --data token files"),
    (["--data", "{bin}"], "holds token ids: give the id that ends each document with --eos-id"),
    (["--data", "{bin}", "--eos-id", "3"], "no EOS id 3 in its first 4 tokens"),
    (["--data", "{csvbad}"], "has an unknown type '.csv'"),
    (["--data", "{jsonl}"], 'line 1 has neither a "text" string nor a "messages" list'),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_is_one_line_and_exit_2(runner, tmp_path, args, message):
    files = {
        "empty": "\n\n",
        "words": "12\nabc\n",
        "zero": "5\n0\n",
        "negative": "-3\n",
        "jsonbad": '[1, "12"]',
        "csvbad.csv": "length,count\n100,-1\n",
        "jsonl.jsonl": '{"body": "x"}\n',
    }
    paths = {k.split(".")[0]: tmp_path / k for k in files}
    for k, text in files.items():
        (tmp_path / k).write_text(text)
    (tmp_path / "t.bin").write_bytes(array.array("H", [5, 6, 7, 8]).tobytes())
    paths.update(bin=tmp_path / "t.bin", missing=tmp_path / "nope.txt")
    out = tmp_path / "plan.json"
    argv = [a.format(**{k: str(v) for k, v in paths.items()}) for a in args]
    r = runner.invoke(app, ["advise", "--seq-len", "32k", *H200, "-o", str(out), *argv])
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert not out.exists()


def test_advisor_reads_the_mix_without_torch(tmp_path):
    (tmp_path / "t.bin").write_bytes(array.array("H", [5, 6, 2, 7, 2]).tobytes())
    code = (
        "import sys; from typer.testing import CliRunner; import seqpar.cli; "
        f"r = CliRunner().invoke(seqpar.cli.app, ['advise', '--seq-len', '512k', '--json', '--data', {str(tmp_path / 't.bin')!r}, '--eos-id', '2']); "
        "assert r.exit_code == 0, r.output; "
        "r = CliRunner().invoke(seqpar.cli.app, ['explain', '--help']); "
        "r = CliRunner().invoke(seqpar.cli.app, ['check', '--seq-len', '512k', '--mean-doc-len', '4096']); "
        "assert r.exit_code in (0, 1), r.output; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
