"""The golden corpus' harness: run one request of ``requests.json`` through the CLI in-process and reduce what it did to a
JSON-able record (exit code, stdout, the files it wrote), with only what legitimately varies normalised away.

Shared by ``make.py`` (writes ``expected/``) and ``tests/test_golden.py`` (compares). Torch-free: it imports only typer's
CliRunner, PyYAML and, through ``cli_app()``, the CLI module.

A request is ``{"name": ..., "argv": [...], "setup": [[...], ...], "files": {NAME: TEXT}}`` (``setup`` and ``files``
optional): every argv is what follows ``seqpar`` on a command line. ``{tmp}`` in an argument is the request's own fresh
temporary folder (also the working directory while it runs): ``files`` are written there first (e.g. a broken plan), then
the setup commands run, then the main command. ``{golden}`` is this folder (the data files shipped with the corpus). The
record keeps the setup commands' exit codes, the main command's exit code and stdout (parsed as JSON when it is JSON,
else its lines), and every file the main command wrote or changed in ``{tmp}`` (``.json`` and ``.yaml``/``.yml``
parsed, YAML's comment lines kept beside, else lines). Stderr (notes for people) is not recorded.

Normalised (see ``normalise``): ``created_at`` values, the temporary folder's path, this folder's path, the interpreter's
path and seqpar's version after "seqpar ". Pinned rather than normalised: the environment variables listed in ``ENV``
(terminal width, colours, no coefficients override, Hub offline) and ``os.cpu_count()`` (``CPU_COUNT``: CPU plans record
``OMP_NUM_THREADS`` = cores / ranks in ``launch.env``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml
from typer.testing import CliRunner

GOLDEN_DIR = Path(__file__).resolve().parent
REQUESTS_PATH = GOLDEN_DIR / "requests.json"
EXPECTED_DIR = GOLDEN_DIR / "expected"

CPU_COUNT = 16  # os.cpu_count() while a request runs
ENV = {  # while a request runs (None: unset)
    "COLUMNS": "120",
    "LINES": "50",
    "NO_COLOR": "1",
    "TERM": "dumb",
    "FORCE_COLOR": None,
    "TTY_COMPATIBLE": None,
    "TTY_INTERACTIVE": None,
    "JUPYTER_COLUMNS": None,
    "JUPYTER_LINES": None,
    "SEQPAR_COEFFICIENTS": None,
    "SEQPAR_DEBUG": None,
    "HF_HUB_OFFLINE": "1",
}


def cli_app():
    """The typer app under test: the one line to change if the CLI module moves."""
    from seqpar.cli import app

    return app


def seqpar_version() -> str:
    import seqpar

    return seqpar.__version__


def load_requests() -> list[dict]:
    reqs = json.loads(REQUESTS_PATH.read_text())
    names = [r["name"] for r in reqs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate request names in {REQUESTS_PATH}: {dupes}")
    return reqs


def expected_path(name: str) -> Path:
    return EXPECTED_DIR / f"{name}.json"


def load_expected(name: str) -> dict:
    return json.loads(expected_path(name).read_text())


def dumps(record: dict) -> str:
    return json.dumps(record, indent=1, sort_keys=False, ensure_ascii=False) + "\n"


# --------------------------------------------------------------------------------------------- running


@contextmanager
def _pinned(cwd: Path):
    old_cwd, old_count = os.getcwd(), os.cpu_count
    os.chdir(cwd)
    os.cpu_count = lambda: CPU_COUNT
    try:
        yield
    finally:
        os.cpu_count = old_count
        os.chdir(old_cwd)


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2 mixes stderr into stdout unless told
    except TypeError:
        return CliRunner()  # click >= 8.2: stdout and stderr are separate


def _invoke(runner: CliRunner, argv: list[str]):
    r = runner.invoke(cli_app(), argv, env=ENV, catch_exceptions=True)
    exc = r.exception if r.exception is not None and not isinstance(r.exception, SystemExit) else None
    return r.exit_code, r.stdout, exc


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _parse_file(rel: str, data: bytes):
    text = data.decode("utf-8", errors="replace")
    suffix = Path(rel).suffix.lower()
    try:
        if suffix == ".json":
            return {"kind": "json", "content": json.loads(text)}
        if suffix in (".yaml", ".yml"):  # the comments too (a header naming the plan), which parsing drops
            comments = [line for line in text.splitlines() if line.lstrip().startswith("#")]
            return {"kind": "yaml", "content": yaml.safe_load(text), "comments": comments}
    except (ValueError, yaml.YAMLError):
        pass
    return {"kind": "text", "content": text.splitlines()}


def _parse_stdout(text: str):
    try:
        return "json", json.loads(text)
    except ValueError:
        return "text", text.splitlines()


def run_request(req: dict) -> dict:
    """Run ``req`` (setup first) in a fresh temporary folder; the normalised record of what the main command did."""
    tmp = Path(tempfile.mkdtemp(prefix="seqpar-golden-"))
    try:
        paths = {"{tmp}": str(tmp), "{golden}": str(GOLDEN_DIR)}

        def expand(argv: list[str]) -> list[str]:
            out = []
            for a in argv:
                for k, v in paths.items():
                    a = a.replace(k, v)
                out.append(a)
            return out

        runner = _runner()
        record: dict = {"argv": req["argv"]}
        for rel, text in req.get("files", {}).items():
            (tmp / rel).write_text(text)
        with _pinned(tmp):
            if req.get("setup"):
                codes = []
                for argv in req["setup"]:
                    code, _, exc = _invoke(runner, expand(argv))
                    codes.append(code if exc is None else f"{code} {type(exc).__name__}: {exc}")
                record["setup_exit_codes"] = codes
            before = _snapshot(tmp)
            code, out, exc = _invoke(runner, expand(req["argv"]))
            after = _snapshot(tmp)
        record["exit_code"] = code
        if exc is not None:
            record["exception"] = f"{type(exc).__name__}: {exc}"
        record["stdout_kind"], record["stdout"] = _parse_stdout(out)
        record["files"] = {rel: _parse_file(rel, data) for rel, data in after.items() if before.get(rel) != data}
        record = normalise(record, tmp)
        return json.loads(json.dumps(record))  # what expected/*.json holds: lists, str keys, JSON floats
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------- normalising


def _replacements(tmp: Path) -> list[tuple[str, str]]:
    subs = {
        str(tmp): "{tmp}",
        os.path.realpath(tmp): "{tmp}",
        str(GOLDEN_DIR): "{golden}",
        os.path.realpath(GOLDEN_DIR): "{golden}",
    }
    subs[sys.executable] = "{python}"
    subs[f"seqpar {seqpar_version()}"] = "seqpar {version}"
    return sorted(subs.items(), key=lambda kv: -len(kv[0]))  # longest first: a temp path before any prefix of it


def normalise(obj, tmp: Path):
    """``obj`` with ``created_at`` values and the paths and version of this run replaced by placeholders."""
    subs = _replacements(tmp)

    def walk(x, key=None):
        if isinstance(x, dict):
            return {
                walk(k): ("{created_at}" if k == "created_at" and isinstance(v, str) and v else walk(v, k)) for k, v in x.items()
            }
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, str):
            for old, new in subs:
                x = x.replace(old, new)
            return x
        return x

    return walk(obj)


# --------------------------------------------------------------------------------------------- comparing


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def differences(expected, actual, path: str = "", limit: int = 8) -> list[str]:
    """The first ``limit`` places where ``actual`` differs from ``expected`` (JSON paths), each with both values, short.
    Numbers compare by type and value (1 is not 1.0)."""
    out: list[str] = []

    def short(v) -> str:
        s = json.dumps(v, ensure_ascii=False)
        return s if len(s) <= 160 else s[:157] + "..."

    def walk(e, a, p):
        if len(out) >= limit:
            return
        if isinstance(e, dict) and isinstance(a, dict):
            for k in e:
                if k not in a:
                    out.append(f"{p}/{k}: missing (expected {short(e[k])})")
                else:
                    walk(e[k], a[k], f"{p}/{k}")
                if len(out) >= limit:
                    return
            for k in a:
                if k not in e and len(out) < limit:
                    out.append(f"{p}/{k}: unexpected {short(a[k])}")
        elif isinstance(e, list) and isinstance(a, list):
            for i, (x, y) in enumerate(zip(e, a)):
                walk(x, y, f"{p}[{i}]")
                if len(out) >= limit:
                    return
            if len(e) != len(a):
                out.append(f"{p}: {len(a)} items, expected {len(e)}")
        elif not _same(e, a):
            out.append(f"{p or '/'}: got {short(a)}, expected {short(e)}")

    walk(expected, actual, path)
    return out
