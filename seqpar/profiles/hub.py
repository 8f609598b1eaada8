"""Hugging Face Hub model ids: a repository's ``config.json`` (for the advisor) or its files (for ``seqpar launch``).

Torch-free: only ``huggingface_hub`` (the library transformers itself downloads with) is imported, and only when an id
is resolved. The cache comes first, then the Hub: a gated repository needs ``HF_TOKEN`` (or ``hf auth login``), which
huggingface_hub reads itself. With ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) only the cache is read, and a
miss is one line naming the fix. The environment is read on every call, not when huggingface_hub is first imported
(its ``constants`` freeze it then), so a test or a long-lived process sees what is set now.

Cache location, as huggingface_hub's ``constants.py`` derives it: ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``,
else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``. Its layout
(huggingface_hub's "Manage the cache" guide): ``models--ORG--NAME/refs/main`` holds the commit of ``main``, and
``models--ORG--NAME/snapshots/<commit>/config.json`` the file (a link into ``blobs/``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from seqpar.plan.errors import SeqparError

# owner/name[@revision]: the Hub's repo id rules (letters, digits, '-', '_', '.'; no '--' or '..'; at most 96 characters).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<rev>[\w./-]+))?$")
# Files a causal LM needs to train and tokenize (config, weights, tokenizer); not the original/*.pth copies some ship.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt"]
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubConfig:
    """A repository's config.json and where it was found."""

    repo_id: str
    revision: str | None
    path: Path  # the file in the cache
    data: dict
    where: str  # "Hub cache" | "Hub"

    @property
    def source(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        commit = self.path.parent.name  # snapshots/<commit>/config.json
        return f"{self.repo_id}{rev} config.json ({self.where}, commit {commit[:12]})"


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo_id, revision) when ``text`` is written like a Hub model id ``owner/name[@revision]``, else None."""
    m = _HUB_ID.match(text.strip())
    if not m or "--" in m.group("repo") or ".." in m.group("repo") or m.group("repo").endswith((".", "-")):
        return None
    return m.group("repo"), m.group("rev")


def offline() -> bool:
    """HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE) as huggingface_hub reads them, read now."""
    return any((os.environ.get(k) or "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cache_dir() -> Path:
    """The Hub cache folder the environment names now (see the module docstring for the order)."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return Path(os.path.expandvars(os.environ[key])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _offline_fix(repo_id: str) -> str:
    return (
        f"run `hf download {repo_id} config.json` where the Hub is reachable (same HF_HOME), or unset HF_HUB_OFFLINE, "
        f"or pass a local folder or a profile name (seqpar profiles list)"
    )


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def unreachable(timeout: float = 1.5) -> str | None:
    """Why the Hub cannot be reached from here (no DNS answer, no route, refused, timed out), else None. Asked once,
    in at most ``timeout`` seconds, before a download: huggingface_hub retries a failed connection five times over
    about 20 s, printing each retry. Behind a proxy (HTTPS_PROXY and friends) the answer is left to the download."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlsplit(_endpoint())
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror:
        return f"{host} has no address here (no network, or no DNS)"
    except TimeoutError:
        return f"{host}:{port} did not answer within {timeout:g} s (no network, or a firewall)"
    except OSError as e:
        return f"{host}:{port} refused the connection ({e.strerror or e})"
    return None


def _no_network(repo_id: str, what: str, why: str) -> SeqparError:
    return SeqparError(
        f"model {repo_id!r}: the Hugging Face cache ({cache_dir()}) lacks {what}, and the Hub cannot be reached ({why}); "
        f"run `hf download {repo_id}` where the Hub is reachable (same HF_HOME), or pass a local folder or a profile "
        "name (seqpar profiles list)"
    )


def _hub_error(e: Exception, repo_id: str, what: str) -> SeqparError:
    """One line for each way the Hub can refuse, naming the fix."""
    from huggingface_hub import errors

    kind = type(e).__name__
    if isinstance(e, errors.GatedRepoError):
        return SeqparError(
            f"model {repo_id!r} is gated: accept its license on https://huggingface.co/{repo_id} and set HF_TOKEN "
            f"(or run `hf auth login`), then retry"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return SeqparError(
            f"model {repo_id!r} is not on the Hugging Face Hub (or is private: set HF_TOKEN); check the id, or pass a "
            f"local folder or a profile name (seqpar profiles list)"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return SeqparError(f"model {repo_id!r} has no such revision; check the text after '@' (a branch, tag or commit)")
    if isinstance(e, errors.EntryNotFoundError):
        return SeqparError(
            f"model {repo_id!r}: the Hub repository holds no {what}, so it is not a transformers model; check the id"
        )
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return SeqparError(
            f"model {repo_id!r}: {what} is not in the Hugging Face cache ({cache_dir()}) and the Hub cannot be reached; {_offline_fix(repo_id)}"
        )
    return SeqparError(
        f"model {repo_id!r}: reading {what} from the Hub failed ({kind}: {str(e).splitlines()[0][:200]}); retry, or {_offline_fix(repo_id)}"
    )


def fetch_config(repo_id: str, revision: str | None = None) -> HubConfig:
    """``config.json`` of a Hub model: from the cache if there, else downloaded (unless offline). SeqparError otherwise."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cache = cache_dir()
    cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
    if isinstance(cached, str):
        path, where = Path(cached), "Hub cache"
    elif offline():
        raise SeqparError(
            f"model {repo_id!r}: config.json is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; "
            f"{_offline_fix(repo_id)}"
        )
    else:
        why = unreachable()
        if why is not None:
            raise _no_network(repo_id, "config.json", why)
        try:
            path, where = Path(hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache)), "Hub"
        except Exception as e:  # huggingface_hub's errors, and whatever the HTTP stack raises underneath
            raise _hub_error(e, repo_id, "config.json") from None
    from seqpar.plan.files import read_json_object

    data = read_json_object(
        path, "model config", "config", missing_fix=_offline_fix(repo_id), invalid_fix=f"delete {path} and retry"
    )
    return HubConfig(repo_id, revision, path, data, where)


