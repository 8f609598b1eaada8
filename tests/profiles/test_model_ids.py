"""Any Hub model id or local folder as `--model`: config.json from a Hub cache on disk (HF_HUB_OFFLINE=1, no network),
the spec derived from its fields and compared with transformers' own config classes (the reference), the shapes the
cost model cannot describe refused with the field named, and `seqpar launch --model-path ORG/NAME` from the cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from hub_cache import add_folder, add_repo, use_cache
from typer.testing import CliRunner

from seqpar.cli import app
from seqpar.plan.errors import SeqparError
from seqpar.profiles import find_profile, get_model, hub_id

transformers = pytest.importorskip("transformers")

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def _cached_config(tmp_path, monkeypatch, repo_id, cls_name, **kw):
    """Save transformers' config class ``cls_name`` and put it into a fresh Hub cache as ``repo_id``."""
    cfg = getattr(transformers, cls_name)(**kw)
    folder = tmp_path / "saved"
    cfg.save_pretrained(folder)
    cache = use_cache(monkeypatch, tmp_path / "hf")
    add_folder(cache, repo_id, folder)
    return cfg, cache


def _reference(cfg) -> tuple:
    """The shape as transformers reads the config (and seqpar.runtime.hf.apply's window rule, on the config object)."""
    from seqpar.runtime.hf.apply import _active_sliding_window

    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    return (
        cfg.model_type,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.tie_word_embeddings,
        theta,
        cfg.max_position_embeddings,
        _active_sliding_window(cfg),
    )


def _shape(m) -> tuple:
    return (
        m.architecture,
        m.num_layers,
        m.hidden_size,
        m.num_attention_heads,
        m.num_key_value_heads,
        m.head_dim,
        m.intermediate_size,
        m.vocab_size,
        m.tie_word_embeddings,
        m.rope_theta,
        m.max_position_embeddings,
        m.sliding_window,
    )


@pytest.mark.parametrize(
    "cls_name,kw",
    [
        ("LlamaConfig", dict(vocab_size=500, rope_theta=5e5, max_position_embeddings=8192)),
        ("MistralConfig", dict(vocab_size=320)),  # the class default window: 4096
        ("MistralConfig", dict(vocab_size=320, sliding_window=None)),  # Mistral-7B-v0.2+: full attention
        ("Qwen2Config", dict(vocab_size=300, tie_word_embeddings=True)),
        ("Qwen2Config", dict(vocab_size=300, use_sliding_window=True, sliding_window=1024, max_window_layers=1)),
        ("Qwen3Config", dict(vocab_size=300, head_dim=32)),
    ],
)
def test_hub_id_from_the_cache_matches_transformers(tmp_path, monkeypatch, cls_name, kw):
    cfg, cache = _cached_config(tmp_path, monkeypatch, "acme/small-lm", cls_name, **SMALL, **kw)
    import huggingface_hub

    assert [r.repo_id for r in huggingface_hub.scan_cache_dir(cache).repos] == ["acme/small-lm"]  # the library's layout
    m = get_model("acme/small-lm")
    assert _shape(m) == _reference(cfg)
    assert m.name == "acme/small-lm" and m.source.startswith("acme/small-lm config.json (Hub cache, commit ")
    assert hub_id(m) == "acme/small-lm" and find_profile("acme/small-lm") == m


def test_revision_and_profile_ids_resolve_offline(tmp_path, monkeypatch):
    cache = use_cache(monkeypatch, tmp_path / "hf")
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    base |= {"intermediate_size": 128, "vocab_size": 100}
    add_repo(cache, "acme/lm", {"config.json": json.dumps(base).encode()})
    add_repo(cache, "acme/lm", {"config.json": json.dumps(base | {"num_hidden_layers": 6}).encode()}, ref="v2")
    assert get_model("acme/lm").num_layers == 2 and get_model("acme/lm@v2").num_layers == 6
    # a profiled id is that config.json's figures: nothing to download, nothing in the cache needed
    assert get_model("meta-llama/Llama-2-7b-hf") == get_model("llama-2-7b") and hub_id(get_model("llama-2-7b")) == (
        "meta-llama/Llama-2-7b-hf"
    )
    assert hub_id(get_model("tiny")) is None


