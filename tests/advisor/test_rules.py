"""The guide's decision tree, table-driven and exact: seq_len x cluster (x model, x pins) -> mode, degrees and rule path."""

from __future__ import annotations

import pytest

from seqpar.advisor.cluster import cluster_from_flags, cpu_cluster, default_cluster
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.rules import advise_by_rules, choose_mode
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.profiles import get_model

K = 1024
NO_DP = "seq_len < 64K: no"
NO_NODES = "several nodes: no"
NO_MID = "64K <= seq_len <= 256K: no"
DP = ["seq_len < 64K: yes -> data_parallel"]
MID = [NO_DP, NO_NODES, "64K <= seq_len <= 256K: yes -> dist_flash_attn"]
LONG = [NO_DP, NO_NODES, NO_MID, "seq_len > 256K: yes -> zigzag_ring_attn"]
NODES = [NO_DP, "several nodes: yes -> ulysses_attn"]


def a100x8():
    return default_cluster()


def h100(gpus, nodes=1):
    return cluster_from_flags("h100", gpus, nodes)


# (id, seq_len, cluster, model, expected mode, sp_degree, ulysses_degree, rule path)
TABLE = [
    ("32K one node", 32 * K, a100x8, "llama-2-7b", "data_parallel", 1, 1, DP),
    ("64K-1 one node", 64 * K - 1, a100x8, "llama-2-7b", "data_parallel", 1, 1, DP),
    ("64K boundary", 64 * K, a100x8, "llama-2-7b", "dist_flash_attn", 8, 1, MID),
    ("128K", 128 * K, a100x8, "llama-2-7b", "dist_flash_attn", 8, 1, MID),
    ("256K boundary", 256 * K, a100x8, "llama-2-7b", "dist_flash_attn", 8, 1, MID),
    ("256K+16", 256 * K + 16, a100x8, "llama-2-7b", "zigzag_ring_attn", 8, 1, LONG),
    ("512K (EasyContext)", 512 * K, a100x8, "llama-2-7b", "zigzag_ring_attn", 8, 1, LONG),
    ("1M one node", 1024 * K, a100x8, "llama-2-7b", "zigzag_ring_attn", 8, 1, LONG),
    ("32K two nodes: DP first", 32 * K, lambda: h100(8, 2), "llama-2-7b", "data_parallel", 1, 1, DP),
    ("128K two nodes", 128 * K, lambda: h100(8, 2), "llama-2-7b", "ulysses_attn", 16, 1, NODES),
    ("1M two nodes GQA replicate", 1024 * K, lambda: h100(8, 2), "llama-3-8b", "ulysses_attn", 16, 1, NODES),
    (
        "1M 16 nodes: heads < ranks -> usp",
        1024 * K,
        lambda: h100(8, 16),
        "llama-3-8b",
        "usp_attn",
        128,
        8,
        NODES
        + [
            "ulysses_attn invalid: ulysses_attn splits heads over 128 ranks but llama-3-8b has 32 query heads (32 % 128 != 0); "
            "use usp_attn with a ulysses_degree dividing 32, or zigzag_ring_attn",
            "next valid choice -> usp_attn",
        ],
    ),
    (
        "qwen 14 heads on 16 -> usp 2x8",
        1024 * K,
        lambda: h100(8, 2),
        "qwen2.5-0.5b",
        "usp_attn",
        16,
        2,
        NODES
        + [
            "ulysses_attn invalid: ulysses_attn splits heads over 16 ranks but qwen2.5-0.5b has 14 query heads (14 % 16 != 0); "
            "use usp_attn with a ulysses_degree dividing 14, or zigzag_ring_attn",
            "next valid choice -> usp_attn",
        ],
    ),
    (
        "zigzag needs 2*sp | S -> dist flash",
        256 * K + 8,
        a100x8,
        "llama-2-7b",
        "dist_flash_attn",
        8,
        1,
        LONG
        + [
            "zigzag_ring_attn invalid: seq_len 262152 is not divisible by 2*sp_degree = 16, which zigzag_ring_attn needs; "
            "nearest valid: 262144 or 262160",
            "next valid choice -> dist_flash_attn",
        ],
    ),
    # an odd GPU count runs dist flash attention: its schedule is exact and balanced for any count (test_dist_flash.py)
    ("odd GPU count -> dist flash", 160 * K, lambda: h100(5), "llama-2-7b", "dist_flash_attn", 5, 1, MID),
    ("96K on 6 GPUs", 96 * K, lambda: h100(6), "llama-2-7b", "dist_flash_attn", 6, 1, MID),
    (
        "one GPU -> data parallel",
        128 * K,
        lambda: cluster_from_flags("h200", 1),
        "llama-2-7b",
        "data_parallel",
        1,
        1,
        MID
        + [
            f"{m} invalid: {m} needs at least 2 ranks to split a sequence over, the cluster has 1"
            for m in ("dist_flash_attn", "zigzag_ring_attn", "ulysses_attn", "usp_attn")
        ]
        + ["next valid choice -> data_parallel"],
    ),
    ("cpu:2 tiny", 256, lambda: cpu_cluster(2), "tiny", "data_parallel", 1, 1, DP),
    ("cpu:4 tiny 64K", 64 * K, lambda: cpu_cluster(4), "tiny", "dist_flash_attn", 4, 1, MID),
]


