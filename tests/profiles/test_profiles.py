"""Profiles: every entry validates and names its source; aliases; unknown names suggest the closest; local config.json files
(written by transformers' own config classes, the reference) read as plain JSON; parameter counts match the published ones."""

from __future__ import annotations

import json

import pytest

from seqpar.advisor.cluster import cluster_from_flags, cpu_cluster, default_cluster, parse_cluster
from seqpar.plan.errors import SeqparError
from seqpar.profiles import find_profile, get_gpu, get_link, get_model, list_gpus, list_links, list_models, match_nvml_name

PROFILED_GPUS = {
    "a100-40g-sxm",
    "a100-80g-sxm",
    "a100-80g-pcie",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "l40s",
    "l4",
    "a10g",
    "rtx-4090",
    "cpu",
}
PROFILED_LINKS = {"nvlink3", "nvlink4", "pcie4", "pcie5", "ib_hdr", "ib_ndr"}

# Published parameter counts (model cards / the Hub's safetensors metadata), billions.
PUBLISHED_PARAMS_B = {
    "llama-2-7b": 6.74,
    "llama-2-13b": 13.02,
    "llama-2-70b": 68.98,
    "llama-3-8b": 8.03,
    "llama-3-70b": 70.55,
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.55,
    "llama-3.3-70b": 70.55,
    "llama-3.1-405b": 405.85,
    "llama-3.2-1b": 1.24,
    "llama-3.2-3b": 3.21,
    "mistral-7b": 7.24,
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.77,
    "qwen2.5-72b": 72.71,
    "qwen3-8b": 8.19,
    "danube2-1.8b": 1.83,
}


def test_every_profile_validates_and_has_a_source():
    assert {g.name for g in list_gpus()} == PROFILED_GPUS
    assert PROFILED_LINKS <= {link.kind for link in list_links()}
    assert {m.name for m in list_models()} == set(PUBLISHED_PARAMS_B) | {"tiny"}
    for spec in list_gpus() + list_links() + list_models():
        assert spec.source, spec


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_model_parameter_counts_match_published(name):
    assert get_model(name).num_params / 1e9 == pytest.approx(PUBLISHED_PARAMS_B[name], rel=0.01)


def test_tiny():
    t = get_model("tiny")
    shape = (
        t.num_layers,
        t.hidden_size,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.head_dim,
        t.intermediate_size,
        t.vocab_size,
        t.architecture,
    )
    assert shape == (2, 64, 4, 2, 16, 128, 256, "llama")


@pytest.mark.parametrize(
    "alias,name",
    [
        ("a100", "a100-80g-sxm"),
        ("A100", "a100-80g-sxm"),
        ("h100", "h100-sxm"),
        ("h200", "h200"),
        ("4090", "rtx-4090"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("a100_40g", "a100-40g-sxm"),
    ],
)
def test_gpu_aliases(alias, name):
    assert get_gpu(alias).name == name


def test_nvml_memory_figures():
    assert get_gpu("h200").memory_gib * 1024 == 143771  # MiB, as NVML reports it on the project's H200
    assert match_nvml_name("NVIDIA A100-SXM4-40GB").name == "a100-40g-sxm" and match_nvml_name("NVIDIA B200") is None
    assert get_gpu("h100-sxm").bf16_tflops == 989 and get_gpu("a100").hbm_bandwidth_gb_s == 2039


def test_model_aliases_and_hub_ids():
    assert get_model("meta-llama/Llama-2-7b-hf") == get_model("llama-2-7b") == get_model("Llama2-7B")
    assert (
        find_profile("h100").name == "h100-sxm"
        and find_profile("ib_ndr").kind == "ib_ndr"
        and find_profile("qwen3-8b").name == "qwen3-8b"
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: get_gpu("a101"), r"unknown GPU 'a101'; did you mean .*a100"),
        (lambda: get_gpu("h10"), r"did you mean h100"),
        (lambda: get_model("llama-2-8b"), r"unknown model 'llama-2-8b'; did you mean .*llama-2-7b"),
        (lambda: get_model("qwen3-7b"), r"did you mean qwen3-8b"),
        (lambda: get_link("nvlink5"), r"unknown link 'nvlink5'; did you mean nvlink4"),
        (lambda: find_profile("h2000"), r"unknown profile 'h2000'; did you mean h200"),
        (lambda: get_model("./no/such/config.json"), r"model config './no/such/config.json' does not exist"),
    ],
)
def test_unknown_names_suggest(call, match):
    with pytest.raises(SeqparError, match=match):
        call()


