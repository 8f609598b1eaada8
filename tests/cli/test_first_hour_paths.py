"""The paths a new user takes in the first hour, each of which broke: calibrate on what launch writes, the launch flags the
docs and the trainer name, the torch-free dry run in an install of only the declared dependencies, a missing optional
dependency named with its extra, the multi-node rendezvous rule, and advise without -o.

"Only the declared dependencies" is checked without building a venv: a subprocess hides every installed top-level module
that is neither the standard library nor in the closure of pyproject.toml's base dependencies (sys.modules[name] = None,
which import and importlib.util.find_spec both read as absent), runs the command, and lists what it imported.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.runtime.train.loop import parser as train_parser

from seqpar_testing.train import make_plan

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def error_line(r, code: int) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == code and len(lines) == 1, (r.exit_code, r.stderr, r.stdout)
    return lines[0]


# --------------------------------------------------------------------------------------------- calibrate


def _report(tmp_path: Path, folder: str) -> Path:
    """A run folder as seqpar launch leaves it (run_report.json with the plan and the measured figures)."""
    plan = tmp_path / "gpu_plan.json"
    assert invoke("advise", "-s", "128k", "--gpu", "h200", "--gpus", "8", "-o", plan).exit_code == 0
    out = tmp_path / folder
    out.mkdir(parents=True)
    report = {"plan": json.loads(plan.read_text()), "measured": {"tokens_per_s": 25000.0, "peak_memory_gib": 60.0}}
    (out / "run_report.json").write_text(json.dumps(report))
    return out


def test_calibrate_reads_run_folders_and_the_documented_glob(tmp_path):
    from seqpar.advisor.cost.measurements import load_measurements

    shipped = len(load_measurements())
    run = _report(tmp_path, "runs/a")
    staged = _report(tmp_path, "runs/b/stage-0").parent  # a recipe's run: its stages' reports
    r = invoke("calibrate", run, staged, "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["rows"]) == shipped + 2
    empty = tmp_path / "runs" / "empty"
    empty.mkdir()
    assert "holds no run_report.json" in error_line(invoke("calibrate", empty), 2)
    # what launch writes is what the docs glob for (README and the command's help)
    for text in ((ROOT / "README.md").read_text(), invoke("calibrate", "--help").stdout):
        assert "runs/*/report.json" not in text and "runs/*/run_report.json" in text


# --------------------------------------------------------------------------------------------- launch flags


def _tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "the", "long", "context", "model", "reads"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    return folder


def test_launch_passes_tokenizer_log_every_and_fsdp_offload_to_the_trainer(tmp_path):
    plan = tmp_path / "plan.json"
    make_plan(2, "zigzag_ring_attn", 2, sharding="fsdp", seq_len=16).write(plan)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "the long context model reads " * 20}) + "\n" for _ in range(8)))
    # without a tokenizer the text data is refused, and the line names the flag that now exists
    line = error_line(invoke("launch", plan, "--dry-run", "--data", data), 2)
    assert "--tokenizer" in line
    tok = _tokenizer(tmp_path / "tok")
    r = invoke("launch", plan, "--dry-run", "--data", data, "--tokenizer", tok, "--log-every", 3, "--fsdp-cpu-offload")
    assert r.exit_code == 0, r.output
    cmd = next(ln for ln in r.stdout.splitlines() if "seqpar.runtime.train" in ln).split()
    args = train_parser().parse_args(cmd[cmd.index("seqpar.runtime.train") + 1 :])  # the trainer understands them all
    assert (args.data_options.tokenizer, args.log_every, args.fsdp_cpu_offload) == (str(tok), 3, True)
    ddp = tmp_path / "ddp.json"
    make_plan(2).write(ddp)
    assert "applies to FSDP2 plans" in error_line(invoke("launch", ddp, "--dry-run", "--fsdp-cpu-offload"), 2)


# --------------------------------------------------------------------------------------------- installs without extras

HIDE = """
import json, re, sys, tomllib
from importlib import metadata
base = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
todo, dists = [re.match(r"[A-Za-z0-9_.-]+", r).group() for r in base], set()
while todo:
    d = norm(todo.pop())
    if d in dists:
        continue
    try:
        reqs = metadata.requires(d) or []
    except metadata.PackageNotFoundError:  # not installed here (a platform marker's, e.g. colorama on Windows)
        continue
    dists.add(d)
    for req in reqs:
        if "extra ==" not in req:
            todo.append(re.match(r"[A-Za-z0-9_.-]+", req).group())
owners = metadata.packages_distributions()
allowed = {m for m, ds in owners.items() if any(norm(x) in dists for x in ds)} | set(sys.stdlib_module_names) | {"seqpar"}
for m in owners:
    if m not in allowed or m in sys.argv[2].split(","):
        sys.modules[m] = None  # absent: import raises ModuleNotFoundError, importlib.util.find_spec returns None
from seqpar.cli import app
try:
    app(sys.argv[3:], prog_name="seqpar")
except SystemExit as e:
    code = e.code
imported = sorted({n.split(".")[0] for n, m in sys.modules.items() if m is not None} & set(owners) - allowed)
print("IMPORTED-UNDECLARED " + json.dumps(imported))
sys.exit(code)
"""


def declared_only(tmp_path: Path, *args, hide: str = "") -> subprocess.CompletedProcess:
    """Run `seqpar ARGS` where only the standard library and pyproject's base dependencies (and their own) exist."""
    cmd = [sys.executable, "-c", HIDE, str(ROOT / "pyproject.toml"), hide, *map(str, args)]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def undeclared(p: subprocess.CompletedProcess) -> list[str]:
    return json.loads(p.stdout.rsplit("IMPORTED-UNDECLARED ", 1)[1])


