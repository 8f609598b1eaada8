"""Process groups, the loss module, and the engines that wrap it (DDP, FSDP2, DeepSpeed ZeRO through accelerate).

World = dp_degree x sp_degree ranks; a sequence-parallel group is ``sp_degree`` consecutive ranks (global rank =
dp_rank * sp_degree + sp_rank), so on a multi-GPU node the ranks that exchange K/V every layer share the fastest link.

Gradient math. Each sequence-parallel rank computes the *global* mean loss of its group's sequence (``seqpar.loss``
all-reduces the sums), and its backward produces that rank's share of the gradient: the full gradient of the group's
loss is the SUM of its ranks' gradients. The update must equal the single-process one on the same global batch, whose
gradient is the MEAN over data-parallel groups. Every engine here averages gradients over the whole world (DDP's all-reduce,
FSDP2's reduce-scatter, DeepSpeed's data-parallel average), i.e. divides by dp * sp; scaling each rank's loss by sp_degree
turns that average into "sum over sp, mean over dp":  (sp / (dp * sp)) * sum_ranks g_r = (1/dp) * sum_dp sum_sp g.
Gradient accumulation divides by the number of micro-batches, as a single process summing its micro-batch means would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from seqpar.plan.env import env_value_problem
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.runtime.parallel.loss import loss, loss_from_hidden


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    sp_degree: int
    dp_degree: int
    device: torch.device
    sp_group: object  # the ProcessGroup of this rank's sequence-parallel group (size 1 for data_parallel)

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_degree

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_degree


def init_distributed(plan: LaunchPlan) -> Topology:
    """Join (or reuse) the default process group and build the sequence-parallel groups; checks the world matches the plan."""
    cpu = plan.cluster.accelerator == "cpu"
    if not cpu and not torch.cuda.is_available():
        raise SeqparError(
            "the plan's cluster is accelerator 'cuda' but torch sees no CUDA device; run on the GPU machine or use a --cluster cpu:N plan"
        )
    if not cpu:  # before the NCCL communicator exists, so it binds to this rank's GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # A short timeout bounds a collective left hanging by a dead or stopped peer; the sp groups get it too (new_group's
    # own default is 30 min for gloo).
    raw = os.environ.get("SEQPAR_PG_TIMEOUT_S", "120" if cpu else "600")
    problem = env_value_problem("SEQPAR_PG_TIMEOUT_S", raw)  # the launcher refuses it first; a rank started by hand too
    if problem:
        raise SeqparError(f"the environment's {problem}")
    timeout = timedelta(seconds=float(raw))
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m seqpar.runtime.train`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo" if cpu else "nccl", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    s = plan.strategy
    if world != s.world_size:
        raise SeqparError(
            f"the job has {world} ranks but the plan needs sp_degree {s.sp_degree} x dp_degree {s.dp_degree} = {s.world_size}; "
            f"launch it with `seqpar launch`, which starts the right number"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank)
    # new_group is collective: every rank creates every group, in the same order.
    mine = None
    for g in range(s.dp_degree):
        group = dist.new_group(list(range(g * s.sp_degree, (g + 1) * s.sp_degree)), timeout=timeout)
        if g == rank // s.sp_degree:
            mine = group
    return Topology(rank, world, local_rank, s.sp_degree, s.dp_degree, device, mine)


def shutdown() -> None:
    """Free the engine and its process groups while the interpreter is whole, all ranks together.

    DDP, the attention context and the modules hold process groups in reference cycles, and importing transformers pins
    the default group (module-level default arguments), so destroy_process_group does not end gloo's worker threads.
    A worker still holding a finished collective's tensors frees them later, under the GIL; at the interpreter's
    teardown that aborts the process ("terminate called without an active exception"). So: the barrier (every rank's
    collectives done), the heartbeat stopped (its thread must not be inside the store's client then either), then
    ``settle`` (the workers free what they hold, this barrier's own work included), and the same after destroying the
    groups."""
    from seqpar.runtime.launch.stopping import settle
    from seqpar.runtime.train import liveness

    settle(0)
    if dist.is_initialized():
        dist.barrier()  # a peer that failed shows here, while the heartbeat can still name it
    liveness.stop()
    settle()
    if dist.is_initialized():
        dist.destroy_process_group()
        settle()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LossModule(nn.Module):
    """The HF model plus its loss: forward(input_ids, position_ids, labels, cu_seqlens=None) -> this group's global mean loss.

    One module so that the engines see a single forward (DDP prepares its reducer there, FSDP2 unshards the root's
    embedding/norm/lm_head there) also when the chunked loss bypasses the model's own head. cu_seqlens: a packed batch's
    global document boundaries (seqpar.prepare_inputs' "cu_seqlens"), passed to the model under transformers' own names,
    which reach seqpar's attention function (seqpar.runtime.hf.documents).
    """

    def __init__(self, model: nn.Module, loss_impl: str, group, chunk_size: int = 4096):
        super().__init__()
        self.model, self.loss_impl, self.group, self.chunk_size = model, loss_impl, group, chunk_size

    def forward(self, input_ids, position_ids, labels, cu_seqlens=None):
        docs = {} if cu_seqlens is None else {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens}
        if self.loss_impl == "chunked":
            hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids, **docs).last_hidden_state  # (B, s, h)
            head = self.model.get_output_embeddings().weight  # (V, h)
            return loss_from_hidden(hidden, head, labels, self.group, self.chunk_size)
        logits = self.model(input_ids=input_ids, position_ids=position_ids, **docs).logits  # (B, s, V)
        return loss(logits.float(), labels, self.group)


def wrap(module: LossModule, plan: LaunchPlan, topo: Topology, *, cpu_offload: bool = False) -> nn.Module:
    """The engine named by plan.strategy.sharding around the loss module (already on its device and dtype)."""
    sharding = plan.strategy.sharding
    if sharding == "ddp":
        if topo.world_size == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [topo.local_rank] if topo.device.type == "cuda" else None
        return DDP(module, device_ids=ids)
    if sharding == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh(topo.device.type, (topo.world_size,))
        # LoRA: a 16-bit frozen base beside fp32 adapters; FSDP2 all-gathers one dtype, so both compute in bf16
        lora = plan.workload.lora is not None
        mixed = plan.workload.dtype == "bf16" and (plan.workload.optimizer == "adamw" or lora) and topo.device.type == "cuda"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        off = CPUOffloadPolicy() if cpu_offload and topo.device.type == "cuda" else OffloadPolicy()
        for layer in module.model.base_model.layers:  # one all-gather per decoder layer
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=off)
        fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=off)
        return module
    raise SeqparError(
        f"sharding {sharding!r} runs on DeepSpeed; the trainer builds it with seqpar.runtime.train.deepspeed.prepare"
    )


def no_sync(wrapped: nn.Module, sync: bool):
    """Context that skips the gradient reduction on all but the last micro-batch of an accumulation."""
    import contextlib

    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(wrapped, "no_sync"):  # DDP
        return wrapped.no_sync()
    return contextlib.nullcontext()


def make_optimizer(module: nn.Module, plan: LaunchPlan):
    """AdamW over the (possibly sharded) parameters, its states allocated (allocate_states), or None for optimizer
    'none' (forward + backward only)."""
    if plan.workload.optimizer == "none":
        return None
    t = plan.training
    # foreach=False keeps the update order identical for sharded and whole parameters (bit-stable comparisons).
    optimizer = torch.optim.AdamW(trainable(module), lr=t.learning_rate, weight_decay=t.weight_decay, foreach=False)
    allocate_states(optimizer)
    return optimizer


def trainable(module: nn.Module) -> list:
    """The parameters the optimizer updates: all of them, or under LoRA the adapters alone (peft froze the base)."""
    return [p for p in module.parameters() if p.requires_grad]


def allocate_states(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's states (AdamW's two moments) allocated now instead of inside the first step(): torch creates them
    lazily, after the first backward, so the first forward and backward run without them and only the second step's
    peak is the plan's (a plan that does not fit would fail one step late, and one step would under-measure memory).
    DeepSpeed's ZeRO optimizers do the same at start-up. torch's own initialiser does it, the one its checkpoint loader
    (set_optimizer_state_dict, which seqpar.runtime.checkpoint.shards's resume calls) runs: one step() with zero gradients at
    lr 0, which leaves every parameter unchanged bit for bit (AdamW: p * (1 - 0 * wd) + -0 * m / (sqrt(v) + eps), with
    m = v = 0), then lr put back and the gradients dropped. It leaves the step counters at 1; they go back to 0, so the
    first real update is the one a fresh optimizer makes. Nothing happens when states exist."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    if optimizer.state:
        return
    _init_optim_state(optimizer)
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def make_scheduler(optimizer, plan: LaunchPlan, total_steps: int):
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    if optimizer is None:
        return None
    t = plan.training
    if t.lr_schedule == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, t.warmup_steps, total_steps)
    return get_constant_schedule_with_warmup(optimizer, t.warmup_steps)


def compute_dtype(plan: LaunchPlan, device: torch.device) -> tuple[torch.dtype, torch.dtype | None, str]:
    """(parameter dtype, autocast dtype or None, reason): bf16 needs CUDA here; fp32 on CPU keeps comparisons exact."""
    want = plan.workload.dtype
    if device.type != "cuda":
        return torch.float32, None, f"fp32 on CPU (plan asks {want}; CPU runs are for checks, kept exact)"
    if want == "fp32":
        return torch.float32, None, "fp32 as the plan asks"
    low = torch.bfloat16 if want == "bf16" else torch.float16
    if plan.workload.optimizer == "adamw-bf16":
        return low, None, f"{want} parameters and moments, no fp32 master (optimizer adamw-bf16)"
    if plan.workload.optimizer == "none":  # forward+backward only: no update, so no master copy to keep
        return low, None, f"{want} parameters and gradients (optimizer none: nothing to keep in fp32)"
    if plan.workload.lora is not None:  # the frozen base needs no fp32 master; peft keeps the adapters in fp32
        if plan.strategy.sharding == "fsdp":
            return low, None, f"{want} frozen base, fp32 adapters, FSDP2 computes in {want}"
        return low, low, f"{want} frozen base, fp32 adapters, autocast to {want}"
    if plan.strategy.sharding == "fsdp":
        return torch.float32, None, f"fp32 master parameters, FSDP2 computes in {want}"
    return torch.float32, low, f"fp32 master parameters, autocast to {want}"
