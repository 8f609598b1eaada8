"""`seqpar advise --emit TOOL`: each emitted config loads in its tool's own loader (accelerate's config loader and launch
parser, TRL's `trl sft` parser) or, where the tool cannot be installed beside seqpar (Axolotl pins transformers 5.16,
ArcticTraining transformers < 5), against the keys and values its released schema documents; each round-trips through
`seqpar check CONFIG...` to the prediction the emission printed; what a tool cannot run is said, one line per choice."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from seqpar.advisor.cost.predict import predict
from seqpar.cli import app

H100x8 = ["--gpu", "h100", "--gpus", "8"]
ULYSSES = ["--seq-len", "256k", "--model", "llama-3-8b", *H100x8, "--mode", "ulysses_attn", "--sp-degree", "4"]
# every layer recomputed (--recompute-layers 32): the tools' configs cannot say a per-layer split
ULYSSES += ["--checkpointing", "selective", "--recompute-layers", "32", "--sharding", "zero3", "--loss-impl", "chunked"]


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def advise(runner, tmp_path, args, tool):
    r = runner.invoke(app, ["advise", *args, "-o", str(tmp_path / "plan.json"), "--emit", tool, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r.stderr


def check(runner, files, *flags):
    r = runner.invoke(app, ["check", *map(str, files), *flags, "--json"])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)


def predicted(stderr: str, tool: str) -> tuple[float, float]:
    """(peak GiB, tokens/s) from the emission's line 'TOOL: fits, predicted peak X GiB allocated, ..., N tokens/s'."""
    line = next(x for x in stderr.splitlines() if x.startswith(f"{tool}: "))
    peak = float(line.split("predicted peak ")[1].split(" GiB")[0])
    return peak, float(line.rsplit(", ", 1)[1].split(" tokens/s")[0].replace(",", ""))


def test_accelerate_loads_in_accelerate(runner, tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    plan, err = advise(runner, tmp_path, ULYSSES, "accelerate")
    yml, ds = tmp_path / "plan.accelerate.yaml", tmp_path / "plan.ds_config.json"
    cfg = load_config_from_file(str(yml))  # accelerate's own loader: unknown top-level keys raise
    assert (cfg.distributed_type, cfg.num_processes) == ("DEEPSPEED", 8)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(yml), "train.py"]))
    env = prepare_extend_env_parallelism_config(args, {})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from accelerate import ParallelismConfig

    pc = ParallelismConfig()  # built from the launch's environment, as Accelerator() does
    assert (pc.sp_size, pc.sp_backend, pc.dp_shard_size, pc.cp_size) == (4, "deepspeed", 2, 1)
    zero = json.loads(ds.read_text())["zero_optimization"]
    assert zero["stage"] == 3 and "offload_param" not in zero and json.loads(ds.read_text())["bf16"]["enabled"]
    assert "checkpointing selective" in err  # the config leaves it to the script: said so
    pins = ["--checkpointing", "selective", "--loss-impl", "chunked", "--seq-len", "256k", "--model", "llama-3-8b"]
    got = check(runner, [yml], "--gpu", "h100", *pins)
    assert got["prediction"] == plan["prediction"] and got["strategy"] == plan["strategy"]