def test_dry_run_needs_only_the_declared_dependencies(tmp_path):
    """An advisor-only install (pip install -e .) runs advise and launch --dry-run; whatever they import is declared
    (numpy was used by the data check and not declared)."""
    p = declared_only(
        tmp_path, "advise", "-m", "tiny", "--cluster", "cpu:2", "-s", "1k", "--mode", "zigzag_ring_attn", "-o", "plan.json"
    )
    assert p.returncode == 0, p.stderr
    assert undeclared(p) == []
    p = declared_only(tmp_path, "launch", "plan.json", "--dry-run", "--steps", "2")
    assert p.returncode == 0, p.stderr
    assert "-m seqpar.runtime.train" in p.stdout and "--steps 2" in p.stdout
    assert undeclared(p) == [], "imported but not declared in pyproject.toml's dependencies"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args, hide, extra",
    [
        (["explain", "plan.json", "--plot", "m.png"], "matplotlib", "plot"),
        (["launch", "plan.json", "--force", "--steps", "1"], "", "runtime"),  # torch is not in the base install
    ],
    ids=["matplotlib", "torch"],
)
def test_missing_optional_dependency_is_one_line_naming_the_extra(tmp_path, args, hide, extra):
    make_plan(2, "zigzag_ring_attn", 2).write(tmp_path / "plan.json")
    p = declared_only(tmp_path, *args, hide=hide)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert re.fullmatch(rf"error: .* needs \w+, which is not installed: pip install .*\[{extra}\].*", lines[0]), lines[0]
    assert not (tmp_path / "m.png").exists() and not (tmp_path / "runs" / "plan" / "checkpoints").exists()


def test_runtime_api_without_torch_names_the_extra(tmp_path):
    code = "import sys; sys.modules['torch'] = None\nimport seqpar, seqpar.runtime\n"
    code += "for get in (lambda: seqpar.apply, lambda: seqpar.runtime.attention):\n"
    code += "    try: get()\n    except Exception as e: print(type(e).__name__, e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.count("MissingExtra") == 2 and out.count("[runtime]") == 2, out


def test_liger_plan_without_liger_kernel_names_the_extra(tmp_path):
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    plan = tmp_path / "liger.json"
    assert (
        invoke("advise", "-m", "tiny", "--gpu", "h100", "--gpus", "1", "-s", "1k", "--fused-ops", "liger", "-o", plan).exit_code
        == 0
    )
    line = error_line(invoke("launch", plan, "--force", "--output", tmp_path / "o"), 1)
    assert "fused_ops liger needs liger_kernel" in line and "[liger]" in line


def test_the_readme_installs_what_exists():
    """seqpar is not on PyPI: no `pip install seqpar`; every extra the README names is declared."""
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"pip install (seqpar|'seqpar\[)", text)
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set(re.findall(r"\| `(\w+)` \| [^|]+ \| [^|]* \|", text.split("## How seqpar decides")[0]))
    assert named and named <= declared, named - declared
    from seqpar.plan.extras import EXTRAS, install_line

    assert {extra for extra, _ in EXTRAS.values()} <= declared
    assert install_line("plot") == f"pip install -e '{ROOT}[plot]'"  # this checkout's own install command


def test_distribution_ships_a_py_typed_marker():
    import seqpar

    assert (Path(seqpar.__file__).parent / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["seqpar"]
    assert metadata.version("seqpar") == seqpar.__version__


# --------------------------------------------------------------------------------------------- multi-node, advise without -o


@pytest.mark.parametrize("sharding", ["fsdp", "zero3_offload"])
def test_two_nodes_need_a_rendezvous_endpoint_whatever_the_launcher(tmp_path, sharding):
    plan = tmp_path / "two_nodes.json"
    r = invoke("advise", "-s", "256k", "--gpu", "h100", "--gpus", 8, "--nodes", 2, "--sharding", sharding, "-o", plan)
    assert r.exit_code == 0, r.output
    line = error_line(invoke("launch", plan, "--dry-run"), 2)
    assert "a job on 2 nodes needs --rdzv-endpoint HOST:PORT" in line
    r = invoke("launch", plan, "--dry-run", "--node-rank", 1, "--rdzv-endpoint", "node0:29500")
    assert r.exit_code == 0, r.output
    assert "127.0.0.1" not in r.stdout
    if sharding == "zero3_offload":
        assert '"main_process_ip": "node0"' in r.stdout and '"machine_rank": 1' in r.stdout
    else:
        assert "--rdzv-endpoint node0:29500" in r.stdout


def test_advise_without_output_does_not_point_at_a_file_it_never_wrote(tmp_path):
    wide = {"COLUMNS": "400"}  # one table row per line
    for extra in ([], ["--verbose"]):
        r = runner.invoke(app, ["advise", "-s", "64k", "--gpu", "h100", "--gpus", "8", *extra], env=wide)
        assert r.exit_code == 0
        label, want = ("run ", "not written: add -o plan.json to write it, then seqpar launch plan.json")
        if not extra:
            label, want = ("Next ", "add -o plan.json to write the plan, then: seqpar launch plan.json")
        run = next(ln for ln in r.stdout.splitlines() if ln.startswith(label))
        assert run.split(None, 1)[1].strip() == want
    assert not (tmp_path / "plan.json").exists()
    out = tmp_path / "mine.json"
    r = runner.invoke(app, ["advise", "-s", "64k", "--gpu", "h100", "--gpus", "8", "-o", str(out)], env=wide)
    run = next(ln for ln in r.stdout.splitlines() if ln.startswith("Next "))
    assert run.split(None, 1)[1].strip() == f"seqpar launch {out}" and out.is_file()
