"""The emitted configs use the tools' current keys and carry what changes the run, against the tools' own code:

- TRL: every emitted ``plan.sft.yaml`` goes through TRL 1.16's own `trl sft` parser (TrlParser over ScriptArguments,
  SFTConfig, ModelConfig) and SFTTrainer with DeprecationWarning and FutureWarning as errors. transformers 5.25's
  ``TrainingArguments.__post_init__`` warns that ``gradient_checkpointing`` / ``gradient_checkpointing_kwargs`` are
  deprecated aliases of ``activation_checkpointing`` / ``activation_checkpointing_kwargs`` (removed in v6), and TRL 1.16's
  ``SFTTrainer.__init__`` that ``use_liger_kernel`` is (removed in TRL 2.0; trl/trainer/sft_trainer.py).
- ArcticTraining 0.8.0 (config/scheduler.py, scheduler/hf_factory.py): without a ``scheduler:`` key its
  HFSchedulerConfig defaults (``name: linear``, ``warmup_ratio: 0.1``) apply; HFSchedulerFactory.create_scheduler calls
  transformers' ``get_scheduler(name, num_warmup_steps=int(warmup_ratio * training_horizon), num_training_steps=
  training_horizon)`` (times sequence_parallel_size, both), training_horizon = train_iters. The emitted schedule, built
  that way, gives seqpar launch's learning rate at every step.
- Axolotl (src/axolotl/utils/schemas/validation.py ``check_context_parallel_size``, read at axolotl-ai-cloud/axolotl
  after v0.18.0; axolotl 0.19.0 refuses seqpar's former sdpa the same way): ``context_parallel_size > 1`` raises unless
  ``attn_implementation`` is one of its flash-library implementations (flash_attention_2 / flash_attention_3), on any
  cluster; ``lr_scheduler`` is transformers' SchedulerType, whose ``constant`` ignores ``warmup_steps``; no field its
  schema marks deprecated.
- On CPU ranks, where a tool cannot run the plan, `--emit` and `check` say so instead of "fits".
"""

from __future__ import annotations

import json
import warnings

import pytest
import yaml
from typer.testing import CliRunner

from seqpar.cli import app

H100x8 = ["--gpu", "h100", "--gpus", "8", "--model", "llama-3-8b"]
TRL_PLANS = {  # name -> advise flags: every checkpointing kind, each sharding family, a Liger plan
    "ulysses-selective-zero3": ["-s", "256k", "--mode", "ulysses_attn", "--sp-degree", "4", "--checkpointing", "selective", "--recompute-layers", "32", "--sharding", "zero3"],
    "dp-offload-zero2-liger": ["-s", "16k", "--mode", "data_parallel", "--checkpointing", "offload", "--sharding", "zero2", "--fused-ops", "liger"],
    "ring-full-fsdp": ["-s", "128k", "--mode", "zigzag_ring_attn", "--sp-degree", "4", "--checkpointing", "full", "--sharding", "fsdp"],
    "dp-none-zero3": ["-s", "4k", "--mode", "data_parallel", "--checkpointing", "none", "--sharding", "zero3"],
}  # fmt: skip


