"""The mode registry (seqpar.plan.modes): the five built-in modes register through it, a description is checked where
it is built, and a registered mode is a valid strategy.mode (and in the plan's JSON schema) until it is taken out."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from seqpar.plan import modes
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import Strategy

BUILTIN = ("data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")
EXTRA = modes.ModeDescription(
    name="extra_test_mode",
    implementation="seqpar_extra_test",
    runtime="no_such_module",
    layout="contiguous",
    degrees="sequence",
    comm=("all_gather_kv",),
    balance="contiguous",
    summary="a mode registered by a test",
)


def test_the_builtin_modes_are_registered_in_order():
    assert modes.names() == BUILTIN
    assert [d.name for d in modes.builtin.BUILTIN] == list(BUILTIN)
    d = modes.describe("usp_attn")
    assert d.takes_ulysses_degree and d.splits_heads and d.rotates_kv and d.splits_sequence
    assert not modes.describe("data_parallel").splits_sequence
    assert modes.describe("dist_flash_attn").needs_checkpointing


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(layout="spiral"), r"layout 'spiral' is not one of whole, zigzag"),
        (dict(degrees="diagonal"), r"degrees 'diagonal' is not one of"),
        (dict(comm=("carrier_pigeon",)), r"comm 'carrier_pigeon' is not one of ring_kv"),
        (dict(balance="lopsided"), r"balance 'lopsided' is not one of"),
        (dict(name="Bad-Name"), r"mode name 'Bad-Name' must be lower-case"),
        (dict(implementation="my_flash_attn"), r"without 'flash'"),
        (dict(layout="whole"), r"degrees 'none' and layout 'whole' go together"),
        (dict(degrees="heads"), r"a head split .* moves heads by all-to-all"),
    ],
)
def test_a_description_is_checked_where_it_is_built(change, match):
    with pytest.raises(SeqparError, match=match):
        dataclasses.replace(EXTRA, **change)


def test_a_registered_mode_is_a_strategy_mode_until_it_is_taken_out():
    with pytest.raises(ValidationError, match="Input should be 'data_parallel', .* or 'usp_attn'"):
        Strategy(mode=EXTRA.name, sp_degree=2)
    with modes.registered(EXTRA):
        assert modes.names() == (*BUILTIN, EXTRA.name)
        s = Strategy.over(EXTRA.name, 4, 8)
        assert (s.sp_degree, s.dp_degree, s.ulysses_degree, s.ring_degree) == (4, 2, 1, 1)
        assert modes.degrees(EXTRA.name, 4) == (4, 1) and modes.split_multiple(EXTRA.name, 4) == 4
        enum = LaunchPlan.model_json_schema()["$defs"]["Strategy"]["properties"]["mode"]["enum"]
        assert enum == [*BUILTIN, EXTRA.name]
        with pytest.raises(ValidationError, match="ulysses_degree/ring_degree are for usp_attn only"):
            Strategy(mode=EXTRA.name, sp_degree=4, ulysses_degree=2, ring_degree=2)
    assert modes.names() == BUILTIN
    assert LaunchPlan.model_json_schema()["$defs"]["Strategy"]["properties"]["mode"]["enum"] == list(BUILTIN)


def test_register_refuses_a_clash_and_is_idempotent():
    with modes.registered(EXTRA):
        assert modes.register(EXTRA) is EXTRA  # the same description again: a no-op (a module imported twice)
        with pytest.raises(SeqparError, match="already registered with another description"):
            modes.register(dataclasses.replace(EXTRA, summary="another"))
        with pytest.raises(SeqparError, match="implementation 'seqpar_zigzag_ring' is already 'zigzag_ring_attn'"):
            modes.register(dataclasses.replace(EXTRA, name="other_test_mode", implementation="seqpar_zigzag_ring"))
    with pytest.raises(SeqparError, match="mode 'extra_test_mode' is not registered"):
        modes.unregister(EXTRA.name)
    with pytest.raises(SeqparError, match="mode 'extra_test_mode' is unknown; use one of data_parallel, "):
        modes.describe(EXTRA.name)
