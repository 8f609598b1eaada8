"""The engines' semantics the cost model prices, read from the tools themselves (the installed packages: deepspeed 0.19.8,
accelerate 1.16, torch 2.13, trl 1.16, transformers 5.25) and checked against the cost model's term for each.

Each test names the package, version and file it reads, runs the tool's own code where it runs on CPU, and asserts the
cost model's term agrees (seqpar/advisor/cost/memory.py, deepspeed_memory.py, throughput.py)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost import deepspeed_memory
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.memory import _loss_bytes, model_states, precision
from seqpar.plan.jobspec import deepspeed_config
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

from seqpar_testing import run_ranks

M8 = get_model("llama-3.1-8b")


def _source(package: str, relpath: str) -> str:
    import importlib

    root = Path(importlib.import_module(package).__file__).parent
    return (root / relpath).read_text()


def _versions():
    import accelerate
    import deepspeed
    import trl

    return deepspeed.__version__, accelerate.__version__, torch.__version__.split("+")[0], trl.__version__


def test_installed_versions_are_the_ones_cited():
    ds, acc, th, tr = _versions()
    assert (ds, acc.rsplit(".", 1)[0], th.rsplit(".", 1)[0], tr.rsplit(".", 1)[0]) == ("0.19.8", "1.16", "2.13", "1.16")


# ---- over which group ZeRO and FSDP2 shard model states when the sequence is split


def _groups(rank, world, sp):
    import deepspeed.comm as dscomm
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    mpu.initialize_sequence_parallel(sequence_parallel_size=sp)
    return dist.get_world_size(mpu.get_sequence_data_parallel_group()), dist.get_world_size(mpu.get_sequence_parallel_group())


@pytest.mark.slow  # 4 gloo ranks of DeepSpeed (about 6 s): the default run keeps the source-reading tests
@pytest.mark.timeout(120)
def test_deepspeed_ulysses_zero_partitions_over_the_whole_world():
    """deepspeed 0.19.8 deepspeed/runtime/sequence_parallel/parallel_state_sp.py builds the sequence-data-parallel group as
    sp x dp = world ranks, and deepspeed/runtime/engine.py hands that group to every ZeRO optimizer
    (``dp_process_group=self.seq_data_parallel_group``): Ulysses / ALST partition parameters, gradients and optimizer
    states over all ranks, so the model states per GPU are Psi * bytes / world."""
    got = run_ranks(_groups, 4, 2, timeout=100)
    assert got == [(4, 2)] * 4
    from deepspeed.runtime.engine import DeepSpeedEngine

    zero = inspect.getsource(DeepSpeedEngine._configure_zero_optimizer)
    assert zero.count("dp_process_group=self.seq_data_parallel_group") >= 2  # stage 1/2 and stage 3
    s = Strategy(mode="ulysses_attn", sp_degree=2, dp_degree=2, sharding="zero3")
    states = model_states(M8, s.sharding, "adamw", "bf16", s.world_size)
    assert states["optimizer_states"] == M8.num_params * 12 / 4
    assert states["gradients"] == M8.num_params * 2 / 4


def test_accelerate_sp_size_hands_deepspeed_its_own_groups():
    """accelerate 1.16 parallelism_config.py: with sp_backend deepspeed and sp_size > 1, build_device_mesh builds no mesh
    (DeepSpeed makes its groups) and the dp_shard x sp = num_processes check is skipped; accelerator.py passes DeepSpeed
    the mpu of UlyssesSPAttentionHF.register_with_transformers: ZeRO shards over DeepSpeed's sequence-data-parallel group
    (the test above), whatever dp_shard_size says."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig

    pc = ParallelismConfig(dp_shard_size=2, sp_size=2, sp_backend="deepspeed")
    assert pc.build_device_mesh("cpu") is None
    prep = inspect.getsource(Accelerator._prepare_deepspeed)
    assert "UlyssesSPAttentionHF.register_with_transformers" in prep and 'kwargs["mpu"] = mpu' in prep