def test_trl_loads_in_trl_and_round_trips(runner, tmp_path):
    pytest.importorskip("trl")
    from trl.scripts.sft import make_parser

    plan, err = advise(runner, tmp_path, ULYSSES, "trl")
    sft = tmp_path / "plan.sft.yaml"
    # TRL's own `trl sft` parser (TrlParser over ScriptArguments, SFTConfig, ModelConfig); unknown keys raise. use_cpu:
    # this machine has no GPU, and SFTConfig refuses bf16 without one.
    script, args, model, _ = make_parser().parse_args_and_config(
        ["--config", str(sft), "--dataset_name", "x", "--use_cpu", "true"]
    )
    assert (args.max_length, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (262144, 1, 1)
    kw = {"use_reentrant": False, "selective": True}
    assert args.activation_checkpointing and args.activation_checkpointing_kwargs == kw  # transformers 5.25's names
    assert args.gradient_checkpointing and args.gradient_checkpointing_kwargs == kw  # the aliases TRL reads mirror them
    assert args.pad_to_multiple_of == 4 and args.max_steps == plan["training"]["steps"]
    assert (model.model_name_or_path, model.dtype) == ("meta-llama/Meta-Llama-3-8B", "float32")
    got = check(runner, [sft, tmp_path / "plan.accelerate.yaml"], "--gpu", "h100")
    assert got["prediction"] == plan["prediction"] and got["strategy"] == plan["strategy"] and not got["partial"]
    assert "PARALLELISM_CONFIG_SP_DISABLE_IN_EVAL" in sft.read_text()


def test_trl_ring_attention_on_fsdp(runner, tmp_path):
    pytest.importorskip("trl")
    from accelerate.commands.config.config_args import load_config_from_file
    from trl.scripts.sft import make_parser

    args = ["--seq-len", "512k", "--model", "llama-3-8b", *H100x8, "--mode", "dist_flash_attn", "--sharding", "zero3"]
    plan, err = advise(runner, tmp_path, args, "trl")
    assert (
        "no tool runs LightSeq's dist_flash_attn schedule" in err
        and "accelerate runs torch context parallelism on FSDP2 only" in err
    )
    cfg = load_config_from_file(str(tmp_path / "plan.accelerate.yaml"))
    assert cfg.distributed_type == "FSDP" and cfg.fsdp_config["fsdp_version"] == 2
    got = check(runner, [tmp_path / "plan.sft.yaml", tmp_path / "plan.accelerate.yaml"])  # the seqpar: block: no flags
    s = got["strategy"]  # the cost model re-picks the degree among what TRL runs
    assert cfg.parallelism_config["parallelism_config_cp_size"] == s["sp_degree"]
    _, sft, model, _ = make_parser().parse_args_and_config(
        ["--config", str(tmp_path / "plan.sft.yaml"), "--dataset_name", "x", "--use_cpu", "true"]
    )
    assert model.attn_implementation == "sdpa" and sft.pad_to_multiple_of == 2 * s["sp_degree"]
    assert not sft.gradient_checkpointing  # under FSDP accelerate checkpoints (TRL's docs: not both)
    assert cfg.fsdp_config["fsdp_activation_checkpointing"] == (s["checkpointing"] != "none")
    assert (s["mode"], s["sharding"]) == ("zigzag_ring_attn", "fsdp")
    assert (got["prediction"]["peak_memory_gib"], got["prediction"]["tokens_per_s"]) == pytest.approx(
        predicted(err, "trl"), rel=1e-3
    )


# Keys and values of axolotl 0.19.0's AxolotlInputConfig (utils/schemas/config.py, training.py, model.py, fsdp.py,
# integrations/liger/args.py, enums.py) that seqpar writes.
AXOLOTL_KEYS = {
    "base_model", "datasets", "output_dir", "sequence_len", "micro_batch_size", "gradient_accumulation_steps", "max_steps",
    "learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "max_grad_norm", "seed", "optimizer", "bf16", "fp16",
    "attn_implementation", "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_offloading",
    "selective_checkpointing", "context_parallel_size", "ring_attn_func", "tiled_mlp", "tiled_mlp_use_original_mlp",
    "plugins", "liger_rms_norm", "liger_rope", "liger_glu_activation", "liger_fused_linear_cross_entropy", "deepspeed",
    "fsdp_version", "fsdp_config",
}  # fmt: skip
AXOLOTL_FSDP = {"offload_params", "state_dict_type", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "reshard_after_forward"}


def test_axolotl_against_its_schema_and_round_trip(runner, tmp_path):
    plan, err = advise(
        runner,
        tmp_path,
        [*ULYSSES[:-4], "--checkpointing", "offload", "--sharding", "fsdp", "--tiled-mlp", "--fused-ops", "liger"],
        "axolotl",
    )
    assert "axolotl has no Ulysses (its context parallelism is ring attention only)" in err
    cfg = yaml.safe_load((tmp_path / "plan.axolotl.yaml").read_text())
    assert set(cfg) <= AXOLOTL_KEYS and set(cfg["fsdp_config"]) <= AXOLOTL_FSDP
    assert cfg["ring_attn_func"] in ("varlen_llama3", "batch_ring") and cfg["attn_implementation"] == "flash_attention_2"
    assert cfg["activation_offloading"] == "hidden_states" and cfg["gradient_checkpointing"] is True  # offload needs it
    assert cfg["plugins"] == ["axolotl.integrations.liger.LigerPlugin"] and cfg["tiled_mlp_use_original_mlp"] is True
    assert cfg["context_parallel_size"] == 4 and cfg["fsdp_version"] == 2 and cfg["lr_scheduler"] in ("constant", "cosine")
    got = check(runner, [tmp_path / "plan.axolotl.yaml"], *H100x8)
    assert got["strategy"]["mode"] == "zigzag_ring_attn" and not got["partial"] and got["defaults"] == []
    assert (got["prediction"]["peak_memory_gib"], got["prediction"]["tokens_per_s"]) == pytest.approx(
        predicted(err, "axolotl"), abs=0.51
    )


# arctic-training 0.8.0 config/trainer.py, model.py, data.py, optimizer.py (BaseConfig: extra="forbid").
ARCTIC_TOP = {
    "type", "code", "skip_validation", "model", "tokenizer", "data", "logger", "wandb", "scheduler", "optimizer",
    "deepspeed", "epochs", "loss_log_interval", "train_log_iter_interval", "train_log_metrics_path",
    "gradient_accumulation_steps", "micro_batch_size", "sequence_parallel_size", "activation_checkpoint_cpu_offload",
    "tiled_mlp_compute", "seed", "checkpoint", "train_iters", "eval_interval", "eval_log_iter_interval", "exit_iteration",
    "exit_iteration_this_run", "min_iterations", "overfit_first_batch", "mem_profiler", "mem_profiler_dir",
    "mem_profiler_max_entries", "kill_switch_path",
}  # fmt: skip
ARCTIC_MODEL = {
    "type",
    "name_or_path",
    "dtype",
    "save_name",
    "attn_implementation",
    "disable_activation_checkpoint",
    "peft_config",
    "hf_config_kwargs",
}
ARCTIC_OPTIMIZER = {"type", "weight_decay", "betas", "learning_rate", "lr"}


def test_arctic_against_its_schema_and_round_trip(runner, tmp_path):
    args = ["--seq-len", "512k", "--model", "llama-3-8b", *H100x8, "--mode", "zigzag_ring_attn", "--checkpointing", "offload"]
    plan, err = advise(runner, tmp_path, [*args, "--sharding", "zero3_offload", "--fused-ops", "liger"], "arctic")
    assert "ArcticTraining has no ring attention" in err
    cfg = yaml.safe_load((tmp_path / "plan.arctic.yaml").read_text())
    assert set(cfg) <= ARCTIC_TOP and set(cfg["model"]) <= ARCTIC_MODEL and set(cfg["optimizer"]) <= ARCTIC_OPTIMIZER
    assert cfg["model"]["type"] == "liger" and cfg["optimizer"]["type"] == "cpu_adam" and cfg["activation_checkpoint_cpu_offload"]
    z = cfg["deepspeed"]["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == z["offload_optimizer"]["device"] == "cpu"
    assert isinstance(cfg["data"]["max_length"], int) and cfg["data"]["max_length"] == 524288  # never '512k' (= 512000 there)
    got = check(runner, [tmp_path / "plan.arctic.yaml"], *H100x8)
    assert got["strategy"]["mode"] == "ulysses_attn" and got["strategy"]["sharding"] == "zero3_offload"
    assert (got["prediction"]["peak_memory_gib"], got["prediction"]["tokens_per_s"]) == pytest.approx(
        predicted(err, "arctic"), abs=0.51
    )


def test_deepspeed_json(runner, tmp_path):
    plan, err = advise(runner, tmp_path, ULYSSES, "deepspeed")
    ds = json.loads((tmp_path / "plan.deepspeed.json").read_text())
    assert (
        ds["sequence_parallel_size"] == 4
        and ds["zero_optimization"]["stage"] == 3
        and ds["seq_parallel_communication_data_type"] == "bf16"
    )
    pins = ["--checkpointing", "selective", "--loss-impl", "chunked", "--seq-len", "256k", "--model", "llama-3-8b"]
    got = check(runner, [tmp_path / "plan.deepspeed.json"], *H100x8, *pins)
    assert got["prediction"] == plan["prediction"]


def test_a_tool_that_cannot_split_the_model_is_refused(runner, tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 3, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"vocab_size": 256}))
    args = ["--seq-len", "64k", "--model", str(tmp_path), *H100x8, "--mode", "zigzag_ring_attn", "--sp-degree", "8"]
    r = runner.invoke(app, ["advise", *args, "-o", str(tmp_path / "p.json"), "--emit", "arctic"])
    last = r.stderr.strip().splitlines()[-1]
    assert r.exit_code == 1 and last.startswith("error: --emit arctic: arctic runs none of its modes here: ulysses_attn")
    assert "3 query heads" in last and last.endswith(
        f"wrote {tmp_path / 'p.json'} only, no arctic files (seqpar launch {tmp_path / 'p.json'} runs the plan)"
    )
    assert sorted(tmp_path.iterdir()) == [tmp_path / "config.json", tmp_path / "p.json"]  # the plan, whatever the outcome