def _write_hf_config(tmp_path, cls_name, **kw):
    import transformers

    cfg = getattr(transformers, cls_name)(**kw)
    cfg.save_pretrained(tmp_path)
    return cfg


@pytest.mark.parametrize(
    "cls_name,kw",
    [
        (
            "LlamaConfig",
            dict(
                num_hidden_layers=3,
                hidden_size=96,
                num_attention_heads=6,
                num_key_value_heads=2,
                intermediate_size=160,
                vocab_size=500,
                rope_theta=5e5,
            ),
        ),
        (
            "MistralConfig",
            dict(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=4,
                intermediate_size=128,
                vocab_size=320,
            ),
        ),
        (
            "Qwen2Config",
            dict(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
                vocab_size=300,
                tie_word_embeddings=True,
            ),
        ),
        (
            "Qwen3Config",
            dict(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                intermediate_size=128,
                vocab_size=300,
            ),
        ),
    ],
)
def test_local_config_json_matches_transformers(tmp_path, cls_name, kw):
    cfg = _write_hf_config(tmp_path, cls_name, **kw)
    for path in (tmp_path, tmp_path / "config.json"):
        m = get_model(str(path))
        assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.intermediate_size, m.vocab_size) == (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.intermediate_size,
            cfg.vocab_size,
        )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
        assert (m.head_dim, m.architecture, m.tie_word_embeddings, m.rope_theta) == (
            head_dim,
            cfg.model_type,
            cfg.tie_word_embeddings,
            theta,
        )
        assert m.attention_bias == (cls_name == "Qwen2Config")


def test_plain_json_config_without_head_dim(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 4,
                "hidden_size": 256,
                "num_attention_heads": 8,
                "intermediate_size": 512,
                "vocab_size": 1000,
            }
        )
    )
    m = get_model(str(tmp_path))
    assert (m.head_dim, m.num_key_value_heads, m.rope_theta) == (32, 8, 10000.0)


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", r"is not valid JSON"),
        ("[1, 2]", r"holds a list, not a config object"),
        (
            '{"model_type": "llama", "hidden_size": 64}',
            r"lacks num_hidden_layers, num_attention_heads, intermediate_size, vocab_size",
        ),
        (
            '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3, "intermediate_size": 8, "vocab_size": 9}',
            r"is invalid: num_attention_heads 4 is not divisible by num_key_value_heads 3",
        ),
    ],
)
def test_malformed_config(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SeqparError, match=match):
        get_model(str(tmp_path / "config.json"))


def test_folder_without_config(tmp_path):
    with pytest.raises(SeqparError, match=r"config.json' does not exist"):
        get_model(str(tmp_path))


def test_clusters():
    d = default_cluster()
    assert (d.nodes, d.gpus_per_node, d.gpu.name, d.intra_node_link.kind, d.source) == (
        1,
        8,
        "a100-80g-sxm",
        "nvlink3",
        "default",
    )
    c = cluster_from_flags("h100", 8, 2)
    assert (c.world_size, c.intra_node_link.kind, c.inter_node_link.kind, c.host_ram_gib) == (16, "nvlink4", "ib_ndr", 2 * 8 * 80)
    assert cluster_from_flags("4090", 2).intra_node_link.kind == "pcie4"
    cpu = parse_cluster("cpu:4")
    assert (cpu.accelerator, cpu.world_size, cpu.gpu.name, cpu.intra_node_link.kind) == ("cpu", 4, "cpu", "loopback")
    assert cpu == cpu_cluster(4)
    for bad, match in (("cpu:0", "must be positive"), ("cpu:x", "not a whole number"), ("gpu:4", "not understood")):
        with pytest.raises(SeqparError, match=match):
            parse_cluster(bad)
    with pytest.raises(SeqparError, match=r"--gpus 0 must be a positive"):
        cluster_from_flags("h100", 0)
