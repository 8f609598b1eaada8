"""`seqpar check CONFIG...` on the tools' own configs: what each key maps to (exact, table-driven), the verdict and the
cheapest fix in the tool's keys, partial verdicts naming the keys the cost model does not describe, and bad configs
(unknown kind, malformed YAML, a degree that does not divide the GPUs) exiting 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from seqpar.advisor.cost.predict import predict
from seqpar.cli import app
from seqpar.emit.arctic import human_int
from seqpar.emit.check import detect
from seqpar.plan.errors import SeqparError
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

H100x8 = ["--gpu", "h100", "--gpus", "8"]
AXOLOTL = {"base_model": "meta-llama/Meta-Llama-3-8B", "datasets": [{"path": "x", "type": "completion"}], "sequence_len": 262144}
AXOLOTL |= {"micro_batch_size": 1, "gradient_checkpointing": True, "deepspeed": {"zero_optimization": {"stage": 3}}}


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def write(tmp_path: Path, name: str, data) -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not name.endswith(".json") else json.dumps(data))
    return p


def run(runner, *args):
    return runner.invoke(app, ["check", *map(str, args)])


@pytest.mark.parametrize(
    "data,kind",
    [
        ({"schema_version": 1}, "plan"),
        ({"distributed_type": "FSDP"}, "accelerate"),
        ({"base_model": "x"}, "axolotl"),
        ({"model": {"name_or_path": "x"}, "data": {}}, "arctic"),
        ({"zero_optimization": {"stage": 2}}, "deepspeed"),
        ({"max_length": 4096, "output_dir": "o"}, "trl"),
    ],
)
def test_detect(data, kind):
    assert detect(data, Path("x")) == kind


@pytest.mark.parametrize(
    "text,n", [(500000, 500000), ("500_000", 500000), ("128k", 128000), ("128ki", 131072), ("1.5m", 1500000)]
)
def test_arctic_human_int(text, n):
    assert human_int(text, "data.max_length", Path("a.yml")) == n


def test_axolotl_oom_with_the_fix_in_its_keys(runner, tmp_path):
    cfg = AXOLOTL | {"fp8": True, "some_unknown_key": 3}  # fp8: a memory key the cost model does not describe
    r = run(runner, write(tmp_path, "ax.yml", cfg), *H100x8, "--json")
    assert r.exit_code == 1, r.output
    got = json.loads(r.stdout)
    assert got["strategy"]["mode"] == "data_parallel" and got["strategy"]["sharding"] == "zero3"
    assert got["partial"] and got["not_understood"] == ["ax.yml: fp8 True"] and got["ignored"] == ["ax.yml: some_unknown_key"]
    # the reference: the cost model on the same strategy, built by hand
    s = Strategy.over("data_parallel", 1, 8, checkpointing="full", sharding="zero3", loss_impl="hf")
    w = Workload(model=get_model("llama-3-8b"), seq_len=262144)
    from seqpar.advisor.cluster import cluster_from_flags

    assert got["prediction"] == predict(w, cluster_from_flags("h100", 8), s).model_dump()
    assert got["fix_keys"] == ["axolotl.yaml: context_parallel_size: 8", 'axolotl.yaml: ring_attn_func: "batch_ring"']
    fixed = Strategy.model_validate(got["fix_strategy"])
    assert not predict(w, cluster_from_flags("h100", 8), fixed).oom_risk
    text = run(runner, tmp_path / "ax.yml", *H100x8)
    assert "PARTIAL verdict: the cost model does not describe ax.yml: fp8 True" in text.stderr
    assert "in axolotl's keys: axolotl.yaml: context_parallel_size: 8" in text.stderr


def test_axolotl_applying_the_fix_fits(runner, tmp_path):
    cfg = AXOLOTL | {"context_parallel_size": 8, "ring_attn_func": "batch_ring"}
    r = run(runner, write(tmp_path, "ax.yml", cfg), *H100x8, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["fits"] and not json.loads(r.stdout)["partial"]


@pytest.mark.parametrize(
    "data,kind,expect",
    [
        # TRL: its defaults where a key is absent (micro-batch 8, checkpointing on), the loss chunked (fused LM head)
        (
            {"model_name_or_path": "meta-llama/Meta-Llama-3-8B", "max_length": 8192},
            "trl",
            dict(micro_batch_size=8, checkpointing="full", loss_impl="chunked", optimizer="adamw", mode="data_parallel"),
        ),
        (
            {
                "model_name_or_path": "meta-llama/Meta-Llama-3-8B",
                "max_length": 8192,
                "gradient_checkpointing_kwargs": {"offload": True},
                "dtype": "bfloat16",
            },
            "trl",
            dict(checkpointing="offload", optimizer="adamw-bf16"),
        ),
        (
            {
                "base_model": "meta-llama/Meta-Llama-3-8B",
                "datasets": [],
                "sequence_len": 65536,
                "context_parallel_size": 4,
                "activation_offloading": "hidden_states",
                "gradient_checkpointing": True,
                "tiled_mlp": True,
                "liger_fused_linear_cross_entropy": True,
                "plugins": ["axolotl.integrations.liger.LigerPlugin"],
            },
            "axolotl",
            dict(
                mode="zigzag_ring_attn", sp_degree=4, checkpointing="offload", tiled_mlp=True, loss_impl="chunked", sharding="ddp"
            ),
        ),
        (
            {
                "model": {"name_or_path": "meta-llama/Meta-Llama-3-8B", "type": "liger"},
                "data": {"sources": [], "max_length": "64ki"},
                "sequence_parallel_size": 8,
                "activation_checkpoint_cpu_offload": True,
                "tiled_mlp_compute": True,
            },
            "arctic",
            dict(
                mode="ulysses_attn",
                sp_degree=8,
                checkpointing="offload",
                tiled_mlp=True,
                fused_ops="liger",
                sharding="zero2",
                seq_len=65536,
            ),
        ),
    ],
)
def test_what_each_key_maps_to(runner, tmp_path, data, kind, expect):
    r = run(runner, write(tmp_path, f"c.{kind}.yaml", data), *H100x8, "--json")
    assert r.exit_code in (0, 1), r.output
    got = json.loads(r.stdout)
    flat = {**got["strategy"], **got["workload"]}
    assert {k: flat[k] for k in expect} == expect


@pytest.mark.parametrize(
    "files,match",
    [
        ({"a.yaml": {"some": "thing"}}, r"is none seqpar reads"),
        ({"a.yaml": "key: [unclosed"}, r"is not valid YAML \(line \d+"),
        (
            {"a.yaml": AXOLOTL | {"context_parallel_size": 3}},
            r"the sequence-parallel degree 3 does not divide the 8 GPUs; use one of \[1, 2, 4, 8\]",
        ),
        (
            {"a.yaml": {"distributed_type": "FSDP", "num_processes": 8, "parallelism_config": {"parallelism_config_cp_size": 4}}},
            r"= 4, but num_processes is 8",
        ),
        ({"a.yaml": {"distributed_type": "MULTI_GPU", "num_processes": 4}}, r"num_processes 4 is not --gpus x --nodes \(8 x 1\)"),
        ({"a.yaml": {"max_seq_length": 4096, "output_dir": "o"}}, r"max_seq_length was removed in TRL 0.20"),
        ({"a.yaml": AXOLOTL, "b.yaml": {"distributed_type": "NO"}}, r"check one launch's configs at a time"),
        ({"a.yaml": {"model": {"name_or_path": "x"}, "data": {"max_length": "lots"}}}, r"data.max_length 'lots' is not a number"),
        ({"a.yaml": AXOLOTL | {"tensor_parallel_size": "two"}}, r"tensor_parallel_size 'two' is not a whole number >= 1"),
        ({"a.yaml": AXOLOTL | {"plugins": 5}}, r"a key holds a value of the wrong type for axolotl"),
        ({"a.yaml": "a: " + "[" * 5000 + "]" * 5000}, r"nests too deeply to be a config"),
    ],
)
def test_bad_configs_exit_2_with_one_line(runner, tmp_path, files, match):
    paths = []
    for name, data in files.items():
        p = tmp_path / name
        p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
        paths.append(p)
    r = run(runner, *paths, *H100x8, "--seq-len", "64k")
    assert r.exit_code == 2, r.output
    err = [x for x in r.stderr.splitlines() if not x.startswith("cluster:")]
    assert len(err) == 1 and err[0].startswith("error: ")
    import re

    assert re.search(match, err[0]), err[0]


def test_a_plan_still_checks_as_a_plan(runner, tmp_path):
    plan = tmp_path / "plan.json"
    assert runner.invoke(app, ["advise", "--seq-len", "64k", *H100x8, "-o", str(plan)]).exit_code == 0
    assert run(runner, plan).exit_code == 0
    with pytest.raises(SeqparError, match=r"is a seqpar plan: check it on its own"):
        from seqpar.emit.check import read_all

        read_all([plan, write(tmp_path, "ax.yml", AXOLOTL)])


def test_a_trl_config_is_priced_with_trl_s_own_loss(runner, tmp_path):
    """TRL's SFTTrainer runs its fused LM head whatever the config says of the loss (estimate_memory's loss_path "trl":
    a compacted copy of the hidden states and one (4096, 32768) tile); `seqpar check` of a TRL config predicts that,
    not seqpar's chunked loss, and the same strategy in an Axolotl config (seqpar's loss terms) prices otherwise."""
    from seqpar.advisor.cluster import cluster_from_flags
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.memory import estimate_memory

    cfg = {"model_name_or_path": "meta-llama/Meta-Llama-3-8B", "max_length": 65536, "per_device_train_batch_size": 1}
    r = run(runner, write(tmp_path, "sft.yaml", cfg), *H100x8, "--json")
    got = json.loads(r.stdout)
    s = Strategy.model_validate(got["strategy"])
    w = Workload(model=get_model("llama-3-8b"), seq_len=65536, optimizer="adamw")
    cl, c = cluster_from_flags("h100", 8), load_coefficients()
    trl = estimate_memory(w, cl, s, c, loss_path="trl", norms_tiled=False)
    ours = estimate_memory(w, cl, s, c, loss_path="seqpar", norms_tiled=False)
    assert got["prediction"]["peak_memory_gib"] == pytest.approx(trl.peak_bytes / 2**30, abs=1e-3)
    assert "loss_hidden_copy" in trl.phase_terms["loss"] and "loss_hidden_copy" not in ours.phase_terms["loss"]
    assert got["prediction"] == predict(w, cl, s, c, loss_path="trl", norms_tiled=False).model_dump()
    assert got["prediction"] != predict(w, cl, s, c, loss_path="seqpar", norms_tiled=False).model_dump()
