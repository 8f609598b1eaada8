"""Which strategies a workload can run on a cluster, judged once: ``plan_problems``. LaunchPlan raises its first problem
and the advisor's search filters with it, so the advisor cannot propose a plan the schema refuses. Also the layer split
a strategy describes and how it is said.
"""

from __future__ import annotations

from typing import Optional

from seqpar.plan.errors import SeqparError
from seqpar.plan.options import LayerSplit, layer_split
from seqpar.plan.specs import ClusterSpec, ModelSpec, Strategy, Workload, check_strategy_shape
from seqpar.plan.units import divisors

ZERO3 = ("zero3", "zero3_offload")  # ZeRO-3: parameters gathered by module hooks


def layout_problems(strategy: Strategy, seq_len: int, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """Why the strategy's ranks and split cannot hold seq_len tokens of ``model`` on ``cluster`` (empty = they can):
    the world size, then the mode's sequence split and head split (seqpar.plan.modes)."""
    s, c, out = strategy, cluster, []
    if s.world_size != c.world_size:
        if c.world_size % s.sp_degree:
            out.append(
                f"sp_degree {s.sp_degree} does not divide the {c.world_size} ranks of the cluster ({c.nodes} x "
                f"{c.gpus_per_node}), so no dp_degree fills it; use an sp_degree in {divisors(c.world_size)}"
            )
        else:
            out.append(
                f"sp_degree {s.sp_degree} x dp_degree {s.dp_degree} = {s.world_size} ranks, but the cluster has "
                f"{c.nodes} x {c.gpus_per_node} = {c.world_size}; make them equal"
            )
    try:
        check_strategy_shape(s, seq_len, model)
    except SeqparError as e:
        out.append(str(e))
    if model.sliding_window is not None and seq_len > model.sliding_window:
        out.append(
            f"{model.name} attends within a sliding window of {model.sliding_window} tokens (its config.json), shorter than "
            f"seq_len {seq_len}; seqpar's modes compute full causal attention, which would change the model: train at most "
            f"{model.sliding_window} tokens, or set sliding_window to null in its config.json for full attention"
        )
    return out


def option_problems(workload: Workload, cluster: ClusterSpec, strategy: Strategy) -> list[str]:
    """Why the strategy's options (sharding, fused ops, the checkpointing split, tiled MLP) cannot train this workload on
    this cluster: the engines behind them (seqpar.runtime.train.engine and deepspeed.py, fused.py, activation_checkpoint.py,
    tiled_mlp.py) refuse the combination."""
    s, c, w, out = strategy, cluster, workload, []
    cuda, zero = c.accelerator == "cuda", s.sharding.startswith("zero")  # zero* runs DeepSpeed on CUDA and CPU ranks
    if zero and w.optimizer != "adamw":
        out.append(
            f"sharding {s.sharding} runs DeepSpeed's AdamW with an fp32 master copy, so optimizer {w.optimizer} cannot "
            f"run there; use sharding fsdp (or ddp), or optimizer adamw"
        )
    if cuda and w.dtype == "fp16" and not zero:
        fix = (
            "use dtype bf16, or a zero* sharding"
            if w.optimizer == "adamw"
            else f"use dtype bf16 (zero* shardings run AdamW only, not optimizer {w.optimizer})"
        )
        out.append(
            f"dtype fp16 needs a zero* sharding (fp16 needs DeepSpeed's loss scaling), so sharding {s.sharding} would "
            f"train without loss scaling; {fix}"
        )
    if s.fused_ops == "liger" and not cuda:
        out.append(
            f"fused_ops liger runs Triton kernels on CUDA GPUs (Liger-Kernel), but the cluster's accelerator is "
            f"{c.accelerator}; use fused_ops none"
        )
    out += split_problems(
        s.checkpointing, s.checkpoint_layers, s.offload_layers, w.model.num_layers, w.model.name, s.offload_stride
    )
    out += kept_problems(
        s.checkpointing,
        s.checkpoint_layers,
        s.offload_layers,
        s.kept_saves,
        s.kept_host_layers,
        s.tiled_mlp,
        w.model.num_layers,
        w.model.name,
        cuda,
    )
    if s.tiled_mlp and s.sharding in ZERO3:
        out.append(
            f"tiled_mlp with sharding {s.sharding}: ZeRO-3 gathers parameters through module hooks that the tiles' "
            "recomputation in backward bypasses; use sharding fsdp or ddp, or tiled_mlp false"
        )
    return out + lora_problems(workload, strategy)


def lora_problems(workload: Workload, strategy: Strategy) -> list[str]:
    """Why the strategy cannot train the workload's LoRA adapters (seqpar.runtime.hf.lora): a 4-bit base is kept whole
    on every rank, and tiled MLPs recompute their tiles, which would draw new adapter dropout masks."""
    lora, s, out = workload.lora, strategy, []
    if lora is None:
        return out
    if lora.base_dtype == "nf4" and s.sharding != "ddp":
        out.append(
            f"lora base_dtype nf4 keeps the 4-bit base whole on every rank (bitsandbytes' packed weights are not "
            f"sharded by FSDP2 or DeepSpeed here), so sharding {s.sharding} has nothing to shard but the adapters; use "
            "sharding ddp, or base_dtype bf16"
        )
    mlp = [m for m in lora.target_modules if m in ("gate_proj", "up_proj", "down_proj")]
    if s.tiled_mlp and lora.dropout > 0 and mlp:
        out.append(
            f"tiled_mlp with lora dropout {lora.dropout:g} on {' '.join(mlp)}: the tiles' recomputation in backward "
            "would draw new dropout masks; set lora dropout 0, target no MLP layer, or tiled_mlp false"
        )
    return out


def kept_problems(
    checkpointing: str,
    checkpoint_layers: Optional[int],
    offload_layers: Optional[int],
    kept_saves: str,
    kept_host_layers: int,
    tiled_mlp: bool,
    num_layers: int,
    owner: str,
    cuda: bool = True,
) -> list[str]:
    """Why kept_saves / kept_host_layers cannot apply to the kept layers (the ones past checkpoint_layers) of ``owner``'s
    ``num_layers`` decoder layers (empty = they can). The plan (option_problems) and seqpar.apply both ask it."""
    out = []
    kept = layer_split(checkpointing, num_layers, checkpoint_layers, offload_layers).kept
    if kept_saves == "matmuls":
        if checkpointing == "none" or kept == 0:
            why = "checkpointing is none" if checkpointing == "none" else f"checkpoint_layers covers every layer of {owner}"
            out.append(
                f"kept_saves matmuls applies to the layers past checkpoint_layers, but there are none ({why}); set "
                f"checkpoint_layers below {num_layers} with checkpointing full, selective or offload, or kept_saves all"
            )
        if tiled_mlp:
            out.append(
                "kept_saves matmuls with tiled_mlp: the tiled MLP recomputes its own tiles, so its matmul outputs cannot "
                "be kept; use tiled_mlp false, or kept_saves all"
            )
    if kept_host_layers:
        if kept_saves != "matmuls":
            out.append(
                f"kept_host_layers {kept_host_layers} sends kept matmul outputs to host memory, but kept_saves is "
                f"{kept_saves}; set kept_saves matmuls, or kept_host_layers 0"
            )
        elif kept_host_layers > kept:
            out.append(f"kept_host_layers {kept_host_layers} is more than the {kept} kept layers; use at most {kept}")
        if not cuda:
            out.append(
                f"kept_host_layers {kept_host_layers} copies through page-locked memory on a CUDA GPU, but the cluster "
                "has none; use kept_host_layers 0"
            )
    return out


def layers_of(strategy: Strategy, num_layers: int) -> LayerSplit:
    """The plan's seqpar.plan.options.LayerSplit over ``num_layers`` decoder layers."""
    s = strategy
    return layer_split(
        s.checkpointing, num_layers, s.checkpoint_layers, s.offload_layers, s.kept_saves, s.kept_host_layers, s.offload_stride
    )


def tiles_norms(strategy: Strategy) -> bool:
    """Whether seqpar's runtime runs the model's own RMSNorms in tiles (seqpar.runtime.memory.tiled_mlp.tile_norms):
    with a tiled MLP, where Liger's fused norms do not replace them. The cost model prices that runtime so
    (estimate_memory's and estimate_time's ``norms_tiled``)."""
    return strategy.tiled_mlp and strategy.fused_ops != "liger"


def checkpointed_layers(strategy: Strategy, num_layers: int) -> int:
    """How many decoder layers the checkpointing policy applies to (0 under none); the rest keep their activations."""
    return layers_of(strategy, num_layers).checkpointed


def offloaded_layers(strategy: Strategy, num_layers: int) -> int:
    """How many checkpointed layers send their input to host memory (0 unless checkpointing offload)."""
    return layers_of(strategy, num_layers).host


# The strategy fields that split the decoder layers between policies, at the values that mean "the policy on every
# layer, no split": a strategy updated with these is its whole-model twin (the advisor's search and fixes start there).
NO_SPLIT: dict = {
    "checkpoint_layers": None,
    "offload_layers": None,
    "offload_stride": 1,
    "kept_saves": "all",
    "kept_host_layers": 0,
}


def split_tag(strategy: Strategy) -> str:
    """The layer split in a strategy's one-line name, e.g. "[18 offloaded]", "[21 checkpointed]"; empty without one."""
    parts = [f"{strategy.offload_layers} offloaded"] if strategy.offload_layers is not None else []
    parts += [f"1 in {strategy.offload_stride} to host"] if strategy.offload_stride > 1 else []
    parts += [f"{strategy.checkpoint_layers} checkpointed"] if strategy.checkpoint_layers is not None else []
    if strategy.kept_saves != "all":
        parts += [f"kept {strategy.kept_saves}" + (f", {strategy.kept_host_layers} on host" if strategy.kept_host_layers else "")]
    return f"[{', '.join(parts)}]" if parts else ""


def _runs(layers: tuple[int, ...]) -> str:
    """(0, 2, 3, 4, 7) -> "layers 0, 2-4, 7"."""
    runs: list[list[int]] = []
    for j in layers:
        if runs and j == runs[-1][1] + 1:
            runs[-1][1] = j
        else:
            runs.append([j, j])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"layer{'s' if len(layers) > 1 else ''} {text}"


def checkpointing_text(strategy: Strategy, num_layers: int) -> str:
    """The policy and its split over the layers (0-based, as the model's layer list), e.g. "offload (layers 0-7: input
    in host memory; layers 8-23: input on the GPU; layers 24-31: not checkpointed)", or under kept_saves matmuls
    "selective (layers 0-14: checkpointed; layers 15-31: matmul outputs kept, in host memory for layers 15, 17, 19)",
    under an offload_stride "offload (layers 0-79: input of 1 in 2 in host memory (40), the others recomputed)"; the
    bare policy name when it applies to every layer alike."""
    s, n = strategy, num_layers
    ck, off, cut = checkpointed_layers(s, n), offloaded_layers(s, n), layers_of(s, n)
    whole = s.checkpointing != "offload" or (off == n and cut.stride == 1)
    if s.checkpointing == "none" or (ck == n and whole):
        return s.checkpointing

    def span(a: int, b: int) -> str:
        return f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}"

    if s.checkpointing == "offload":
        on_host = "input in host memory"
        if cut.stride > 1:
            on_host = f"input of 1 in {cut.stride} in host memory ({cut.host_inputs}), the others recomputed"
        parts = [f"{span(0, off)}: {on_host}"] if off else []
        parts += [f"{span(off, ck)}: input on the GPU"] if ck > off else []
    else:
        parts = [f"{span(0, ck)}: checkpointed"] if ck else []
    if cut.matmuls and cut.kept_host == cut.kept:
        parts += [f"{span(ck, n)}: matmul outputs kept in host memory"]
    elif cut.matmuls:
        host = f", in host memory for {_runs(cut.host_kept)}" if cut.kept_host else ""
        parts += [f"{span(ck, n)}: matmul outputs kept{host}"]
    else:
        parts += [f"{span(ck, n)}: not checkpointed"] if n > ck else []
    return f"{s.checkpointing} ({'; '.join(parts)})"


