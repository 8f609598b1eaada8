"""DeepSpeed ALST's one-GPU recipe as data and arithmetic, shared by bench/alst_h200.py (the driver) and
bench/alst_worker.py (the torch side): the recipes and their edits, the DeepSpeed config ArcticTraining builds from them,
the host memory they need, the loss tiles, a finished run's row and a failed run's kind. Pure Python: no torch.
"""

from __future__ import annotations

import math

from single_gpu import H200_DATASHEET_TFLOPS, H200_MATMUL_TFLOPS

HOST_OVERHEAD_GIB = 6.0  # CUDA context, torch/DeepSpeed/Liger libraries, DeepSpeed's pinned staging buffers: an estimate
ALLOC_CONF = "expandable_segments:True"  # ArcticTraining's README, projects/sequence-parallelism

RECIPES = {
    "published": {"master": "fp32", "offload_param": True, "ckpt_offload": True, "tiled_mlp": True, "loss": "liger"},
    "alst-bf16": {"master": "bf16", "offload_param": True, "ckpt_offload": True, "tiled_mlp": True, "loss": "liger"},
}


def settings(recipe: str, overrides: dict) -> dict:
    """The row's full recipe: the named one, edited by the command's flags (each edit stays visible in the row)."""
    s = {**RECIPES[recipe], **{k: v for k, v in overrides.items() if v is not None}, "recipe": recipe}
    s.update(zero_stage=3, offload_optimizer="cpu", optimizer="DeepSpeedCPUAdam", lr=1e-5, betas=[0.9, 0.999],
             weight_decay=0.1, gradient_clipping=1.0, micro_batch=1, sequence_parallel_size=1, alloc_conf=ALLOC_CONF,
             edits=sorted(k for k, v in overrides.items() if v is not None and RECIPES[recipe].get(k) != v))  # fmt: skip
    return s


def ds_config(s: dict) -> dict:
    """The DeepSpeed config ArcticTraining builds from the recipe's YAML (config/trainer.py build_deepspeed_config)."""
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    if s["offload_param"]:
        zero["offload_param"] = {"device": "cpu"}
    bf16 = {"enabled": True}
    if s["master"] == "bf16":  # DeepSpeed's own switches; they need DeepSpeedCPUAdam(fp32_optimizer_states=False)
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        "seq_parallel_communication_data_type": "bf16",
        "bf16": bf16,
        "gradient_clipping": s["gradient_clipping"],
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


def host_need_gib(num_params: int, spec: dict, s: dict, seq_len: int) -> dict:
    """Host memory of the recipe from first principles (DeepSpeed 0.19.8 runtime/zero/stage3.py with offload_optimizer):
    master weights (4 or 2 bytes/param), Adam's two moments (8 or 4), the master-precision gradient buffers every sub-group
    keeps as .grad (4 or 2), the gradient-accumulation partitions in the model dtype (2), and with offload_param the bf16
    parameters themselves (2, pinned). Then the offloaded checkpoints: every checkpointed layer's input, (S, hidden) bf16,
    but the last (DeepSpeed's keep_last_count=1 leaves it on the GPU)."""
    wide = 4 if s["master"] == "fp32" else 2
    per_param = wide + 2 * wide + wide + 2 + (2 if s["offload_param"] else 0)
    states = num_params * per_param / 2**30
    ckpt = (spec["num_layers"] - 1) * seq_len * spec["hidden_size"] * 2 / 2**30 if s["ckpt_offload"] else 0.0
    return {"bytes_per_param": per_param, "states_gib": states, "ckpt_offload_gib": ckpt,
            "total_gib": states + ckpt + HOST_OVERHEAD_GIB}  # fmt: skip


def loss_shards(seq_len: int, vocab: int) -> int:
    """TiledFusedLogitsLoss tiles of about 1 GiB of fp32 logits each (ArcticTraining sft_trainer.py's choice)."""
    return max(1, math.ceil(seq_len * vocab * 4 / 2**30))


def outcome(returncode: int, tail: str) -> dict:
    """GPU OOM (torch's OutOfMemoryError), host OOM (the kernel's SIGKILL, the CPU allocator's refusal, or a failed
    pinned allocation: CUDA reports that as "CUDA error: out of memory" with pin_memory in the traceback), other failure."""
    low = tail.lower()
    pinned = "out of memory" in low and "pin" in low and "outofmemoryerror" not in low
    host = returncode in (-9, 137) or "defaultcpuallocator" in low or "cannot allocate memory" in low or pinned
    gpu = not host and ("out of memory" in low or "outofmemoryerror" in low)
    return {"ok": False, "oom": host or gpu, "oom_kind": "host" if host else "gpu" if gpu else None, "error": tail[-1500:]}


def make_row(seq_len: int, model: str, s: dict, losses: list, all_times: list, warmup: int, init_s: float, flops: float,
             mem: dict) -> dict:  # fmt: skip
    """A finished run's row, in bench/single_gpu.py's fields: tokens/s of the steps after ``warmup`` (median step; the
    first step when warmup is 0), MFU of the model FLOPs (seqpar.plan.flops; recompute not counted), GPU peaks from
    torch.cuda, host peaks, the first step's time and the settings it ran with."""
    times = all_times[warmup:] or all_times[-1:]
    t = sorted(times)[len(times) // 2]
    return {"variant": "alst", "model": model, "seq_len": seq_len, "optimizer": f"deepspeed-cpu-adam-{s['master']}",
            "settings": s, "ok": True, "oom": False, "loss": losses[-1], "losses": losses, "step_times_s": times,
            "all_step_times_s": all_times, "step_time_s": t, "tokens_per_s": seq_len / t, "first_step_s": all_times[0],
            "init_s": init_s,
            "mfu_datasheet": flops / t / (H200_DATASHEET_TFLOPS * 1e12),
            "mfu_matmul_ceiling": flops / t / (H200_MATMUL_TFLOPS * 1e12), **mem}  # fmt: skip
