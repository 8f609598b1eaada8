"""How a strategy's options read in text (seqpar.plan.display): declared on the option's field, read back exactly, kept
out of the JSON schema; an option declared on a new field shows everywhere without naming it again."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from pydantic import Field

from seqpar.plan.display import Shown, option_names, rows, shown_fields, tags
from seqpar.plan.specs import Strategy


def dp(**options) -> Strategy:
    return Strategy(mode="data_parallel", **options)


class WithFusedLoss(Strategy):
    """A Strategy with one more option, as a developer would add it: its field and its Shown, nothing else."""

    fused_loss: Annotated[bool, Shown(row="fused loss", name="xent=fused", label="fusedloss", title="fused loss")] = Field(
        default=False, description="A test option."
    )


def test_the_options_are_the_fields_that_declare_how_they_read():
    assert option_names(Strategy) == option_names(dp()) == ("fused_ops", "tiled_mlp")
    assert shown_fields(Strategy)["tiled_mlp"] == Shown(row="tiled MLP", name="mlp=tiled", label="tiled", title="tiled MLP")
    assert option_names(WithFusedLoss) == ("fused_ops", "tiled_mlp", "fused_loss")


@pytest.mark.parametrize(
    "options, name, label, title, table",
    [
        ({}, [], [], [], [("fused ops", "none"), ("tiled MLP", "no")]),
        ({"tiled_mlp": True}, ["mlp=tiled"], ["tiled"], ["tiled MLP"], [("fused ops", "none"), ("tiled MLP", "yes")]),
        ({"fused_ops": "liger"}, ["ops=liger"], ["liger"], ["liger kernels"], [("fused ops", "liger"), ("tiled MLP", "no")]),
        (
            {"fused_ops": "liger", "tiled_mlp": True},
            ["mlp=tiled", "ops=liger"],
            ["liger", "tiled"],
            ["liger kernels", "tiled MLP"],
            [("fused ops", "liger"), ("tiled MLP", "yes")],
        ),
    ],
)
def test_tags_show_the_non_default_options_sorted_and_rows_show_every_option(options, name, label, title, table):
    s = dp(**options)
    assert (tags(s, "name"), tags(s, "label"), tags(s, "title"), rows(s)) == (name, label, title, table)


def test_a_new_option_shows_by_its_declaration_alone():
    s = WithFusedLoss(mode="data_parallel", tiled_mlp=True, fused_loss=True)
    assert tags(s, "name") == ["mlp=tiled", "xent=fused"] and tags(s, "label") == ["fusedloss", "tiled"]
    assert rows(s)[-1] == ("fused loss", "yes")
    assert tags(WithFusedLoss(mode="data_parallel"), "name") == []


def test_the_display_metadata_stays_out_of_the_json_schema():
    schema = json.dumps(Strategy.model_json_schema())
    assert "mlp=tiled" not in schema and "Shown" not in schema
    assert Strategy.model_json_schema()["properties"]["tiled_mlp"] == {
        "default": False,
        "description": Strategy.model_fields["tiled_mlp"].description,
        "title": "Tiled Mlp",
        "type": "boolean",
    }