def _advise(tmp_path, name: str, flags: list[str], tool: str, *cluster: str):
    r = CliRunner().invoke(
        app, ["advise", *flags, *(cluster or H100x8), "-o", str(tmp_path / f"{name}.json"), "--emit", tool, "--json"]
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r.stderr


def _strict():
    """DeprecationWarning and FutureWarning raise (the tools' deprecations), inside a with block."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", DeprecationWarning)
    warnings.simplefilter("error", FutureWarning)
    return ctx


def test_trl_configs_use_no_deprecated_key(tmp_path):
    pytest.importorskip("trl")
    from trl.scripts.sft import make_parser

    for name, flags in TRL_PLANS.items():
        plan, err = _advise(tmp_path, name, flags, "trl")
        raw = yaml.safe_load((tmp_path / f"{name}.sft.yaml").read_text())
        assert not {"gradient_checkpointing", "gradient_checkpointing_kwargs", "use_liger_kernel"} & set(raw), name
        ctx = _strict()
        try:  # this machine has no GPU: use_cpu, as SFTConfig refuses bf16 without one
            _, args, _, _ = make_parser().parse_args_and_config(
                ["--config", str(tmp_path / f"{name}.sft.yaml"), "--dataset_name", "x", "--use_cpu", "true"]
            )
        finally:
            ctx.__exit__(None, None, None)
        ck = plan["strategy"]["checkpointing"]
        on = ck != "none" and plan["strategy"]["sharding"] != "fsdp"  # under FSDP accelerate checkpoints
        assert args.activation_checkpointing is on and args.gradient_checkpointing is on, name
        kw = args.activation_checkpointing_kwargs or {}
        assert (kw.get("selective", False), kw.get("offload", False)) == (on and ck == "selective", on and ck == "offload")
    assert "TRL 1.16 deprecates use_liger_kernel" in err or plan["strategy"]["fused_ops"] == "none"


def test_trl_trainer_starts_from_the_emitted_config_without_deprecation_warnings(tmp_path):
    """SFTTrainer itself (where TRL warns about use_liger_kernel) built from an emitted config asking for Liger and
    selective checkpointing, with a tiny local model and chat data: no DeprecationWarning or FutureWarning."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import SFTTrainer
    from trl.scripts.sft import make_parser

    from seqpar_testing.chat import byte_tokenizer, conversations, tiny_llama

    flags = ["-s", "4k", "--mode", "data_parallel", "--checkpointing", "selective", "--sharding", "ddp", "--fused-ops", "liger"]
    _, err = _advise(tmp_path, "p", flags, "trl", "--gpu", "h100", "--gpus", "1", "--model", "tiny")
    assert "TRL 1.16 deprecates use_liger_kernel" in err  # said, and the config has no Liger key
    tiny_llama().save_pretrained(tmp_path / "m")
    byte_tokenizer(tmp_path / "m")
    argv = ["--config", str(tmp_path / "p.sft.yaml"), "--dataset_name", "x", "--use_cpu", "true", "--bf16", "false"]
    argv += ["--model_name_or_path", str(tmp_path / "m"), "--output_dir", str(tmp_path / "out")]
    _, args, model, _ = make_parser().parse_args_and_config(argv)
    args.model_init_kwargs = {"dtype": "float32"}
    ctx = _strict()
    try:
        trainer = SFTTrainer(
            model=model.model_name_or_path, args=args, train_dataset=datasets.Dataset.from_list(conversations(4))
        )
    finally:
        ctx.__exit__(None, None, None)
    assert trainer.args.activation_checkpointing and trainer.args.gradient_checkpointing_kwargs["use_reentrant"] is False


def _arctic_lrs(cfg: dict, steps: int) -> list[float]:
    """The learning rate at each step as ArcticTraining 0.8.0's HFSchedulerFactory builds the schedule: warmup and
    horizon both times sequence_parallel_size, stepped once per optimizer step (run in tests/emit/test_tool_runs.py)."""
    import torch
    from transformers import get_scheduler

    sched, sp, iters = cfg.get("scheduler", {}), cfg.get("sequence_parallel_size", 1), cfg["train_iters"]
    name, ratio = sched.get("name", "linear"), sched.get("warmup_ratio", 0.1)  # HFSchedulerConfig's defaults
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg["optimizer"]["learning_rate"])
    s = get_scheduler(name, optimizer=opt, num_warmup_steps=int(ratio * iters) * sp, num_training_steps=iters * sp)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step(), s.step()
    return out


