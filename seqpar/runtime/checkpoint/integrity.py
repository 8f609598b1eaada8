"""A checkpoint's integrity: every file a resume reads back is listed in trainer_state.json with its size and SHA-256,
and trainer_state.json carries an HMAC-SHA256 of all of it under a key that lives outside the run folder.

Why a key: a digest anyone can recompute proves only that nothing was torn; whoever edits a file can write the new
digest too. The MAC proves that a checkpoint was written by a seqpar run holding this user's key, so a run folder
handed over by someone else, or edited since, is told apart from one's own. The content digests then carry that proof
to every file: one byte changed at the same size changes its SHA-256, and each file is checked before it is read.

The key: 32 random bytes (hex) in ``$SEQPAR_RUN_KEY_FILE``, else ``$XDG_CONFIG_HOME/seqpar/run-key``, else
``~/.config/seqpar/run-key``; made on first use, mode 0600 in a 0700 folder. Every rank of a job reads the same file:
a job over several nodes needs the same key on each node (a shared home, or the file copied).

A folder signed with another key (another user's or machine's run, or changed since) or written before the key
resumes only with ``--accept-foreign-run``, and then its files are still held to the sizes and digests it lists, and
read only as safetensors and JSON (seqpar.runtime.checkpoint.deepspeed's format for DeepSpeed's states), never
unpickled. Torch-free: the launcher checks a checkpoint before any process starts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from seqpar.plan.errors import SeqparError
from seqpar.plan.safe import open_nofollow, printable

KEY_ENV = "SEQPAR_RUN_KEY_FILE"
FOREIGN_FLAG = "--accept-foreign-run"
STATE = "trainer_state.json"  # the manifest: signed, so not listed in itself
_KEY_BYTES = 32
_KEYS: dict[str, bytes] = {}  # per key path: read once per process
# What a checkpoint folder may hold: the shards, DeepSpeed's states, the RNG states and the export (a LoRA run's adapter
# in peft's layout: adapter_config.json, adapter_model.safetensors, its README.md and the tokenizer); every other name is
# not one seqpar writes (a planted .metadata pickle, a .pth, a script) and is refused before anything is read.
_NAMES = re.compile(
    r"state/shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors"
    r"|deepspeed/state/[A-Za-z0-9_]{1,200}\.pt"
    r"|rng-\d{1,7}\.json"
    r"|model/[A-Za-z0-9_.-]{1,200}"
    r"|adapter/[A-Za-z0-9_.-]{1,200}"
)


# --------------------------------------------------------------------------------------------- the key


def key_path() -> Path:
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "seqpar" / "run-key"


def key() -> bytes:
    """This user's key, made on first use (every rank of a machine may race to make it: the first link wins)."""
    path = key_path()
    if str(path) in _KEYS:
        return _KEYS[str(path)]
    shown = printable(str(path))
    try:
        if not path.exists() and not path.is_symlink():
            _make_key(path)
        fd = open_nofollow(path, os.O_RDONLY, what="the run key")
        with os.fdopen(fd, "rb") as f:
            mode, text = os.fstat(f.fileno()).st_mode, f.read(4 * _KEY_BYTES).decode("ascii", "replace").strip()
    except OSError as e:
        raise SeqparError(
            f"the run key {shown!r} cannot be made or read ({e.strerror}); set {KEY_ENV} to a file of yours on a "
            "writable disk (the same file on every node of a job)"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SeqparError(
            f"the run key {shown!r} may be read or written by other users (mode {stat.S_IMODE(mode):04o}), so anyone could "
            f"sign a run folder as you; chmod 600 {shown!r}"
        )
    if not re.fullmatch(f"[0-9a-f]{{{2 * _KEY_BYTES}}}", text):
        raise SeqparError(
            f"the run key {shown!r} does not hold {2 * _KEY_BYTES} hex digits; restore it from another node of the job, or "
            f"remove it (a new one is made, and the checkpoints it signed then resume only with {FOREIGN_FLAG})"
        )
    _KEYS[str(path)] = bytes.fromhex(text)
    return _KEYS[str(path)]


def _make_key(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(_KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never replaces a key another process made first
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------- signing


def _body(state: dict) -> bytes:
    return json.dumps({k: v for k, v in state.items() if k != "mac"}, sort_keys=True, separators=(",", ":")).encode()


def sign(state: dict) -> str:
    """The MAC of ``state`` (every field but ``mac``) under this user's key, hex."""
    return hmac.new(key(), _body(state), hashlib.sha256).hexdigest()


def signed_here(state: dict) -> bool:
    mac = state.get("mac")
    return isinstance(mac, str) and hmac.compare_digest(mac, sign(state))


def foreign_line(name: str, state: dict) -> str:
    """Why a checkpoint that is not signed with this user's key is refused, and the flag that accepts it."""
    shown = printable(str(key_path()))
    if "mac" not in state:
        why = "is not signed (a seqpar from before checkpoints were signed wrote it, or its signature was removed)"
    else:
        why = (
            f"is signed with another key than yours ({shown!r}): another user or machine wrote it, or it was changed "
            "since (a job over several nodes needs the same key file on every node: copy it there)"
        )
    return (
        f"checkpoint {name!r} {why}; if you trust where this folder came from, resume with {FOREIGN_FLAG} (its files are "
        "still checked against their digests, and read as safetensors and JSON only), or start a new --output"
    )


# --------------------------------------------------------------------------------------------- the files


def digest(path: Path) -> dict:
    """{"bytes", "sha256"} of the regular file ``path`` (never through a link)."""
    fd = open_nofollow(path, os.O_RDONLY, what="checkpoint file")
    with os.fdopen(fd, "rb") as f:
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def listing(folder: Path) -> list[str]:
    """Every file under ``folder`` but trainer_state.json, relative, sorted (links are refused before: not followed)."""
    out = []
    for here, _, files in os.walk(folder, followlinks=False):
        out += [Path(here, f).relative_to(folder).as_posix() for f in files]
    return sorted(r for r in out if r != STATE)


def digests(folder: Path, names: list[str], threads: int | None = None) -> dict[str, dict]:
    """``digest`` of each name, hashed on threads (SHA-256 releases the GIL: the disk sets the pace)."""
    if not names:
        return {}
    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1, len(names))) as pool:
        return dict(zip(names, pool.map(lambda r: digest(folder / r), names)))


def check_names(name: str, folder: Path, files: dict, fix: str) -> None:
    """The files listed are the files there, each one of the names seqpar writes, none outside the folder."""
    for rel in files:
        p = PurePosixPath(rel)
        if p.is_absolute() or ".." in p.parts or str(p) != rel or not _NAMES.fullmatch(rel):
            raise SeqparError(
                f"checkpoint {name!r} lists {printable(rel, 120)!r}, not a file seqpar writes in a checkpoint; {fix}"
            )
    have = listing(folder)
    extra = [r for r in have if r not in files]
    if extra:
        raise SeqparError(
            f"checkpoint {name!r} holds {printable(extra[0], 120)!r}, which its trainer_state.json does not list (not "
            f"written with it); remove it, {fix}"
        )


def check_sizes(name: str, folder: Path, files: dict, fix: str) -> None:
    for rel, entry in files.items():
        size = entry["bytes"] if isinstance(entry, dict) else entry  # format 2 listed sizes only
        p = folder / rel
        have = p.lstat().st_size if p.is_file() and not p.is_symlink() else None
        if have != size:
            what = "is missing" if have is None else f"has {have} bytes, not the {size} written"
            raise SeqparError(f"checkpoint {name!r} is incomplete: {printable(rel, 120)} {what}; {fix}")


def content_problem(name: str, folder: Path, files: dict, names: list[str], fix: str) -> str | None:
    """The first of ``names`` whose bytes are not the ones listed (one line), else None."""
    got = digests(folder, names)
    for rel in names:
        if got[rel] != files[rel]:
            return (
                f"checkpoint {name!r}: {printable(rel, 120)} was changed after it was written (its SHA-256 differs from "
                f"the one trainer_state.json lists); {fix}"
            )
    return None


__all__ = [
    "FOREIGN_FLAG",
    "KEY_ENV",
    "STATE",
    "check_names",
    "check_sizes",
    "content_problem",
    "digest",
    "digests",
    "foreign_line",
    "key",
    "key_path",
    "listing",
    "sign",
    "signed_here",
]
