"""What an emitted launch's prediction assumed, carried with its files so that ``seqpar check FILES`` needs no flags.

``--emit`` predicts one workload on one cluster with one strategy. The tool's own keys say much of it (the model, the
sequence length, the micro-batch, the ranks, the sharding, the mode); the rest (the GPU, the host RAM, what the user's
script does: its checkpointing and loss, the dtype of a DeepSpeed-less run, ...) has no key in that tool. Those go in a
``seqpar:`` block: YAML comment lines in a YAML config (accelerate 1.16's config loader and ArcticTraining 0.8's schema
refuse unknown keys, TRL 1.16's parser refuses unknown arguments; comments reach none of them), and a top-level
``"seqpar"`` key in a plain DeepSpeed JSON, which JSON cannot comment and DeepSpeed ignores (deepspeed 0.19.8
``runtime/config.py``: ``DeepSpeedConfig`` reads the keys it knows and refuses only removed ones; the test builds one).

The block holds exactly what the tool's keys do not say (``block``: the assumptions minus what the tool's own reader
reads back from the files), named as ``seqpar check``'s readings name their values. ``check`` takes each value from the
tool's keys, else the flags, else the block, else a default it names on a line of its own ("assumed: ...").
"""

from __future__ import annotations

import json
from typing import Optional

from pydantic import Field, ValidationError

from seqpar.plan.base import Checkpointing, DType, Frozen, FusedOps, KeptSaves, LinkKind, LossImpl, Mode, Optimizer, Sharding
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import Prediction
from seqpar.plan.rules import NO_SPLIT
from seqpar.plan.specs import ClusterSpec, DocMix, LoraSpec, Strategy, Workload

MARK = "# seqpar:"  # the line that opens the block in a YAML file; the block's lines follow it, each "#   key: value"
KEY = "seqpar"  # the block's key in a JSON file


class Assumed(Frozen):
    """One launch's assumptions, each optional (a user's block may hold any of them), named as check's values are."""

    model: Optional[str] = Field(default=None, description="Profile name, Hub id or config.json path of the model.")
    seq_len: Optional[int] = Field(default=None, ge=1, description="Tokens per sequence.")
    micro_batch_size: Optional[int] = Field(default=None, ge=1, description="Sequences per rank per forward pass.")
    dtype: Optional[DType] = Field(default=None, description="Parameter and activation dtype.")
    optimizer: Optional[Optimizer] = Field(default=None, description="Optimizer of the workload.")
    lora: Optional[LoraSpec] = Field(default=None, description="LoRA / QLoRA adapters; absent = full fine-tuning.")
    doc_lens: Optional[DocMix] = Field(default=None, description="Packed documents' length mix; absent = one per window.")
    gpu: Optional[str] = Field(default=None, description="GPU profile of every rank ('cpu' for gloo CPU ranks).")
    world_size: Optional[int] = Field(default=None, ge=1, description="Ranks in all (nodes x GPUs per node).")
    nodes: Optional[int] = Field(default=None, ge=1, description="Nodes.")
    host_ram_gib: Optional[float] = Field(default=None, gt=0, description="Host RAM per node, GiB.")
    pinned_host_gib: Optional[float] = Field(default=None, gt=0, description="Page-lockable host RAM per node, GiB.")
    intra_node_link: Optional[LinkKind] = Field(default=None, description="Link inside a node, where not the GPU's usual.")
    inter_node_link: Optional[LinkKind] = Field(default=None, description="Link between nodes, where not the GPU's usual.")
    mode: Optional[Mode] = Field(default=None, description="Sequence-parallel mode as seqpar predicts it.")
    sp_degree: Optional[int] = Field(default=None, ge=1, description="Ranks sharing one sequence.")
    sharding: Optional[Sharding] = Field(default=None, description="Model-state sharding.")
    checkpointing: Optional[Checkpointing] = Field(default=None, description="The script's activation checkpointing.")
    checkpoint_layers: Optional[int] = Field(default=None, ge=0, description="Layers checkpointed, from the first.")
    offload_layers: Optional[int] = Field(default=None, ge=0, description="Checkpointed layers whose input is offloaded.")
    kept_saves: Optional[KeptSaves] = Field(default=None, description="What the layers past checkpoint_layers keep.")
    kept_host_layers: Optional[int] = Field(default=None, ge=0, description="Kept layers holding matmul outputs on the host.")
    loss_impl: Optional[LossImpl] = Field(default=None, description="The script's loss implementation.")
    gradient_accumulation_steps: Optional[int] = Field(default=None, ge=1, description="Micro-batches per optimizer step.")
    fused_ops: Optional[FusedOps] = Field(default=None, description="The script's fused kernels.")
    tiled_mlp: Optional[bool] = Field(default=None, description="Whether the script tiles the MLP.")
    predicted_peak_memory_gib: Optional[float] = Field(
        default=None, ge=0, description="What --emit predicted: peak allocated GiB per GPU (not an assumption: a record)."
    )
    predicted_tokens_per_s: Optional[float] = Field(
        default=None, ge=0, description="What --emit predicted: tokens/s of the whole job (not an assumption: a record)."
    )