def test_emission_predicted_to_oom_writes_nothing(runner, tmp_path):
    args = [
        "--seq-len",
        "2M",
        "--model",
        "llama-3-8b",
        *H100x8,
        "--mode",
        "zigzag_ring_attn",
        "--tiled-mlp",
        "--fused-ops",
        "liger",
    ]
    args += ["--checkpointing", "offload", "--sharding", "fsdp", "-o", str(tmp_path / "p.json")]
    assert runner.invoke(app, ["advise", *args]).exit_code == 0  # seqpar's own runtime has TiledMLP: it fits
    (tmp_path / "p.json").unlink()
    r = runner.invoke(app, ["advise", *args, "--emit", "trl"])
    assert r.exit_code == 1 and "TRL, transformers and accelerate have no TiledMLP" in r.stderr and "RISKS OOM" in r.stderr
    last = r.stderr.strip().splitlines()[-1]  # the binding constraint, and only files that were written
    assert last.startswith("error: --emit trl: nothing trl expresses fits: the smallest footprint, zigzag_ring_attn sp=8")
    assert "GiB margin > 79.2 GiB a process can allocate on h100-sxm" in last
    assert list(tmp_path.iterdir()) == [tmp_path / "p.json"]


def test_emit_needs_an_output(runner):
    r = runner.invoke(app, ["advise", "--seq-len", "64k", *H100x8, "--emit", "trl"])
    assert r.exit_code == 2 and "add -o plan.json" in r.stderr
    bad = runner.invoke(app, ["advise", "--seq-len", "64k", *H100x8, "-o", "x.json", "--emit", "megatron"])
    assert bad.exit_code == 2


