"""The torch side of bench/alst_h200.py: one length of the ALST recipe in this process, one ``RESULT {json}`` line on stdout.

Order as ArcticTraining's trainer has it: tiled MLP patched into the model class, then Liger's kernels (SwiGLU off when
the MLP is tiled), the model built (random weights: the shape is all a benchmark needs), activation checkpointing, the
optimizer, ``deepspeed.initialize`` (ZeRO-3 partitions and offloads what the config says). A step is forward + backward
inside DeepSpeed's checkpoint-offload context, then the engine's step (the CPU Adam on the host). One rank, one GPU
(or the CPU with gloo, for the tests).
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import sys
import threading
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict

from alst_recipe import ds_config, host_need_gib, loss_shards, make_row, outcome, settings
from single_gpu import hf_config, shape_spec


def _mlp(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def tiled_mlp_forward(self, x):
    """LlamaMLP.forward through DeepSpeed's TiledMLP: ceil(S / hidden) tiles (the recipe's count), weights named for ZeRO-3.
    One rank here: with more, all ranks would have to agree on the count (ZeRO-3 gathers the weights tile by tile)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiles = math.ceil(x.shape[-2] / x.shape[-1])
    return TiledMLP.apply(_mlp, self, x, tiles, [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight])


def _loss_sum(model, x, y):
    logits = model.lm_head(x).float()  # (n, V): one tile's logits, the only ones that exist at a time
    import torch.nn.functional as F

    return F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")


def compute_loss(engine, ids, s: dict, shards: int):
    """Liger's fused linear cross-entropy (or HF's loss) inside the model's forward; or, for --loss tiled, the trainer's
    loss without Liger at sp > 1 (at sp = 1 it takes HF's): the decoder's hidden states, then DeepSpeed's
    TiledFusedLogitsLoss over the LM head."""
    if s["loss"] != "tiled":
        return engine(input_ids=ids, labels=ids, use_cache=False).loss
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # (1, S): next token, none for the last
    hidden = engine.module.model(input_ids=ids, use_cache=False).last_hidden_state  # (1, S, hidden)
    total = TiledFusedLogitsLoss.apply(
        _loss_sum, engine.module, hidden, shift, None, shards, [engine.module.lm_head.weight], "sum"
    )
    return total / (shift != -100).sum()


def build_model(spec: dict, s: dict, device: str):
    import torch
    import transformers
    from transformers.models.llama import modeling_llama

    if s["tiled_mlp"]:
        modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    if s["loss"] == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=not s["tiled_mlp"], cross_entropy=False,
                                    fused_linear_cross_entropy=True)  # fmt: skip
    cfg = hf_config(spec)
    cfg._attn_implementation = s["attn"]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # transformers 5's default
    model.train()
    return model


def cpu_adam(model, s: dict):
    """ArcticTraining's groups (optimizer/adam_factory.py): weight decay except on biases and norms."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    no_decay = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if not any(k in n.lower() for k in no_decay)], "weight_decay": s["weight_decay"]},
        {"params": [p for n, p in named if any(k in n.lower() for k in no_decay)], "weight_decay": 0.0},
    ]
    return DeepSpeedCPUAdam(groups, lr=s["lr"], betas=tuple(s["betas"]), fp32_optimizer_states=s["master"] == "fp32")


class HostPeak(threading.Thread):
    """Samples the process's resident memory and the machine's used memory (total - available) every 0.2 s: offloaded
    states and checkpoints are pinned host memory, which the GPU's counters never see."""

    def __init__(self):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.psutil, self.rss, self.used, self.stop = psutil.Process(), psutil, 0, 0, threading.Event()

    def run(self):
        while not self.stop.wait(0.2):
            vm = self.psutil.virtual_memory()
            self.rss, self.used = max(self.rss, self.proc.memory_info().rss), max(self.used, vm.total - vm.available)

    def result(self) -> dict:
        self.stop.set()
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return {"host_peak_rss_gib": max(self.rss, ru) / 2**30, "host_used_peak_gib": self.used / 2**30}


def _init_dist() -> None:
    import deepspeed

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # always one rank on a fresh port: a MASTER_PORT inherited from a caller (a test process) must not be shared
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(verbose=False)


def pick_attn(name: str) -> str:
    import importlib.util

    if name != "auto":
        return name
    return next((impl for mod, impl in (("flash_attn_interface", "flash_attention_3"), ("flash_attn", "flash_attention_2"))
                 if importlib.util.find_spec(mod)), "sdpa")  # fmt: skip


def run_alst(spec: dict, s: dict, seq_len: int, steps: int, warmup: int, shards: int) -> dict:
    import deepspeed
    import torch
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    from seqpar.plan.flops import model_flops_per_sequence
    from seqpar.plan.specs import ModelSpec

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    host = HostPeak()
    host.start()
    t0 = time.perf_counter()
    _init_dist()
    model = build_model(spec, s, dev)
    engine, *_ = deepspeed.initialize(model=model, optimizer=cpu_adam(model, s), config=ds_config(s))
    del model
    offload = get_checkpoint_hidden_states_offloading_ctx_manager() if s["ckpt_offload"] else None
    ids = torch.randint(0, spec["vocab_size"], (1, seq_len), device=dev, generator=torch.Generator(dev).manual_seed(1))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    init_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(warmup + steps):
        t = time.perf_counter()
        with offload if offload is not None else nullcontext():
            loss = compute_loss(engine, ids, s, shards)
            engine.backward(loss)
        engine.step()
        sync()
        dt = time.perf_counter() - t
        losses.append(float(loss.detach()))
        times.append(dt)
    mem = host.result()
    if cuda:
        mem.update(peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
                   reserved_memory_gib=torch.cuda.max_memory_reserved() / 2**30, gpu=torch.cuda.get_device_name())  # fmt: skip
    if offload is not None:
        mem["ckpt_offload_stats"] = asdict(offload.stats)
    mem["versions"] = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                       "transformers": __import__("transformers").__version__}  # fmt: skip
    model_spec = ModelSpec.model_validate(spec)
    flops = model_flops_per_sequence(model_spec, seq_len)
    return make_row(seq_len, model_spec.name, s, losses, times, warmup, init_s, flops, mem)


def worker(args) -> None:
    spec = json.loads(args.spec_json) if args.spec_json else shape_spec(args.shape)
    overrides = {"offload_param": args.offload_param, "ckpt_offload": args.ckpt_offload, "tiled_mlp": args.tiled_mlp,
                 "loss": args.loss}  # fmt: skip
    s = {**settings(args.recipe, overrides), "attn": pick_attn(args.attn)}
    shards = args.loss_shards or loss_shards(args.seq_len, spec["vocab_size"])
    if s["loss"] == "tiled":
        s["loss_shards"] = shards
    try:
        row = run_alst(spec, s, args.seq_len, args.steps, args.warmup, shards)
    except Exception:  # an OOM is a result here, not a failure of the bench
        row = {"variant": "alst", "seq_len": args.seq_len, "settings": s, **outcome(1, traceback.format_exc()[-3000:])}
        import torch

        if torch.cuda.is_available():  # how far it got: the GPU's peak before the failure
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    from seqpar.plan.specs import ModelSpec

    row["predicted_host"] = host_need_gib(ModelSpec.model_validate(spec).num_params, spec, s, args.seq_len)
    print("RESULT " + json.dumps(row), flush=True)
    sys.stderr.flush()
    # The row is out: skip the interpreter's teardown (tens of GiB of pinned host memory to unpin, NCCL's group, the CUDA
    # context), which only costs the next length its start.
    os._exit(0)