def _seqpar_lrs(plan_file, steps: int) -> list[float]:
    import torch

    from seqpar.plan.launch_plan import LaunchPlan
    from seqpar.runtime.train.engine import make_scheduler

    plan = LaunchPlan.load(plan_file)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=plan.training.learning_rate)
    s = make_scheduler(opt, plan, steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step(), s.step()
    return out


@pytest.mark.parametrize(
    "schedule, warmup, steps, sp",
    [("constant", 0, 40, 4), ("constant", 8, 300, 4), ("constant", 7, 300, 1), ("cosine", 3, 40, 1)],
    ids=["constant", "warmup-sp4", "warmup", "cosine"],
)
def test_arctic_schedule_is_the_plans(tmp_path, schedule, warmup, steps, sp):
    mode = ["--mode", "ulysses_attn", "--sp-degree", str(sp)] if sp > 1 else ["--mode", "data_parallel"]
    flags = ["-s", "64k", *mode, "--sharding", "zero3"]
    flags += ["--lr-schedule", schedule, "--warmup-steps", str(warmup), "--steps", str(steps)]
    _, err = _advise(tmp_path, "p", flags, "arctic")
    assert "ArcticTraining warms up in multiples" not in err and "ArcticTraining decays a cosine" not in err
    cfg = yaml.safe_load((tmp_path / "p.arctic.yaml").read_text())
    assert set(cfg["scheduler"]) <= {"type", "name", "warmup_ratio", "scheduler_specific_kwargs"}  # extra="forbid"
    assert cfg["scheduler"]["type"] == "huggingface" and 0 <= cfg["scheduler"]["warmup_ratio"] <= 1
    got, want = _arctic_lrs(cfg, steps), _seqpar_lrs(tmp_path / "p.json", steps)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    del cfg["scheduler"]  # what the config said before: ArcticTraining's default, another schedule
    assert _arctic_lrs(cfg, steps) != pytest.approx(want, rel=1e-6)


def test_arctic_says_where_its_schedule_is_not_the_plans(tmp_path):
    """At sequence_parallel_size 4 ArcticTraining warms up in multiples of 4 steps and decays over 4x the steps."""
    flags = ["-s", "64k", "--mode", "ulysses_attn", "--sp-degree", "4", "--sharding", "zero3", "--steps", "40"]
    _, err = _advise(tmp_path, "w", [*flags, "--warmup-steps", "7"], "arctic")
    assert "ArcticTraining warms up in multiples of sequence_parallel_size 4: 4 steps for the plan's 7" in err
    _, err = _advise(tmp_path, "c", [*flags, "--lr-schedule", "cosine"], "arctic")
    assert "ArcticTraining decays a cosine schedule over sequence_parallel_size x train_iters" in err


AXOLOTL_FLASH = ("flash_attention_2", "flash_attention_3")  # its flash-library implementations (ATTN_IMPLS_USING_FLASH_LIB)
# the fields its schema marks deprecated (utils/schemas/config.py Field(deprecated=...), integrations/liger/args.py)
AXOLOTL_DEPRECATED = {
    "dataset_processes", "gc_steps", "pretrain_multipack_buffer_size", "xformers_attention", "sdp_attention",
    "flex_attention", "flash_attention", "sage_attention", "eager_attention", "fsdp", "fsdp_final_state_dict_type",
    "liger_swiglu",
}  # fmt: skip


@pytest.mark.parametrize("cluster", [H100x8, ["--cluster", "cpu:4", "--model", "tiny"]], ids=["h100x8", "cpu4"])
@pytest.mark.parametrize("mode", ["zigzag_ring_attn", "dist_flash_attn", "usp_attn", "ulysses_attn"])
def test_axolotl_ring_configs_pass_its_context_parallel_rule(tmp_path, cluster, mode):
    """Every mode axolotl runs as ring attention, on GPUs and on CPU ranks (where it cannot run, and says so)."""
    cpu = "cpu:4" in cluster
    flags = ["-s", "4k" if cpu else "128k", "--mode", mode, "--warmup-steps", "5", "--lr-schedule", "constant"]
    flags += ["--sp-degree", "4", "--ulysses-degree", "2"] if mode == "usp_attn" else ["--sp-degree", "2"]
    _, err = _advise(tmp_path, "p", flags, "axolotl", *cluster)
    cfg = yaml.safe_load((tmp_path / "p.axolotl.yaml").read_text())
    assert cfg["context_parallel_size"] > 1 and cfg["attn_implementation"] in AXOLOTL_FLASH
    assert not AXOLOTL_DEPRECATED & set(cfg)
    assert cfg["lr_scheduler"] == "constant_with_warmup" and cfg["warmup_steps"] == 5  # "constant" would skip the warmup
    head = next(line for line in err.splitlines() if line.startswith("axolotl: "))
    if cpu:
        assert head.startswith("axolotl: CANNOT RUN on this cluster") and "flash-attn kernels, which need CUDA GPUs" in err
    else:
        assert head.startswith("axolotl: fits")


def test_cpu_ranks_say_what_the_tool_cannot_run(tmp_path):
    """Ulysses through TRL on CPU ranks: DeepSpeed's sequence-parallel data loader all-gathers rows of unequal lengths,
    which gloo refuses: --emit trl and check of its files say so (check exits 1); DeepSpeed's and ArcticTraining's
    configs run there as emitted, and say fits."""
    cpu = ["--cluster", "cpu:2", "--model", "tiny"]
    flags = ["-s", "4k", "--mode", "ulysses_attn", "--sp-degree", "2", "--sharding", "zero2"]
    _, err = _advise(tmp_path, "t", flags, "trl", *cpu)
    assert "trl: CANNOT RUN on this cluster" in err and "gloo refuses rows of unequal lengths" in err
    r = CliRunner().invoke(app, ["check", str(tmp_path / "t.sft.yaml"), str(tmp_path / "t.accelerate.yaml"), *cpu, "--json"])
    got = json.loads(r.stdout)
    assert r.exit_code == 1 and got["fits"] and got["exit_code"] == 1
    assert got["cannot_run"] and got["cannot_run"][0].startswith(
        "trl cannot run this on CPU ranks: DeepSpeed's UlyssesSPDataLoaderAdapter"
    )
    for tool, name in (("deepspeed", "deepspeed.json"), ("arctic", "arctic.yaml")):
        _, err = _advise(tmp_path, tool, flags, tool, *cpu)
        assert f"{tool}: fits" in err, err
        r = CliRunner().invoke(app, ["check", str(tmp_path / f"{tool}.{name}"), *cpu, "-s", "4k", "--json"])
        assert r.exit_code == 0 and json.loads(r.stdout)["cannot_run"] == [], r.output
    _, err = _advise(tmp_path, "g", flags[:-2] + ["--sharding", "zero2"], "trl")  # on GPUs nothing is said
    assert "trl: fits" in err


def test_deepspeed_and_accelerate_read_the_emitted_keys_without_deprecations(tmp_path, caplog):
    """DeepSpeed 0.19.8 logs "Config parameter X is deprecated" (runtime/config_utils.py) for its renamed ZeRO keys
    (cpu_offload, stage3_gather_fp16_weights_on_model_save, ...); accelerate 1.16's config loader warns through
    warnings. Every emitted ZeRO section and accelerate YAML is read by them without either."""
    pytest.importorskip("deepspeed")
    import logging

    from accelerate.commands.config.config_args import load_config_from_file
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils import logger as ds_logger

    ds_logger.addHandler(caplog.handler)  # DeepSpeed's logger does not propagate
    try:
        for name, flags in TRL_PLANS.items():
            _advise(tmp_path, name, flags, "trl")
            ctx = _strict()
            try:
                load_config_from_file(str(tmp_path / f"{name}.accelerate.yaml"))
            finally:
                ctx.__exit__(None, None, None)
            ds = tmp_path / f"{name}.ds_config.json"
            if ds.exists():
                with caplog.at_level(logging.WARNING):
                    DeepSpeedZeroConfig(**json.loads(ds.read_text())["zero_optimization"])
        for tool, suffix in (("deepspeed", "deepspeed.json"), ("arctic", "arctic.yaml"), ("axolotl", "axolotl.yaml")):
            flags = ["-s", "64k", "--mode", "data_parallel", "--checkpointing", "offload", "--sharding", "zero3_offload"]
            _advise(tmp_path, tool, flags, tool)
            cfg = yaml.safe_load((tmp_path / f"{tool}.{suffix}").read_text())  # JSON is YAML
            with caplog.at_level(logging.WARNING):
                DeepSpeedZeroConfig(**(cfg.get("deepspeed") or cfg)["zero_optimization"])
    finally:
        ds_logger.removeHandler(caplog.handler)
    assert not [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage().lower()]