def test_offline_miss_names_the_fix(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "hf")
    with pytest.raises(
        SeqparError,
        match=r"'Qwen/Qwen2.5-7B-Instruct': config.json is not in the Hugging Face cache .*"
        r"HF_HUB_OFFLINE is set; run `hf download Qwen/Qwen2.5-7B-Instruct config.json`",
    ):
        get_model("Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(SeqparError, match=r"unknown model 'qwen3-7b'; did you mean qwen3-8b"):  # not an id: a profile typo
        get_model("qwen3-7b")


@pytest.mark.parametrize(
    "cls_name,kw,match",
    [
        ("MixtralConfig", dict(vocab_size=100), r"num_local_experts=8: a mixture of experts"),
        ("Qwen3MoeConfig", dict(vocab_size=100), r"num_(local_)?experts=128: a mixture of experts"),
        ("JambaConfig", dict(vocab_size=100, num_experts=1), r"(attn_layer_\w+|mamba_\w+) is set: a hybrid"),
        ("LlavaConfig", dict(), r"vision_config is set: a multimodal model"),
        ("GemmaConfig", dict(vocab_size=100), r"model_type 'gemma'; seqpar's cost model and runtime describe llama, mistral"),
    ],
)
def test_shapes_the_cost_model_cannot_describe_are_refused(tmp_path, monkeypatch, cls_name, kw, match):
    _cached_config(tmp_path, monkeypatch, "acme/other", cls_name, **kw)
    with pytest.raises(SeqparError, match=match):
        get_model("acme/other")


def test_hybrid_layer_types_are_refused(tmp_path, monkeypatch):
    cache = use_cache(monkeypatch, tmp_path / "hf")
    cfg = {"model_type": "qwen3", **{k: v for k, v in SMALL.items()}, "vocab_size": 10}
    cfg["num_hidden_layers"] = 2
    cfg["layer_types"] = ["linear_attention", "full_attention"]
    add_repo(cache, "acme/hybrid", {"config.json": json.dumps(cfg).encode()})
    with pytest.raises(SeqparError, match=r"layer_types holds linear_attention: a hybrid"):
        get_model("acme/hybrid")


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def test_cli_takes_a_hub_id(tmp_path, monkeypatch, runner):
    cfg, _ = _cached_config(tmp_path, monkeypatch, "acme/small-lm", "Qwen2Config", **SMALL, vocab_size=256)
    r = runner.invoke(app, ["advise", "--model", "acme/small-lm", "--cluster", "cpu:2", "--seq-len", "256", "--json"])
    assert r.exit_code == 0, r.output
    model = json.loads(r.stdout)["workload"]["model"]
    assert (model["name"], model["num_layers"], model["attention_bias"]) == ("acme/small-lm", 2, True)
    show = runner.invoke(app, ["profiles", "show", "acme/small-lm", "--json"])
    assert show.exit_code == 0 and json.loads(show.stdout)["vocab_size"] == 256
    check = runner.invoke(app, ["check", "--model", "acme/small-lm", "--cluster", "cpu:2", "--seq-len", "256", "--json"])
    assert check.exit_code == 0 and json.loads(check.stdout)["fits"]
    miss = runner.invoke(app, ["advise", "--model", "acme/missing", "--cluster", "cpu:2", "--seq-len", "256"])
    assert miss.exit_code == 2 and miss.stderr.count("\n") == 2 and "HF_HUB_OFFLINE is set" in miss.stderr


def test_sliding_window_shorter_than_the_sequence_is_refused(tmp_path, monkeypatch, runner):
    _cached_config(tmp_path, monkeypatch, "acme/windowed", "MistralConfig", **SMALL, vocab_size=256, sliding_window=512)
    ok = runner.invoke(app, ["advise", "--model", "acme/windowed", "--cluster", "cpu:2", "--seq-len", "512", "--json"])
    assert ok.exit_code == 0, ok.output
    r = runner.invoke(app, ["advise", "--model", "acme/windowed", "--cluster", "cpu:2", "--seq-len", "1024"])
    assert r.exit_code == 2, r.output
    assert "sliding window of 512 tokens" in r.stderr and "set sliding_window to null" in r.stderr


def test_hub_ids_import_no_torch(tmp_path):
    cfg = {"model_type": "llama", **SMALL, "vocab_size": 10}
    add_repo(tmp_path / "hub", "acme/lm", {"config.json": json.dumps(cfg).encode()})
    code = "import sys; from seqpar.profiles import get_model; get_model('acme/lm'); assert 'torch' not in sys.modules"
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_launch_model_path_hub_id(tmp_path, monkeypatch, runner):
    import torch

    cfg = transformers.LlamaConfig(**SMALL, vocab_size=256)
    saved = tmp_path / "saved"
    torch.manual_seed(123)  # not the plan's seed: random weights would differ from these
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(saved)
    cache = use_cache(monkeypatch, tmp_path / "hf")
    snap = add_folder(cache, "acme/tiny-llama", saved)
    plan = tmp_path / "plan.json"
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["advise", "--model", "acme/tiny-llama", "--cluster", "cpu:1", "--seq-len", "64", "-o", str(plan)])
    assert r.exit_code == 0, r.output
    dry = runner.invoke(app, ["launch", str(plan), "--model-path", "acme/tiny-llama", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"--model-path {snap}" in dry.stdout
    missing = runner.invoke(app, ["launch", str(plan), "--model-path", "acme/not-cached", "--dry-run"])
    assert missing.exit_code == 2 and "HF_HUB_OFFLINE is set" in missing.stderr
    losses = []
    for i, model_path in enumerate(["acme/tiny-llama", str(saved)]):  # the id and the folder it was made from
        out = tmp_path / f"run{i}"
        args = ["launch", str(plan), "--model-path", model_path, "--steps", "1", "--output", str(out), "--force"]
        res = runner.invoke(app, [*args, "--no-final-checkpoint"])
        assert res.exit_code == 0, res.output
        assert json.loads((out / "run_report.json").read_text())["steps"] == 1
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert losses[0] == losses[1]


@pytest.mark.parametrize(
    "endpoint, why",
    [
        ("http://127.0.0.1:9", r"127\.0\.0\.1:9 refused the connection"),  # the discard port: nothing listens
        ("https://seqpar-test.invalid", r"seqpar-test\.invalid has no address here"),  # .invalid never resolves (RFC 2606)
    ],
)
def test_an_unreachable_hub_is_one_line_at_once_naming_the_cause(tmp_path, monkeypatch, runner, endpoint, why):
    import time

    use_cache(monkeypatch, tmp_path / "hf", offline=False)
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    plan = tmp_path / "plan.json"
    assert runner.invoke(app, ["advise", "-m", "tiny", "--cluster", "cpu:1", "-s", "64", "-o", str(plan)]).exit_code == 0
    launch = ["launch", str(plan), "--model-path", "someorg/somemodel", "--output", str(tmp_path / "o")]
    for args in (["advise", "-s", "1k", "-m", "someorg/somemodel"], launch):
        start = time.monotonic()
        r = runner.invoke(app, args)
        took = time.monotonic() - start
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
        assert r.exit_code == 2 and len(lines) == 1, r.output
        assert took < 2.0, f"{took:.1f} s"  # no retry storm
        assert re.search(f"cannot be reached \\({why}", lines[0]), lines[0]
        assert "run `hf download someorg/somemodel`" in lines[0] and "Retry" not in r.stderr