def test_fsdp2_with_cp_shards_over_dp_shard_times_cp():
    """accelerate 1.16 parallelism_config.py: FSDP2 shards over the joint dp_shard_cp mesh dimension (dp_shard x cp), and
    utils/fsdp_utils.py fsdp2_prepare_model passes fully_shard mesh[fsdp_dim_names]; torch 2.13
    torch/distributed/tensor/experimental/_context_parallel/_attention.py context_parallel shards only the buffers (inputs,
    labels, positions) along the sequence, not the parameters. So FSDP2 + cp_size keeps Psi * bytes / (dp_shard x cp) =
    Psi * bytes / world of model states per GPU."""
    from accelerate.parallelism_config import ParallelismConfig

    pc = ParallelismConfig(dp_shard_size=2, cp_size=2, cp_backend="torch")
    assert pc.fsdp_dim_names == ["dp_shard_cp"] and pc.dp_shard_cp_dim_names == ["dp_shard", "cp"]
    assert "mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]" in _source("accelerate", "utils/fsdp_utils.py")
    cp_src = _source("torch", "distributed/tensor/experimental/_context_parallel/_attention.py")
    assert "Note that ``buffers`` should not contain any\n            nn.Parameter." in cp_src
    s = Strategy(mode="zigzag_ring_attn", sp_degree=2, dp_degree=2, sharding="fsdp")
    w = Workload(model=M8, seq_len=65536)
    states = model_states(M8, "fsdp", "adamw", "bf16", s.world_size, precision(w, s))
    assert states["weights"] == M8.num_params * 4 / 4  # fp32 sharded master over all four ranks


# ---- float32 master weights


def test_fp32_master_weights_per_engine():
    """Where each engine keeps fp32 weights, and the cost model's regime (memory.precision):
    - deepspeed 0.19.8 runtime/zero/stage3.py and stage_1_and_2.py: bf16 parameters, fp32 partitions of the master
      (``fp32_partitioned_groups_flat``, ``single_partition_of_fp32_groups``) beside two fp32 moments: 2 + 12 bytes;
    - accelerate 1.16 utils/fsdp_utils.py fsdp2_prepare_model: trainable parameters upcast to fp32 whenever
      mixed_precision is not "no", MixedPrecisionPolicy computing in bf16: 4 bytes per weight, sharded;
    - trl 1.16 trainer/model_config.py: ModelConfig.dtype defaults to float32 (fp32 weights under bf16 autocast:
      seqpar's adamw); loaded in bfloat16 without DeepSpeed or FSDP, AdamW's moments are bf16 and no fp32 copy exists
      (seqpar's adamw-bf16, which seqpar.emit.trl reads ``dtype: bfloat16`` as)."""
    from trl import ModelConfig

    assert "self.fp32_partitioned_groups_flat" in _source("deepspeed", "runtime/zero/stage3.py")
    assert "self.single_partition_of_fp32_groups" in _source("deepspeed", "runtime/zero/stage_1_and_2.py")
    fsdp = _source("accelerate", "utils/fsdp_utils.py")
    assert 'if accelerator.mixed_precision != "no"' in fsdp and "param.data = param.data.to(torch.float32)" in fsdp
    assert ModelConfig().dtype == "float32"
    w = Workload(model=M8, seq_len=32768)
    zero = precision(w, Strategy(mode="data_parallel", dp_degree=8, sharding="zero3"))
    fsdp_p = precision(w, Strategy(mode="data_parallel", dp_degree=8, sharding="fsdp"))
    bf16 = precision(w.model_copy(update={"optimizer": "adamw-bf16"}), Strategy(mode="data_parallel", dp_degree=8))
    assert (zero.weight, zero.optim) == (2, 12)
    assert (fsdp_p.weight, fsdp_p.compute) == (4, 2)
    assert (bf16.weight, bf16.optim) == (2, 4)