def split_problems(
    checkpointing: str,
    checkpoint_layers: Optional[int],
    offload_layers: Optional[int],
    num_layers: int,
    owner: str,
    offload_stride: int = 1,
) -> list[str]:
    """Why checkpoint_layers / offload_layers / offload_stride cannot split the ``num_layers`` decoder layers of
    ``owner`` under the ``checkpointing`` policy (empty = they can). The plan (option_problems) and seqpar.apply both
    ask it."""
    ck, off, n, out = checkpoint_layers, offload_layers, num_layers, []
    if ck is not None and checkpointing == "none":
        out.append(
            f"checkpoint_layers {ck} picks the layers that checkpointing applies to, but checkpointing is none; remove "
            "checkpoint_layers, or pick checkpointing full, selective or offload"
        )
    elif ck is not None and ck > n:
        out.append(
            f"checkpoint_layers {ck} is more than the {n} decoder layers of {owner}; use at most {n} ({n} or unset = every "
            "layer checkpointed)"
        )
    if off is not None and checkpointing != "offload":
        out.append(
            f"offload_layers {off} sends checkpointed layer inputs to host memory, which only checkpointing offload does, "
            f"but checkpointing is {checkpointing}; remove offload_layers, or use checkpointing offload"
        )
    elif off is not None and off > (kept := n if ck is None else min(ck, n)):
        why = f"checkpoint_layers {ck}" if ck is not None else f"every layer of {owner}"
        out.append(f"offload_layers {off} is more than the {kept} checkpointed layers ({why}); use at most {kept}")
    if offload_stride > 1:
        host = layer_split(checkpointing, n, ck, off).host if not out else 0
        if checkpointing != "offload":
            out.append(
                f"offload_stride {offload_stride} spaces the layer inputs sent to host memory, which only checkpointing "
                f"offload does, but checkpointing is {checkpointing}; remove offload_stride, or use checkpointing offload"
            )
        elif not out and offload_stride > host:
            out.append(
                f"offload_stride {offload_stride} is more than the {host} offloaded layers; use at most {host} (1 = every "
                "offloaded layer sends its own input)"
            )
    return out


def plan_problems(workload: Workload, cluster: ClusterSpec, strategy: Strategy) -> list[str]:
    """Every reason ``strategy`` cannot train ``workload`` on ``cluster``, one line each naming the value, the rule and a
    fix; empty when it can. The one judge of plan validity: LaunchPlan raises the first, the advisor's search drops a
    strategy with any and records the first as the reason, the rules and the request ask it too."""
    return layout_problems(strategy, workload.seq_len, workload.model, cluster) + option_problems(workload, cluster, strategy)