def test_emit_and_check_import_no_torch(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from typer.testing import CliRunner; from seqpar.cli import app; r = CliRunner().invoke(app, "
        f"['advise', '--seq-len', '128k', '--gpu', 'h100', '--gpus', '8', '-o', r'{tmp_path / 'p.json'}', '--emit', 'trl']); "
        "assert r.exit_code == 0, r.output; "
        f"r = CliRunner().invoke(app, ['check', r'{tmp_path / 'p.sft.yaml'}', r'{tmp_path / 'p.accelerate.yaml'}', '--gpu', 'h100']); "
        "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    "tool,flags",
    [
        (
            "axolotl",
            ["--mode", "zigzag_ring_attn", "--checkpointing", "selective", "--sharding", "zero2", "--loss-impl", "chunked"],
        ),
        (
            "axolotl",
            [
                "--mode",
                "data_parallel",
                "--checkpointing",
                "offload",
                "--sharding",
                "fsdp",
                "--tiled-mlp",
                "--fused-ops",
                "liger",
            ],
        ),
        (
            "arctic",
            ["--mode", "ulysses_attn", "--checkpointing", "offload", "--sharding", "zero3_offload", "--loss-impl", "chunked"],
        ),
        (
            "trl",
            [
                "--mode",
                "zigzag_ring_attn",
                "--checkpointing",
                "offload",
                "--sharding",
                "fsdp",
                "--loss-impl",
                "chunked",
            ],  # no Liger: TRL 1.16 deprecates use_liger_kernel (tests/emit/test_current_keys.py)
        ),
    ],
)
def test_a_plan_the_tool_runs_unchanged_checks_back_to_its_own_prediction(runner, tmp_path, tool, flags):
    every_layer = ["--recompute-layers", "32", "--offload-layers", "32"]  # the tools have no per-layer split
    plan, err = advise(runner, tmp_path, ["--seq-len", "64k", "--model", "llama-3-8b", *H100x8, *flags, *every_layer], tool)
    assert f"{tool} runs " not in err  # nothing was changed
    files = sorted(p for p in tmp_path.iterdir() if p.suffix == ".yaml")
    got = check(runner, files, *H100x8)
    assert got["strategy"] == plan["strategy"] and got["prediction"] == plan["prediction"]


def test_a_layer_split_is_emitted_as_the_whole_model_policy_and_said(runner, tmp_path):
    """The advisor keeps 3 of 32 layers un-recomputed (plan field checkpoint_layers); no tool has the split, so the
    emitted config checkpoints every layer, the output says so, and the config checks back to that strategy's prediction."""
    flags = ["--mode", "zigzag_ring_attn", "--checkpointing", "selective", "--sharding", "zero2", "--loss-impl", "chunked"]
    flags += ["--recompute-layers", "29"]
    plan, err = advise(runner, tmp_path, ["--seq-len", "64k", "--model", "llama-3-8b", *H100x8, *flags], "axolotl")
    assert plan["strategy"]["checkpoint_layers"] == 29
    assert "axolotl checkpoints every decoder layer or none (no checkpoint_layers)" in err and "the first 29" in err
    files = sorted(p for p in tmp_path.iterdir() if p.suffix == ".yaml")
    got = check(runner, files, *H100x8)
    assert got["strategy"] == {**plan["strategy"], "checkpoint_layers": None}
    assert got["prediction"]["peak_memory_gib"] < plan["prediction"]["peak_memory_gib"]


@pytest.mark.parametrize("flag", [["--recompute-layers", "20"], ["--kept-saves", "matmuls"], ["--kept-host-layers", "2"]])
def test_check_refuses_seqpar_only_split_flags_on_a_tool_config(runner, tmp_path, flag):
    """accelerate's config (and its script's plain checkpointing) cannot say a per-layer split or what kept layers save:
    the flag is refused (exit 2), not silently priced."""
    plan, _ = advise(runner, tmp_path, ULYSSES, "accelerate")
    r = runner.invoke(app, ["check", str(tmp_path / "plan.accelerate.yaml"), *flag])
    assert r.exit_code == 2, r.output
    assert f"{flag[0]} {flag[1]}: plan.accelerate.yaml cannot split checkpointing by layer" in r.output


def test_a_deepspeed_script_splits_the_checkpointing_as_the_flags_say(runner, tmp_path):
    """DeepSpeed's script checkpoints with seqpar.apply, which splits by layer: the split flags are priced (the same
    prediction as the strategy with that split), and a split the runtime refuses is refused with its rule."""
    from seqpar.advisor.cluster import cluster_from_flags
    from seqpar.plan.specs import Strategy, Workload
    from seqpar.profiles import get_model

    advise(runner, tmp_path, ULYSSES, "deepspeed")
    got = check(runner, [tmp_path / "plan.deepspeed.json"], "--recompute-layers", "20")
    s = Strategy.model_validate({**got["strategy"], "checkpoint_layers": 20})
    w = Workload(model=get_model("llama-3-8b"), seq_len=262144)
    assert got["strategy"]["checkpoint_layers"] == 20
    assert got["prediction"] == predict(w, cluster_from_flags("h100", 8, host_ram_gib=1280.0), s).model_dump()
    r = runner.invoke(app, ["check", str(tmp_path / "plan.deepspeed.json"), "--kept-host-layers", "2"])
    assert r.exit_code == 2 and "kept_host_layers 2 sends kept matmul outputs to host memory, but kept_saves is all" in r.stderr