# ---- DeepSpeed's buffers at the values seqpar's configs set


@pytest.mark.parametrize("sharding", ["zero2", "zero3", "zero3_offload"])
def test_deepspeed_buffer_sizes_are_its_defaults(sharding):
    """seqpar writes no bucket, prefetch or persistence size (seqpar/plan/jobspec.py deepspeed_config, which
    seqpar/emit/common.py ds_config reuses for every DeepSpeed target), so DeepSpeed's defaults apply: deepspeed 0.19.8
    runtime/zero/config.py DeepSpeedZeroConfig, parsed here from the config seqpar writes."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from seqpar_testing.train import make_plan

    plan = make_plan(8, sharding=sharding)
    zero = deepspeed_config(plan)["zero_optimization"]
    assert not {k for k in zero if "bucket" in k or "persistence" in k or "max_live" in k or "reuse" in k}
    cfg = DeepSpeedZeroConfig(**zero)
    d = deepspeed_memory
    assert (cfg.reduce_bucket_size, cfg.allgather_bucket_size, cfg.sub_group_size) == (
        d.REDUCE_BUCKET,
        d.ALLGATHER_BUCKET,
        d.SUB_GROUP,
    )
    assert (cfg.prefetch_bucket_size, cfg.param_persistence_threshold) == (d.PREFETCH_BUCKET, d.PERSISTENCE_THRESHOLD)
    assert (cfg.max_live_parameters, cfg.max_reuse_distance) == (d.MAX_LIVE, d.MAX_REUSE)
    assert zero.get("overlap_comm") is True and zero.get("contiguous_gradients") is True


def test_cpu_adam_host_bytes_per_parameter():
    """deepspeed 0.19.8 ops/csrc/includes/cpu_adam.h Step_AVX: four fp32 vector loads (grad, exp_avg, exp_avg_sq, param)
    and three stores (param, exp_avg, exp_avg_sq) per element, fp32 moments by default (ops/adam/cpu_adam.py
    fp32_optimizer_states=True); runtime/zero/stage3.py's offloaded step also scales the fp32 gradient in place
    (unscale_and_clip_grads: grad.mul_) and copies the fp32 partition into the 16-bit one
    (_reassign_or_swap_out_partitioned_parameters: .data.copy_). deepspeed_memory.CPU_ADAM_HOST_BYTES counts them, plus the
    gradient's arrival from the GPU."""
    header = _source("deepspeed", "ops/csrc/includes/cpu_adam.h")
    body = header[header.index("void Adam_Optimizer::Step_AVX") :]
    body = body[: body.index("*rounded_size = new_rounded_size;")]
    loads, stores = len(re.findall(r"simd_load<span>\(", body)), len(re.findall(r"simd_store<span>\(", body))
    assert (loads, stores) == (4, 3)
    assert "fp32_optimizer_states=True" in _source("deepspeed", "ops/adam/cpu_adam.py")
    stage3 = _source("deepspeed", "runtime/zero/stage3.py")
    assert "self.fp32_partitioned_groups_flat[sub_group_id].grad.mul_(1. / combined_scale)" in stage3
    assert "self.fp16_partitioned_groups_flat[sub_group_id].data.copy_(" in stage3
    assert deepspeed_memory.CPU_ADAM_HOST_BYTES == (loads + stores) * 4 + 8 + (4 + 2) + 4


def test_launchers_give_each_rank_one_openmp_thread():
    """CPU Adam's OpenMP loop runs on as many threads as the rank's OMP_NUM_THREADS: torch 2.13
    torch/distributed/run.py sets it to 1 when a node runs more than one process and the variable is unset, and accelerate
    1.16 (commands/launch.py deepspeed_launcher) starts DeepSpeed jobs of one node through it, as seqpar launch does; the
    deepspeed launcher (deepspeed/launcher/launch.py) sets it only under --bind_cores_to_rank. One rank per node keeps
    every core."""
    run = _source("torch", "distributed/run.py")
    assert 'if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:' in run
    launch = _source("deepspeed", "launcher/launch.py")
    i = launch.index('current_env["OMP_NUM_THREADS"]')
    assert "if args.bind_cores_to_rank:" in launch[i - 300 : i]
    acc = _source("accelerate", "commands/launch.py")
    ds = acc[acc.index("def deepspeed_launcher") :]
    assert "_run_torchrun(args)" in ds[: ds.index("\ndef ")]