def snapshot(model: str, *, weights: bool = True) -> Path:
    """A local folder holding the model for ``seqpar launch --model-path``: ``model`` itself when it is a folder, else the
    Hub id's snapshot in the cache, its config, weights and tokenizer downloaded when missing (unless offline).
    ``weights=False`` (a dry run): only config.json is fetched; the weights come with the real launch."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    parsed = parse_hub_id(model)
    if parsed is None:
        raise SeqparError(
            f"--model-path {model!r} is neither a folder nor a Hugging Face model id (owner/name); pass a local model "
            f"folder or an id like Qwen/Qwen2.5-7B-Instruct"
        )
    repo_id, revision = parsed
    if not weights:
        return fetch_config(repo_id, revision).path.parent
    from huggingface_hub import snapshot_download

    cache = cache_dir()
    try:
        folder = Path(
            snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=MODEL_FILES, local_files_only=True)
        )
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            return folder
    except Exception:  # not (wholly) cached: download below
        pass
    if offline():
        raise SeqparError(
            f"--model-path {model!r}: the model's weights are not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
            f"set; run `hf download {repo_id}` where the Hub is reachable (same HF_HOME), or pass a local folder"
        )
    why = unreachable()
    if why is not None:
        raise _no_network(repo_id, "the model's weights", why)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=MODEL_FILES))
    except Exception as e:
        raise _hub_error(e, repo_id, "model files (config.json, *.safetensors)") from None
    if not any(folder.glob("*.safetensors")):
        raise SeqparError(
            f"--model-path {model!r}: the repository has no .safetensors weights (seqpar loads only those); convert it "
            f"with transformers' save_pretrained and pass the folder"
        )
    return folder


__all__ = ["HubConfig", "MODEL_FILES", "cache_dir", "fetch_config", "offline", "parse_hub_id", "snapshot", "unreachable"]
