"""Every place the advisor shows a strategy's options reads them from their declaration (seqpar.plan.display): the
one-line name, the plan's Strategy table, a measurement row's label, a picture's title, the pinned options' reasons.
A Strategy with one more declared option shows it in each without any of them naming it."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from rich.console import Console

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.measurements import load_measurements
from seqpar.advisor.plots import _title
from seqpar.advisor.render import plan_tables
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.rules import advise_by_rules
from seqpar.advisor.search import advise_by_cost, describe
from seqpar.plan.display import Shown
from seqpar.plan.specs import Strategy
from seqpar.profiles import get_model

M1 = get_model("llama-3.2-1b")
H200 = cluster_from_flags("h200", 1)
PINS = {"mode": "data_parallel", "checkpointing": "full", "sharding": "ddp", "loss_impl": "chunked", "optimizer": "none"}


class WithFusedLoss(Strategy):
    fused_loss: Annotated[bool, Shown(row="fused loss", name="xent=fused", label="fusedloss", title="fused loss")] = Field(
        default=False, description="A test option."
    )


def _text(plan) -> str:
    console = Console(width=200, record=True, color_system=None)
    for t in plan_tables(plan, None):
        console.print(t)
    return console.export_text()


def test_the_options_read_the_same_everywhere():
    req = AdviseRequest(model=M1, seq_len=16384, cluster=H200, fused_ops="liger", tiled_mlp=True, **PINS)
    plan = advise_by_cost(req)
    s = plan.strategy
    assert (s.fused_ops, s.tiled_mlp) == ("liger", True)
    assert describe(s) == "data_parallel dp=1 ckpt=full ddp loss=chunked mlp=tiled ops=liger"
    assert _title(plan) == "llama-3.2-1b, 1x h200, ckpt=full, ddp, loss=chunked, liger kernels, tiled MLP"
    lines = _text(plan).splitlines()
    assert [ln.split() for ln in lines if ln.startswith(("fused ops", "tiled MLP"))] == [
        ["fused", "ops", "liger"],
        ["tiled", "MLP", "yes"],
    ]
    assert [r for r in advise_by_rules(req).rationale.reasons if r.endswith(": pinned")][-2:] == [
        "fused_ops liger: pinned",
        "tiled_mlp True: pinned",
    ]


def test_a_measurement_rows_label_carries_its_options():
    labels = {r.label for r in load_measurements()}
    assert "data_parallel 65536 x1 h200 llama-2-7b ckpt=offload liger tiled" in labels
    assert "data_parallel 131072 x1 h200 llama-3.2-1b ckpt=full zero3" in labels


def test_a_new_option_shows_in_the_name_the_table_and_the_title():
    plan = advise_by_cost(AdviseRequest(model=M1, seq_len=16384, cluster=H200, **PINS))
    s = WithFusedLoss(**plan.strategy.model_dump(), fused_loss=True)
    plan = plan.model_copy(update={"strategy": s})
    assert describe(s).endswith(" loss=chunked xent=fused")
    assert _title(plan).endswith(", loss=chunked, fused loss")
    assert any(ln.split() == ["fused", "loss", "yes"] for ln in _text(plan).splitlines())
