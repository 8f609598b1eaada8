"""The argv codec (seqpar.plan.flags) on the job options (seqpar.plan.job_options): what a job's command holds, and that
every rank reads back exactly the options the launcher wrote, typed (an int stays an int, a list a tuple)."""

from __future__ import annotations

import dataclasses

import pytest

from seqpar.plan.flags import build, from_argv, options, to_argv, value_at
from seqpar.plan.job_options import DataOptions, EvalJobOptions, LaunchOptions, TrainOptions, VerifyOptions


def _changed(cls):
    """An instance of ``cls`` with every option off its default, and plan / output set as a job sets them."""
    values = {}
    for o in options(cls):
        if o.flag.parse is not None:  # steps, a length, lengths, depths: "7" means one of each
            v = o.read("7")
        elif o.flag.choices:
            v = o.flag.choices[-1]
        elif o.kind is bool:
            v = not o.default
        elif o.repeated:
            v = ("A", "B")
        elif o.kind in (int, float):
            v = (o.default or o.flag.min or 0) + 3
        else:
            v = f"x-{o.path[-1]}"
        assert v != o.default, o.flag.name
        values[o.path] = v
    return build(cls, values)


@pytest.mark.parametrize("cls", [TrainOptions, VerifyOptions, EvalJobOptions])
def test_every_option_round_trips_typed(cls):
    opts = _changed(cls)
    back = from_argv(cls, to_argv(opts))
    assert back == opts
    for o in options(cls):
        assert type(value_at(back, o.path)) is type(value_at(opts, o.path)), o.flag.name


def test_defaults_stay_out_of_the_command_but_data_plan_and_output():
    ranks = LaunchOptions().ranks("plan.json", "runs/plan")
    assert to_argv(ranks) == ["--data", "synthetic", "--output", "runs/plan", "--plan", "plan.json"]
    stage = LaunchOptions().ranks("s1/plan.json", "s1", init_from="s0")
    assert to_argv(stage) == ["--data", "synthetic", "--output", "s1", "--init-from", "s0", "--plan", "s1/plan.json"]


def test_switches_repeats_and_numbers_on_the_command_line():
    t = TrainOptions(
        data_options=DataOptions(doc_boundaries=False, procs=2),
        final_checkpoint=False,
        allow_env=("FOO", "BAR"),
        profile_step=3,
        plan="p.json",
        output="o",
    )
    argv = to_argv(t)
    assert "--no-doc-boundaries" in argv and "--no-final-checkpoint" in argv and "--resume" not in argv
    assert argv.count("--allow-env") == 2 and argv[argv.index("--profile-step") + 1] == "3"
    got = from_argv(TrainOptions, argv)
    assert got.profile_step == 3 and got.data_options.procs == 2 and got.allow_env == ("FOO", "BAR")


def test_a_rank_without_output_writes_where_the_launcher_would():
    assert from_argv(TrainOptions, ["--plan", "plans/long.json"]).output == "runs/long"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--steps", "0"], "--steps 0 is below 1"),
        (["--steps", "many"], "--steps 'many' is not an integer"),
        (["--long-documents", "chop"], "--long-documents 'chop' is not one of split, truncate, error"),
        (["--checkpoint-every", "often"], "--checkpoint-every 'often' is not a number of steps"),
        ([], "the following arguments are required: --plan"),
    ],
)
def test_a_bad_flag_is_a_usage_error_naming_it(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        from_argv(TrainOptions, argv + (["--plan", "p.json"] if argv else []), prog="trainer")
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_options_are_frozen_and_declared_once():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainOptions().steps = 3  # type: ignore[misc]
    flags = [o.flag.name for o in options(TrainOptions)]
    assert len(flags) == len(set(flags))
