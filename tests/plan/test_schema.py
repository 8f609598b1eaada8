"""The launch-plan schema: parsing helpers, cross-field rules with their numbers, loading and atomic writing of plan files."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from seqpar.advisor.cluster import cluster_from_flags, default_cluster
from seqpar.plan.base import SCHEMA_VERSION
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan, Rationale
from seqpar.plan.modes import check_heads, check_split, nearest_multiples
from seqpar.plan.specs import ClusterSpec, ModelSpec, Strategy, Workload
from seqpar.plan.units import format_tokens, parse_seq_len
from seqpar.profiles import get_link, get_model


@pytest.mark.parametrize(
    "text,value",
    [
        ("131072", 131072),
        ("128k", 131072),
        ("512K", 524288),
        ("1M", 1048576),
        ("1m", 1048576),
        (" 64k ", 65536),
        ("1.5k", 1536),
        (4096, 4096),
    ],
)
def test_parse_seq_len(text, value):
    assert parse_seq_len(text) == value


@pytest.mark.parametrize(
    "text,match",
    [
        ("abc", "is not a number"),
        ("12kk", "is not a number"),
        ("0", "must be positive"),
        ("-5", "not a number"),
        ("0.3k", "not a whole number"),
        ("", "not a number"),
        (0, "must be positive"),
    ],
)
def test_parse_seq_len_bad(text, match):
    with pytest.raises(SeqparError, match=match):
        parse_seq_len(text)


@pytest.mark.parametrize("n,text", [(131072, "128K"), (1048576, "1M"), (100000, "100000"), (3 * 1024**2, "3M")])
def test_format_tokens(n, text):
    assert format_tokens(n) == text
    if not text.isdigit():
        assert parse_seq_len(text) == n  # the two are inverses on whole K/M


@pytest.mark.parametrize(
    "value,mult,expected", [(100001, 16, (100000, 100016)), (96, 16, (96, 96)), (5, 16, (16, 16)), (262152, 16, (262144, 262160))]
)
def test_nearest_multiples(value, mult, expected):
    below, above = nearest_multiples(value, mult)
    assert (below, above) == expected and below % mult == 0 and above % mult == 0


@pytest.mark.parametrize(
    "mode,seq_len,sp,u,r,match",
    [
        (
            "zigzag_ring_attn",
            100001,
            8,
            1,
            1,
            r"seq_len 100001 is not divisible by 2\*sp_degree = 16, which zigzag_ring_attn needs; nearest valid: 100000 or 100016",
        ),
        (
            "dist_flash_attn",
            1000,
            16,
            1,
            1,
            r"not divisible by sp_degree = 16, which dist_flash_attn needs; nearest valid: 992 or 1008",
        ),
        ("usp_attn", 1000, 8, 2, 4, r"2\*ring_degree\*ulysses_degree = 16"),
    ],
)
def test_check_split(mode, seq_len, sp, u, r, match):
    with pytest.raises(SeqparError, match=match):
        check_split(mode, seq_len, sp, u)
    check_split(mode, seq_len - seq_len % (2 * sp), sp, u)  # the nearest valid length below passes


def _heads(mode, model, sp, u=None):
    check_heads(mode, model.num_attention_heads, model.num_key_value_heads, sp, u, owner=model.name)


def test_check_heads():
    qwen = get_model("qwen2.5-0.5b")  # 14 query heads, 2 KV heads
    _heads("ulysses_attn", qwen, 2)
    _heads("ulysses_attn", get_model("llama-3-8b"), 16)  # 8 KV heads replicated twice
    with pytest.raises(SeqparError, match=r"splits heads over 4 ranks but qwen2.5-0.5b has 14 query heads \(14 % 4 != 0\)"):
        _heads("ulysses_attn", qwen, 4)
    with pytest.raises(SeqparError, match=r"can neither split nor replicate llama-2-70b's 16 KV heads"):
        _heads(
            "usp_attn", get_model("llama-2-70b").model_copy(update={"num_key_value_heads": 16, "num_attention_heads": 48}), 24, 12
        )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(mode="data_parallel", sp_degree=2), "sp_degree must be 1, not 2"),
        (dict(mode="usp_attn", sp_degree=8, ulysses_degree=2, ring_degree=2), r"2 x 2 = 4 != 8"),
        (dict(mode="zigzag_ring_attn", sp_degree=8, ulysses_degree=2), "for usp_attn only"),
        (dict(mode="ring", sp_degree=2), "Input should be"),
        (dict(mode="zigzag_ring_attn", sp_degree=2, extra_field=1), "Extra inputs"),
    ],
)
def test_strategy_rules(kw, match):
    with pytest.raises(ValidationError, match=match):
        Strategy(**kw)


def test_models_are_frozen_and_cluster_needs_inter_node_link():
    s = Strategy(mode="zigzag_ring_attn", sp_degree=8)
    with pytest.raises(ValidationError):
        s.sp_degree = 4
    c = default_cluster()
    with pytest.raises(ValidationError, match="nodes = 2 needs an inter_node_link"):
        ClusterSpec(**{**c.model_dump(), "nodes": 2, "inter_node_link": None})
    ClusterSpec(**{**c.model_dump(), "nodes": 2, "inter_node_link": get_link("ib_hdr").model_dump()})
    with pytest.raises(ValidationError, match="GQA needs whole groups"):
        ModelSpec(**{**get_model("tiny").model_dump(), "num_key_value_heads": 3})


def _plan(seq_len=524288, cluster=None, **strategy) -> LaunchPlan:
    return LaunchPlan(
        workload=Workload(model=get_model("llama-2-7b"), seq_len=seq_len),
        cluster=cluster or default_cluster(),
        strategy=Strategy(**({"mode": "zigzag_ring_attn", "sp_degree": 8} | strategy)),
        rationale=Rationale(policy="rules"),
    )


def test_plan_cross_field_rules():
    with pytest.raises(ValidationError, match=r"sp_degree 4 x dp_degree 1 = 4 ranks, but the cluster has 1 x 8 = 8"):
        _plan(sp_degree=4)
    with pytest.raises(ValidationError, match=r"seq_len 100001 is not divisible by 2\*sp_degree = 16"):
        _plan(seq_len=100001)
    with pytest.raises(ValidationError, match=r"14 query heads"):
        LaunchPlan(
            workload=Workload(model=get_model("qwen2.5-0.5b"), seq_len=65536),
            cluster=cluster_from_flags("h100", 4),
            strategy=Strategy(mode="ulysses_attn", sp_degree=4),
            rationale=Rationale(policy="rules"),
        )
    assert _plan(sp_degree=4, dp_degree=2).strategy.world_size == 8


def test_plan_write_load_roundtrip(tmp_path):
    p = _plan()
    path = p.write(tmp_path / "sub" / "plan.json")
    assert LaunchPlan.load(path) == p
    assert sorted(x.name for x in path.parent.iterdir()) == ["plan.json"]  # no temporary file left behind
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


def _edit(tmp_path, fn):
    data = json.loads(_plan().to_json())
    fn(data)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(data))
    return f


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda d: d.update(schema_version=SCHEMA_VERSION + 1),
            rf"has schema_version {SCHEMA_VERSION + 1}, newer than this seqpar understands \({SCHEMA_VERSION}\); upgrade seqpar",
        ),
        (lambda d: d.update(schema_version=0), r"schema_version: schema_version 0 is not a valid version"),
        (lambda d: d.update(colour="blue"), r"colour: unknown field \(not part of schema version 1\)"),
        (lambda d: d["strategy"].update(sp_degree=3), r"is invalid: .*sp_degree"),
        (lambda d: d["workload"].pop("seq_len"), r"workload.seq_len: Field required"),
    ],
)
def test_plan_load_refuses(tmp_path, edit, match):
    with pytest.raises(SeqparError, match=match):
        LaunchPlan.load(_edit(tmp_path, edit))


def test_plan_load_bad_files(tmp_path):
    with pytest.raises(SeqparError, match=r"does not exist; write one with `seqpar advise"):
        LaunchPlan.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SeqparError, match="is not valid JSON"):
        LaunchPlan.load(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(SeqparError, match="holds a list, not a plan object"):
        LaunchPlan.load(tmp_path / "list.json")


def test_json_schema_describes_every_field():
    schema = LaunchPlan.model_json_schema()
    assert {"workload", "cluster", "strategy", "prediction", "rationale", "launch", "training"} <= set(schema["properties"])
    for name, definition in schema["$defs"].items():
        for field, prop in definition.get("properties", {}).items():
            assert prop.get("description"), f"{name}.{field} has no description"


def test_dist_flash_accepts_odd_degree():
    # the runtime's schedule is exact and balanced for odd P (tests/runtime/parallel/test_dist_flash.py runs W=3), so plans may ask for it
    assert Strategy(mode="dist_flash_attn", sp_degree=3).sp_degree == 3


@pytest.mark.parametrize(
    "workload,strategy,match",
    [
        (dict(optimizer="none"), dict(sharding="zero3_offload"), "optimizer none cannot run there; use sharding fsdp"),
        (dict(dtype="fp16"), dict(sharding="ddp"), "without loss scaling; use dtype bf16"),
    ],
)
def test_plan_refuses_what_the_runtime_cannot_run(workload, strategy, match):
    cl = cluster_from_flags("h200", 1)
    w = Workload(model=get_model("llama-2-7b"), seq_len=4096, **workload)
    with pytest.raises(ValidationError, match=match):
        LaunchPlan(
            workload=w, cluster=cl, strategy=Strategy(mode="data_parallel", **strategy), rationale=Rationale(policy="pinned")
        )