@pytest.mark.parametrize("label,seq_len,make,model,mode,sp,u,path", TABLE, ids=[t[0] for t in TABLE])
def test_tree(label, seq_len, make, model, mode, sp, u, path):
    cluster = make()
    plan = advise_by_rules(AdviseRequest(model=get_model(model), seq_len=seq_len, cluster=cluster, policy="rules"))
    s = plan.strategy
    assert (s.mode, s.sp_degree, s.dp_degree) == (mode, sp, cluster.world_size // sp)
    assert (s.ulysses_degree, s.ring_degree) == ((u, sp // u) if mode == "usp_attn" else (1, 1))
    assert plan.rationale.rule_path == path
    assert plan.rationale.rules_choice == path[len([p for p in path if p.endswith(": no")])].split("-> ")[-1]
    assert plan.rationale.policy == "rules" and plan.prediction is None
    # The plan is valid by the schema's own cross-field rules, and survives a JSON round trip.
    assert LaunchPlan.model_validate_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    "seq_len,gpus,match",
    [
        (
            128 * K,
            6,
            r"seq_len 131072 cannot be split over 6 ranks by any mode: dist_flash_attn: seq_len 131072 is not divisible by sp_degree = 6",
        ),
        (128 * K, 3, r"cannot be split over 3 ranks.*sp_degree = 3.*nearest valid: 131070 or 131073.*131070 or 131076"),
        (100001, 8, r"cannot be split over 8 ranks.*nearest valid: 100000 or 100008"),
    ],
)
def test_no_mode_can_split(seq_len, gpus, match):
    with pytest.raises(SeqparError, match=match):
        choose_mode(seq_len, get_model("llama-2-7b"), h100(gpus))


def _plan(seq_len=512 * K, cluster=None, model="llama-2-7b", **pins):
    return advise_by_rules(
        AdviseRequest(model=get_model(model), seq_len=seq_len, cluster=cluster or a100x8(), policy="rules", **pins)
    )


def test_pinned_mode_overrides_tree_and_keeps_its_path():
    p = _plan(32 * K, mode="zigzag_ring_attn")
    assert (p.strategy.mode, p.strategy.sp_degree) == ("zigzag_ring_attn", 8)
    assert p.rationale.rule_path == DP + ["--mode zigzag_ring_attn pinned"] and p.rationale.rules_choice == "data_parallel"


def test_pinned_invalid_mode_is_an_error_not_a_fallback():
    with pytest.raises(
        SeqparError, match=r"pinned --mode ulysses_attn: ulysses_attn splits heads over 8 ranks but qwen2.5-0.5b has 14"
    ):
        _plan(model="qwen2.5-0.5b", mode="ulysses_attn")


def test_pinned_degrees():
    p = _plan(sp_degree=4)
    assert (p.strategy.mode, p.strategy.sp_degree, p.strategy.dp_degree) == ("zigzag_ring_attn", 4, 2)
    p = _plan(32 * K, sp_degree=2)  # data parallel cannot take sp 2: the next choice of the tree
    assert (p.strategy.mode, p.strategy.sp_degree) == ("dist_flash_attn", 2)
    assert p.rationale.rule_path[-2:] == [
        "data_parallel invalid: data_parallel keeps whole sequences, but sp_degree 2 is pinned",
        "next valid choice -> dist_flash_attn",
    ]
    p = _plan(ulysses_degree=4)
    assert (p.strategy.mode, p.strategy.ulysses_degree, p.strategy.ring_degree) == ("usp_attn", 4, 2)
    with pytest.raises(SeqparError, match="sp_degree 3 does not divide the 8 ranks"):
        _plan(mode="zigzag_ring_attn", sp_degree=3)


def test_defaults_follow_easycontext_and_pins_are_honoured():
    p = _plan()
    assert (p.strategy.checkpointing, p.strategy.sharding, p.strategy.loss_impl) == ("full", "zero3_offload", "hf")
    assert _plan(256, cluster=cpu_cluster(2), model="tiny").strategy.sharding == "ddp"
    p = _plan(checkpointing="offload", sharding="fsdp", loss_impl="chunked")
    assert (p.strategy.checkpointing, p.strategy.sharding, p.strategy.loss_impl) == ("offload", "fsdp", "chunked")
    assert p.rationale.policy == "rules"
    full = _plan(mode="zigzag_ring_attn", sp_degree=8, checkpointing="full", sharding="fsdp", loss_impl="chunked")
    assert full.rationale.policy == "pinned"


def test_tokens_per_step_sets_accumulation():
    p = _plan(128 * K, tokens_per_step=1024 * K, sp_degree=4)  # 1M tokens / (1 x 128K x dp 2) = 4
    assert (p.strategy.dp_degree, p.strategy.gradient_accumulation_steps) == (2, 4)


def test_launch_command():
    # EasyContext's ZeRO-3 with CPU offload on CUDA: seqpar launch runs accelerate with the DeepSpeed config it writes
    p = _plan(cluster=h100(8, 2))
    cmd = p.launch.command
    assert p.launch.launcher == "accelerate"
    assert cmd[:7] == [
        "python",
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "runs/plan/accelerate.yaml",
        "-m",
        "seqpar.runtime.train",
    ]
    assert cmd[-2:] == ["--plan", "plan.json"]
    # FSDP: torchrun; each node fills in its rank and the rendezvous host
    p = _plan(cluster=h100(8, 2), sharding="fsdp")
    cmd = p.launch.command
    assert p.launch.launcher == "torchrun"
    assert cmd[:9] == ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8", "--max-restarts", "0"]
    assert "--node-rank $NODE_RANK --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500" in " ".join(cmd)
    assert cmd[-2:] == ["--plan", "plan.json"]
    assert p.launch.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_hardware_table_reported_when_it_disagrees():
    p = _plan(128 * K)
    assert any("by-hardware table says zigzag_ring_attn for a one 8-GPU node" in r for r in p.rationale.reasons)