# ---- TRL's loss path


def _saved_by_fused_head(n, h, v):
    from trl.kernels import ChunkedLogProbFunction

    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out = ChunkedLogProbFunction.apply(
            hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("log_probs", "entropy", "is_top1")
        )
    logprobs, entropy, _, _, is_top1 = out
    (-logprobs.sum()).backward()
    return saved, entropy, is_top1, hidden.grad, weight.grad


@pytest.mark.slow  # TRL's kernel run forward and backward (about 5 s)
def test_trl_sft_metrics_keep_no_logits():
    """trl 1.16 trainer/sft_trainer.py patches the model with add_fused_lm_head(outputs=("log_probs", "entropy",
    "is_top1")) and logs entropy and mean_token_accuracy from those per-token outputs; trl/kernels/chunked_logprob.py
    ChunkedLogProbFunction projects (4096, 32768) tiles, saves the hidden states, the head, the targets and two fp32
    per-token vectors: no (tokens, vocabulary) tensor outlives the loss. The cost model's TRL loss (memory._loss_bytes
    path "trl") has no term that grows with tokens x vocabulary beyond one tile."""
    sft = _source("trl", "trainer/sft_trainer.py")
    assert 'outputs=("log_probs", "entropy", "is_top1"),' in sft
    assert "outputs.entropy.detach().sum()" in sft and "outputs.is_top1.sum()" in sft
    n, h, v = 96, 16, 320
    saved, entropy, is_top1, gh, gw = _saved_by_fused_head(n, h, v)
    assert all(s != (n, v) for s in saved)
    assert sorted(saved) == sorted([(n, h), (v, h), (n,), (n,), (n,)])  # hidden, head, targets, log_z, entropy
    assert entropy.shape == is_top1.shape == (n,) and gh.shape == (n, h) and gw.shape == (v, h)
    s = Strategy(mode="data_parallel", dp_degree=8, loss_impl="hf")
    c = load_coefficients()
    small, big = (_loss_bytes(M8, "bf16", s, t, c, 2, "trl", 2) for t in (65536.0, 131072.0))
    h8 = M8.hidden_size
    # per token: the compacted hidden copy (bf16), its fp32 gradient and that gradient's bf16 cast, log_z and entropy
    grows = sum(big[k] - small[k] for k in big if k != "final_norm") / 65536
    assert grows == 2 * h8 + (4 + 2) * h8 + 8
    assert big["loss_chunk"] == 4096 * 32768 * 2 + 8 * 131072.0
    assert big["head_grad_fp32"] == M8.vocab_size * h8 * (4 + 2)


def test_trl_loss_is_smaller_than_seqpars_chunk_at_a_large_vocabulary():
    """At a 128K vocabulary, seqpar's chunked loss holds a (4096, V) chunk in three dtypes; TRL's fused head one
    (4096, 32768) tile in bf16: the TRL target's loss peak is the lower one."""
    s = Strategy(mode="data_parallel", dp_degree=8, loss_impl="chunked")
    c = load_coefficients()
    ours, trls = (sum(_loss_bytes(M8, "bf16", s, 32768.0, c, 2, path, 2).values()) for path in ("seqpar", "trl"))
    assert trls < ours


def test_h100_cluster_profile_links():
    cl = cluster_from_flags("h100-sxm", 8, 2)
    assert (cl.intra_node_link.kind, cl.inter_node_link.kind) == ("nvlink4", "ib_ndr")
