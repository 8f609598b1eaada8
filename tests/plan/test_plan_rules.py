"""One judge of plan validity (schema.plan_problems), asked by every part of the advisor, so it cannot propose a refused plan.

Table-driven over CPU and CUDA clusters, optimizers, dtypes and pins: every strategy the search calls valid builds a
LaunchPlan; every one it calls invalid is refused by LaunchPlan with the very line the search recorded; a request the
advisor refuses is one where the judge refuses every sharding; the rules and the OOM gate's fixes build plans too.
"""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from seqpar.advisor.cluster import cluster_from_flags, cpu_cluster
from seqpar.advisor.gate import variants
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.rules import advise_by_rules
from seqpar.advisor.search import enumerate_strategies
from seqpar.plan.base import Sharding
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import first_error
from seqpar.plan.launch_plan import LaunchPlan, Rationale
from seqpar.plan.rules import plan_problems
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

CLUSTERS = {  # name -> (cluster, model, seq_lens): one that every mode splits, one that some cannot
    "cpu:1": (cpu_cluster(1), "tiny", (256,)),
    "cpu:4": (cpu_cluster(4), "tiny", (256, 100)),
    "h200x1": (cluster_from_flags("h200", 1), "llama-3.2-1b", (65536,)),
    "a100x8": (cluster_from_flags("a100", 8), "llama-3.2-1b", (131072, 100000)),
    "h100x6": (cluster_from_flags("h100", 6), "qwen2.5-0.5b", (98304,)),  # 14 query heads, 2 KV heads: Ulysses refused
}
PINS = (
    {},
    {"sharding": "zero3"},
    {"sharding": "fsdp", "tiled_mlp": True},
    {"tiled_mlp": True},
    {"fused_ops": "liger"},
    {"mode": "dist_flash_attn", "checkpointing": "none"},
    {"ulysses_degree": 2},
    {"sp_degree": 3},
)
RULE_WORDS = {  # each plan rule, by words of its line
    "world size": "does not divide the",
    "split": "is not divisible by",
    "heads": "splits heads over",
    "zero needs adamw": "runs DeepSpeed's AdamW",
    "fp16 needs zero": "fp16 needs a zero* sharding",
    "liger needs cuda": "liger runs Triton kernels on CUDA",
    "tiled not with zero3": "tiled_mlp with sharding zero3",
}


def _plan(w: Workload, cluster, s: Strategy) -> LaunchPlan:
    return LaunchPlan(workload=w, cluster=cluster, strategy=s, rationale=Rationale(policy="cost"))


def _requests(name: str, optimizer: str, dtype: str):
    """(cluster, workload, pins, the request or the ValidationError refusing it) for every seq_len and pin of the table."""
    cluster, model, seq_lens = CLUSTERS[name]
    for seq_len in seq_lens:
        w = Workload(model=get_model(model), seq_len=seq_len, dtype=dtype, optimizer=optimizer)
        for pins in PINS:
            try:
                yield (
                    cluster,
                    w,
                    pins,
                    AdviseRequest(model=w.model, seq_len=seq_len, cluster=cluster, dtype=dtype, optimizer=optimizer, **pins),
                )
            except ValidationError as e:
                yield cluster, w, pins, e


@pytest.mark.parametrize("name", list(CLUSTERS))
@pytest.mark.parametrize("optimizer", ["adamw", "adamw-bf16", "none"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_advisor_proposes_only_what_the_schema_accepts(name, optimizer, dtype):
    for cluster, w, pins, req in _requests(name, optimizer, dtype):
        if isinstance(req, ValidationError):  # refused up front only when the judge refuses every sharding, with its first line
            probes = [
                Strategy.over("data_parallel", 1, cluster.world_size, sharding=sh, fused_ops=pins.get("fused_ops", "none"))
                for sh in get_args(Sharding)
            ]
            problems = [plan_problems(w, cluster, p) for p in probes]
            assert all(problems) and first_error(req) == problems[0][0], (name, pins, first_error(req))
            continue
        valid, invalid = enumerate_strategies(req, w)
        for s in valid:
            assert _plan(w, cluster, s).strategy == s
        for s, why in invalid:
            if s is None:  # a pinned Ulysses degree that forms no usp_attn strategy over an sp degree
                assert pins.get("ulysses_degree") and why.startswith("usp_attn needs ulysses_degree"), why
                continue
            with pytest.raises(ValidationError) as e:
                _plan(w, cluster, s)
            assert first_error(e.value) == why
        if valid:  # the gate's single changes of a valid strategy are plans too
            for _, v in variants(valid[0], req):
                _plan(w, cluster, v)
        try:  # the guide's rules: a plan (validated as it is built) or one SeqparError line, never a refused plan
            advise_by_rules(req.model_copy(update={"policy": "rules"}))
        except SeqparError as e:
            assert "\n" not in str(e)


def test_the_table_exercises_every_rule():
    """Each plan rule refuses something in the table above, so the test above is not vacuous."""
    reasons = set()
    for name in CLUSTERS:
        for optimizer in ("adamw", "none"):
            for dtype in ("bf16", "fp16"):
                for _, w, _, req in _requests(name, optimizer, dtype):
                    if isinstance(req, ValidationError):
                        reasons.add(first_error(req))
                    else:
                        reasons.update(why for _, why in enumerate_strategies(req, w)[1])
    seen = {rule for rule, words in RULE_WORDS.items() if any(words in r for r in reasons)}
    assert seen == set(RULE_WORDS), set(RULE_WORDS) - seen


def test_search_keeps_easycontexts_checkpointing_for_dist_flash_unless_pinned():
    """dist_flash_attn without checkpointing is a valid plan (the runtime runs it), outside the default search space."""
    cluster = cluster_from_flags("a100", 8)
    req = AdviseRequest(model=get_model("llama-2-7b"), seq_len=131072, cluster=cluster, mode="dist_flash_attn")
    valid, _ = enumerate_strategies(req, req.workload())
    assert valid and all(s.checkpointing != "none" for s in valid)
    pinned = req.model_copy(update={"checkpointing": "none"})
    valid, invalid = enumerate_strategies(pinned, pinned.workload())
    assert valid and all(s.checkpointing == "none" for s in valid) and not any(s is None for s, _ in invalid)
