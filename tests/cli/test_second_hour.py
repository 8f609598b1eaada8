"""The second hour (issue: one spelling per concept, refusals that say why, figures that agree): what a newcomer types
after the quick start, through the real CLI."""

from seqpar_testing.cli import run


def test_tokens_per_step_below_one_micro_batch_is_refused_with_the_least_that_works():
    r = run(*["advise", "-s", "1k", "-m", "tiny", "--cluster", "cpu:2", "--tokens-per-step", "3"])
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 2 and len(errors) == 1 and r.stderr.rstrip().endswith(errors[0]), r.stderr
    line = errors[0]
    assert "--tokens-per-step 3 is less than one micro-batch (1 x 1024 tokens = 1024)" in line and "at least 1024" in line


def test_tokens_per_step_of_whole_micro_batches_is_accepted():
    r = run(*["advise", "-s", "1k", "-m", "tiny", "--cluster", "cpu:2", "--tokens-per-step", "4096", "--json"])
    assert r.exit_code == 0, r.output


def test_the_smoke_recipe_plans_for_cpu_ranks_and_the_tiny_model_unless_told_otherwise():
    import json

    r = run(*["advise", "--recipe", "smoke", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["cluster"]["accelerator"] == "cpu" and plan["cluster"]["gpus_per_node"] == 2
    assert plan["workload"]["model"]["name"] == "tiny"
    assert "--recipe smoke: --cluster cpu:2 and --model tiny" in r.stderr
    r = run(*["advise", "--recipe", "smoke", "--cluster", "cpu:4", "--json"])
    assert json.loads(r.stdout)["cluster"]["gpus_per_node"] == 4  # a declared cluster wins


def test_a_short_run_says_checkpoints_only_at_the_end():
    r = run(*["advise", "-s", "1k", "-m", "tiny", "--cluster", "cpu:2", "--verbose"])
    assert r.exit_code == 0
    assert "only at the end: 1000 steps at the predicted" in " ".join(r.stdout.split())
    assert "every 48387 steps" not in r.stdout


def test_an_odd_gpu_count_runs_dist_flash_attention():
    import json

    r = run(*["advise", "-s", "120k", "--gpu", "h100", "--gpus", "3", "--mode", "dist_flash_attn", "--json"])
    assert r.exit_code in (0, 1), r.output  # a plan (fits or not), never "needs an even GPU count"
    assert json.loads(r.stdout)["strategy"]["sp_degree"] == 3


# ------------------------------------------------------------------------------ the spellings Hugging Face users type


def _plan(tmp_path):
    out = tmp_path / "p.json"
    r = run("advise", "-s", "64", "-m", "tiny", "--cluster", "cpu:2", "--mode", "zigzag_ring_attn", "-o", out)
    assert r.exit_code == 0, r.output
    return out


def _tokens(tmp_path, n):
    import numpy as np

    np.save(tmp_path / "tok.npy", np.arange(n, dtype=np.int32) % 256)
    return tmp_path / "tok.npy"


def test_launch_reads_the_trainer_spellings_and_hands_the_ranks_its_own(tmp_path):
    plan, data = _plan(tmp_path), _tokens(tmp_path, 64 * 9)
    hf = ["--max-steps", "7", "--output-dir", tmp_path / "o", "--save-steps", "3", "--save-total-limit", "1"]
    r = run("launch", plan, "--data", data, *hf, "--nodes", "1", "--dry-run")
    assert r.exit_code == 0, r.output
    job = next(ln for ln in r.stdout.splitlines() if "-m seqpar.runtime.train" in ln)
    for canonical in ("--steps 7", f"--output {tmp_path / 'o'}", "--checkpoint-every 3", "--keep-last 1"):
        assert canonical in job, job  # recorded commands keep one spelling


def test_advise_reads_the_trainer_spellings(tmp_path):
    import json

    r = run(
        "advise", "-s", "1k", "--model-path", "tiny", "--cluster", "cpu:2", "--json",
        "--max-steps", "7", "--learning-rate", "1e-4", "--warmup-steps", "2", "--save-steps", "3",
        "--save-total-limit", "1", "--per-device-train-batch-size", "2", "--seed", "5",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    t = p["training"]
    assert (t["steps"], t["learning_rate"], t["warmup_steps"], t["checkpoint_every"], t["keep_last"], t["seed"]) == (
        7, 1e-4, 2, 3, 1, 5,
    )  # fmt: skip
    assert p["workload"]["micro_batch_size"] == 2 and p["workload"]["model"]["name"] == "tiny"
    r = run("advise", "-s", "1k", "--nnodes", "2", "--gpus", "8", "--json")  # launch's spelling of the node count
    assert r.exit_code == 0 and json.loads(r.stdout)["cluster"]["nodes"] == 2, r.output


def test_gradient_accumulation_steps_says_how_seqpar_spells_it():
    r = run("advise", "-s", "1k", "--gradient-accumulation-steps", "4")
    assert r.exit_code == 2
    assert r.stderr.rstrip().splitlines()[-1].endswith("e.g. --tokens-per-step 4096 at dp 1")


def test_version():
    from seqpar import __version__

    r = run("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"seqpar {__version__}"


def test_steps_past_the_data_say_it_repeats(tmp_path):
    plan, data = _plan(tmp_path), _tokens(tmp_path, 64 * 9)  # 9 windows of 64 tokens
    r = run("launch", plan, "--data", data, "--steps", "30", "--output", tmp_path / "o", "--dry-run")
    assert r.exit_code == 0, r.output
    assert (
        "# seqpar launch: the data repeats: 30 steps x 1 window(s) = 30 windows from 9, about 3.3 passes (epochs); "
        "--steps 9 is about one pass"
    ) in r.stdout
    r = run("launch", plan, "--data", data, "--steps", "9", "--output", tmp_path / "o", "--dry-run")
    assert r.exit_code == 0 and "the data repeats" not in r.stdout


def test_absurd_cluster_sizes_are_refused_at_once():
    import time

    for args, says in (
        (["--gpus", "100000000"], "--gpus 100000000 is more than the 1024 seqpar plans for"),
        (["--nodes", "10000000"], "--nodes 10000000 is more than the 131072 seqpar plans for"),
        (["--cluster", "cpu:100000000000"], "more CPU ranks than the 1024 one host runs"),
    ):
        start = time.monotonic()
        r = run("advise", "-s", "1k", *args)
        assert r.exit_code == 2 and says in r.stderr.splitlines()[-1], r.stderr
        assert time.monotonic() - start < 5