RECORDS = ("predicted_peak_memory_gib", "predicted_tokens_per_s")
CLUSTER = ("gpu", "world_size", "nodes", "host_ram_gib", "pinned_host_gib", "intra_node_link", "inter_node_link")
SPLIT = ("checkpoint_layers", "offload_layers", "kept_saves", "kept_host_layers")


def assumptions(w: Workload, cl: ClusterSpec, s: Strategy, p: Prediction) -> dict:
    """Everything the prediction ``p`` of ``s`` for ``w`` on ``cl`` rests on, in check's names (None values left out)."""
    from seqpar.advisor.cluster import cluster_from_flags

    out = {
        "model": w.model.name,
        "seq_len": w.seq_len,
        "micro_batch_size": w.micro_batch_size,
        "dtype": w.dtype,
        "optimizer": w.optimizer,
        "lora": w.lora.model_dump() if w.lora else None,
        "doc_lens": w.doc_lens.model_dump() if w.doc_lens else None,
        "gpu": cl.gpu.name,
        "world_size": cl.world_size,
        "nodes": cl.nodes,
        "host_ram_gib": cl.host_ram_gib,
        "pinned_host_gib": cl.pinned_host_gib,
    }
    if cl.accelerator == "cuda":  # a probed cluster's links may not be the GPU profile's usual ones
        usual = cluster_from_flags(cl.gpu.name, cl.gpus_per_node, cl.nodes, cl.host_ram_gib)
        for k in ("intra_node_link", "inter_node_link"):
            if getattr(cl, k) != getattr(usual, k):
                out[k] = getattr(cl, k).kind
    out |= {k: getattr(s, k) for k in ("mode", "sp_degree", "sharding", "checkpointing", "loss_impl")}
    out |= {k: getattr(s, k) for k in ("gradient_accumulation_steps", "fused_ops", "tiled_mlp")}
    out |= {k: getattr(s, k) for k in SPLIT if getattr(s, k) != NO_SPLIT[k]}  # the script's split, where it has one
    out |= {"predicted_peak_memory_gib": p.peak_memory_gib, "predicted_tokens_per_s": round(p.tokens_per_s, 1)}
    return {k: v for k, v in out.items() if v is not None}


def yaml_block(values: dict, tool: str) -> str:
    """The block as YAML comment lines (one value per line; the mixes and adapters as one JSON line each)."""
    lines = [f"{MARK} what seqpar advise --emit predicted with, where {tool}'s keys do not say it (seqpar check reads it)"]
    for k, v in values.items():
        lines.append(f"#   {k}: {json.dumps(v)}")
    return "\n".join(lines) + "\n"


def with_block(text: str, values: dict, tool: str) -> str:
    """A YAML text with the block after its header comments (before its first key)."""
    head = []
    rest = text.splitlines(keepends=True)
    while rest and rest[0].startswith("#"):
        head.append(rest.pop(0))
    return "".join(head) + yaml_block(values, tool) + "".join(rest)


def block_of_yaml(text: str) -> dict:
    """The block's raw values in a YAML text ({} without one): the comment lines after MARK, as YAML."""
    import yaml

    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(MARK)), None)
    if start is None:
        return {}
    body = []
    for ln in lines[start + 1 :]:
        if not ln.startswith("#   "):
            break
        body.append(ln[4:])
    try:
        data = yaml.safe_load("\n".join(body)) if body else {}
    except yaml.YAMLError as e:
        raise SeqparError(f"its seqpar: block is not YAML ({getattr(e, 'problem', None) or e}); fix or delete the block")
    return data


def validated(raw, where: str) -> dict:
    """The block's values, checked like a plan's fields (one line naming the key for a bad one); unknown keys refused."""
    if not isinstance(raw, dict):
        raise SeqparError(f"{where}: the seqpar: block holds a {type(raw).__name__}, not keys; fix or delete the block")
    try:
        got = Assumed.model_validate(raw)
    except ValidationError as e:
        from seqpar.plan.files import first_error

        err = e.errors()[0]
        key = str(err.get("loc", ("?",))[0])
        why = first_error(e) if err.get("type") != "extra_forbidden" else f"{key}: not a value seqpar assumes"
        raise SeqparError(f"{where}: seqpar: block {why}; fix or delete the key") from None
    return got.model_dump(exclude_none=True)


__all__ = [
    "Assumed",
    "CLUSTER",
    "KEY",
    "MARK",
    "RECORDS",
    "SPLIT",
    "assumptions",
    "block_of_yaml",
    "validated",
    "with_block",
    "yaml_block",
]
