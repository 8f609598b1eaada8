"""bench/alst_h200.py, the ALST recipe's one-GPU benchmark (its recipe: bench/alst_recipe.py): its pure parts exactly, then
one tiny step on CPU.

- The host-memory arithmetic against hand-worked numbers for Llama-3.1-8B (8,030,261,248 parameters), the DeepSpeed
  config each recipe gives, the length search and the budget's estimate, the rows and the failure kinds.
- The driver end to end where it spawns nothing (the published recipe's preflight refusal).
- With DeepSpeed installed: a tiny GQA Llama through the same worker code the GPU runs (ZeRO-3 with CPU offload of the
  optimizer and parameters, DeepSpeedCPUAdam, TiledMLP, the checkpoint-offload context, gloo on CPU), its first loss
  against plain transformers on the same weights and tokens; Liger is the GPU's loss and needs Triton, so the CPU runs
  DeepSpeed's TiledFusedLogitsLoss and HF's loss instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import alst_h200 as ab  # noqa: E402
import alst_recipe as ar  # noqa: E402

from seqpar.profiles import get_model  # noqa: E402

N_8B = 8_030_261_248
SPEC_8B = get_model("llama-3.1-8b").model_dump()
GIB = 2**30


def test_llama_8b_shape_is_the_one_costed():
    assert get_model("llama-3.1-8b").num_params == N_8B
    assert (SPEC_8B["num_key_value_heads"], SPEC_8B["vocab_size"], SPEC_8B["tie_word_embeddings"]) == (8, 128256, False)


@pytest.mark.parametrize(
    "recipe, edits, per_param, states_gib",
    [
        ("published", {}, 20, 20 * N_8B / GIB),  # 4 master + 8 Adam + 4 grad + 2 accum + 2 bf16 params = 149.57 GiB
        ("alst-bf16", {}, 12, 12 * N_8B / GIB),  # 2 + 4 + 2 + 2 + 2 = 89.74 GiB
        ("alst-bf16", {"offload_param": False}, 10, 10 * N_8B / GIB),
    ],
)
def test_host_need(recipe, edits, per_param, states_gib):
    s = ar.settings(recipe, edits)
    need = ar.host_need_gib(N_8B, SPEC_8B, s, 131072)
    assert need["bytes_per_param"] == per_param
    assert need["states_gib"] == pytest.approx(states_gib)
    assert need["ckpt_offload_gib"] == pytest.approx(31 * 131072 * 4096 * 2 / GIB)  # 31 layers offloaded = 31.0 GiB
    assert need["total_gib"] == pytest.approx(states_gib + 31.0 + ar.HOST_OVERHEAD_GIB)
    assert s["edits"] == sorted(edits)
    assert ar.host_need_gib(N_8B, SPEC_8B, ar.settings(recipe, {"ckpt_offload": False}), 131072)["ckpt_offload_gib"] == 0


def test_published_recipe_cannot_start_on_this_host_and_the_bf16_one_can():
    assert ar.host_need_gib(N_8B, SPEC_8B, ar.settings("published", {}), 0)["total_gib"] > ab.HOST_RAM_GIB
    bf16 = ar.host_need_gib(N_8B, SPEC_8B, ar.settings("alst-bf16", {}), 0)["total_gib"]
    # the length where the offloaded checkpoints fill the host: ~128K tokens, the recipe's first-principles limit here
    limit = (ab.HOST_RAM_GIB - bf16) * GIB / (31 * 4096 * 2)
    assert 112 * 1024 < limit < 144 * 1024


def test_ds_config_follows_the_recipe():
    pub, bf16 = ar.ds_config(ar.settings("published", {})), ar.ds_config(ar.settings("alst-bf16", {}))
    assert pub["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    assert pub["bf16"] == {"enabled": True}
    assert bf16["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert (pub["gradient_clipping"], pub["train_micro_batch_size_per_gpu"]) == (1.0, 1)
    lean = ar.ds_config(ar.settings("alst-bf16", {"offload_param": False}))
    assert "offload_param" not in lean["zero_optimization"]


def test_loss_shards_about_one_gib_of_fp32_logits():
    assert ar.loss_shards(131072, 128256) == math.ceil(131072 * 128256 * 4 / GIB) == 63
    assert ar.loss_shards(64, 256) == 1


def _runner(ok_up_to: int, fail_kind: str = "gpu", budget_rows: int = 99):
    calls = []

    def run(n):
        if len(calls) >= budget_rows:
            return None
        calls.append(n)
        if n <= ok_up_to:
            return {"seq_len": n, "ok": True}
        return {"seq_len": n, **ar.outcome(-9 if fail_kind == "host" else 1, "CUDA out of memory. Tried to allocate")}

    return run, calls


def test_max_seq_search_stops_at_the_first_failure():
    run, calls = _runner(112 * 1024)
    rows, res = ab.max_seq_search(run, 96 * 1024, 16 * 1024, 2 * 1024**2)
    assert calls == [96 * 1024, 112 * 1024, 128 * 1024]
    assert [r["ok"] for r in rows] == [True, True, False] and all(r["search"] == "max_seq" for r in rows)
    assert res == {"search": "result", "max_seq_len": 112 * 1024, "step": 16 * 1024, "stopped_by": "out of memory", "exact": True}


def test_max_seq_search_host_oom_budget_and_limit():
    run, _ = _runner(96 * 1024, fail_kind="host")
    assert ab.max_seq_search(run, 96 * 1024, 16 * 1024, 10**7)[1]["stopped_by"] == "host out of memory"
    run, calls = _runner(10**9, budget_rows=2)
    res = ab.max_seq_search(run, 64, 64, 10**7)[1]
    assert (calls, res["max_seq_len"], res["stopped_by"], res["exact"]) == ([64, 128], 128, "budget ended", False)
    run, calls = _runner(10**9)
    assert ab.max_seq_search(run, 64, 64, 192)[1]["max_seq_len"] == 192 and calls == [64, 128, 192]
    run, calls = _runner(0)
    assert ab.max_seq_search(run, 64, 64, 192)[1]["max_seq_len"] == 0 and calls == [64]


@pytest.mark.parametrize(
    "rc, tail, oom, kind",
    [
        (-9, "", True, "host"),
        (137, "", True, "host"),
        (1, "RuntimeError: [enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory", True, "host"),
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True, "gpu"),
        (
            1,
            "in _empty_cpu_like\n    return get_accelerator().pin_memory(t)\nRuntimeError: CUDA error: out of memory",
            True,
            "host",
        ),
        (1, "ValueError: something else", False, None),
    ],
)
def test_outcome_kinds(rc, tail, oom, kind):
    assert ar.outcome(rc, tail) | {"error": None} == {"ok": False, "oom": oom, "oom_kind": kind, "error": None}


def test_make_row_and_estimate():
    s = ar.settings("alst-bf16", {})
    mem = {"peak_memory_gib": 40.0, "host_peak_rss_gib": 120.0}
    row = ar.make_row(131072, "llama-3.1-8b", s, [11.9, 11.8, 11.8, 11.8], [60.0, 30.0, 20.0, 25.0], 1, 100.0, 1e16, mem)
    assert (row["step_times_s"], row["step_time_s"], row["tokens_per_s"]) == ([30.0, 20.0, 25.0], 25.0, 131072 / 25.0)
    assert row["mfu_datasheet"] == pytest.approx(1e16 / 25.0 / 989e12)
    assert (row["ok"], row["oom"], row["loss"], row["first_step_s"], row["peak_memory_gib"]) == (True, False, 11.8, 60.0, 40.0)
    one_step = ar.make_row(131072, "llama-3.1-8b", s, [11.9], [60.0], 0, 100.0, 1e16, mem)
    assert (one_step["step_times_s"], one_step["first_step_s"], one_step["tokens_per_s"]) == ([60.0], 60.0, 131072 / 60.0)
    flops = lambda n: 2.0 * n
    assert ab.est_run_s(1000, 2, [], flops) == pytest.approx(ab.START_S + 2 * (2000 / ab.EST_FLOPS + ab.CPU_STEP_S))
    done = [{**row, "wall_s": 260.0}]  # start-up = 260 - 135 = 125 s; a step 25 s at 131072, x2 the FLOPs at 262144
    assert ab.est_run_s(262144, 2, done, flops) == pytest.approx(125.0 + 2 * 50.0)
    assert ab.est_run_s(262144, 2, [{"ok": False}], flops) == ab.est_run_s(262144, 2, [], flops)


def test_passthrough_keeps_the_worker_flags_only():
    argv = ["--seq", "64k", "--recipe", "published", "--max-seq", "--start=96k", "--budget-s", "400", "--no-ckpt-offload",
            "--out", "x.json", "--steps", "1", "--no-preflight", "--attn", "auto"]  # fmt: skip
    assert ab._passthrough(argv) == ["--recipe", "published", "--no-ckpt-offload", "--steps", "1", "--attn", "auto"]


def test_driver_refuses_the_published_recipe_without_spawning(tmp_path):
    out = tmp_path / "alst.json"
    ab.main(["--recipe", "published", "--seq", "64k,128k", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [r["seq_len"] for r in res["rows"]] == [65536, 131072]
    assert all(r["preflight"] and r["oom_kind"] == "host" for r in res["rows"])
    assert res["rows"][0]["error"].startswith("not run: the recipe's host states need 155.6 GiB > 125.0 GiB")
    assert res["ds_config"]["zero_optimization"]["stage"] == 3 and res["settings"]["recipe"] == "published"
    ab.main(["--recipe", "published", "--max-seq", "--start", "64k", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r.get("search") for r in rows] == ["max_seq", "result"] and rows[0]["preflight"]
    assert (rows[1]["max_seq_len"], rows[1]["stopped_by"], rows[1]["model"]) == (0, "host out of memory", "llama-3.1-8b")


def test_a_length_whose_estimate_exceeds_the_budget_is_a_printed_not_run_row(tmp_path, capsys):
    out = tmp_path / "alst.json"
    ab.main(["--seq", "176k", "--no-offload-param", "--budget-s", "100", "--out", str(out)])  # start-up alone is START_S
    row = json.loads(out.read_text())["rows"][0]
    assert (row["seq_len"], row["ok"], row["oom"]) == (180224, False, False)
    assert row["not_run"].startswith("its estimate (") and "does not fit in what is left of --budget-s" in row["not_run"]
    from seqpar.plan.flops import model_flops_per_sequence
    from seqpar.profiles import get_model

    flops = lambda n: model_flops_per_sequence(get_model("llama-3.1-8b"), n)
    want = ab.est_run_s(180224, 2 + 1, [], flops)  # the defaults: 2 steps after 1 warm-up step, no finished row yet
    assert row["not_run"].startswith(f"its estimate ({want:.0f} s)") and want > 100  # the number that kept it from running
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == row


def test_a_run_past_its_time_is_stopped_and_recorded():
    args = argparse.Namespace(passthrough=["--shape", "llama-3.1-8b"])
    row = ab.one(65536, args, timeout=0.2)  # the worker cannot even import torch in 0.2 s
    assert (row["seq_len"], row["ok"], row["oom"], row["timeout_s"]) == (65536, False, False, 0.2)
    assert row["error"].startswith("stopped at the 0 s left") and row["wall_s"] < 30


TINY = {**SPEC_8B, "name": "tiny-llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": 256}  # fmt: skip


@pytest.fixture(scope="module")
def cpu_adam_built():
    """DeepSpeed JIT-builds CPU Adam on first use (minutes, then cached per install: tests/conftest.py)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load(verbose=False)


@pytest.mark.slow  # two DeepSpeed worker processes (~1 min on 2 cores); .ci/run's slow set runs it
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the deepspeed extra is not installed")
def test_tiny_step_on_cpu_matches_transformers(tmp_path, cpu_adam_built):
    import torch
    from single_gpu import hf_config
    from transformers import LlamaForCausalLM

    seq = 256  # TiledMLP: 256 / 64 = 4 tiles; the tiled loss: 4 tiles
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    cfg = hf_config(TINY)
    cfg._attn_implementation = "sdpa"
    ref_model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, TINY["vocab_size"], (1, seq), generator=torch.Generator("cpu").manual_seed(1))
    with torch.no_grad():
        ref = float(ref_model(input_ids=ids, labels=ids).loss)
    assert abs(ref - math.log(TINY["vocab_size"])) < 0.2  # random weights: about uniform over the vocabulary

    def run(case: tuple[str, str]) -> dict:
        loss, attn = case
        out = tmp_path / f"{loss}-{attn}.json"
        ab.main(["--spec-json", json.dumps(TINY), "--seq", str(seq), "--steps", "1", "--warmup", "1", "--loss", loss,
                 "--attn", attn, "--loss-shards", "4", "--budget-s", "200", "--timeout", "200", "--out", str(out)])  # fmt: skip
        return json.loads(out.read_text())["rows"][0]

    cases = [("tiled", "sdpa"), ("hf", "sdpa"), ("hf", "no-such-attention")]
    with ThreadPoolExecutor(len(cases)) as pool:  # worker processes side by side: most of each is imports and start-up
        *found, broken = pool.map(run, cases)
    rows = dict(zip(("tiled", "hf"), found))
    # a failure inside the worker comes back as a row with its traceback, not as a crash of the driver
    assert (broken["ok"], broken["oom"], broken["oom_kind"]) == (False, False, None)
    assert "no-such-attention" in broken["error"] and broken["predicted_host"]["bytes_per_param"] == 12
    for loss, row in rows.items():
        assert row["ok"], row.get("error")
        s = row["settings"]
        assert (s["tiled_mlp"], s["ckpt_offload"], s["offload_param"], s["master"], s["loss"]) == (True, True, True, "bf16", loss)
        torch.testing.assert_close(row["losses"][0], ref, rtol=2e-2, atol=0)  # bf16: the tiles sum in another order
        assert len(row["step_times_s"]) == 1 and len(row["all_step_times_s"]) == 2 and row["host_peak_rss_gib"] > 0
        assert row["ckpt_offload_stats"]["marked_tensors"] == TINY["num_layers"]  # each layer's input (stats: the last step)
    assert rows["tiled"]["settings"]["loss_shards"] == 4


def test_cli_parses_lengths():
    assert [ab.parse_len(x) for x in ("64k", "1.5m", "96K", "300")] == [65536, 1572864, 98304, 300]


def test_single_gpu_records_a_run_past_its_time():
    """bench/single_gpu.py: a worker past --timeout gives a failed row saying so, and the rows before it are kept."""
    from single_gpu import one

    args = argparse.Namespace(steps=1, warmup=0, optimizer="none", seqpar_args="", strategy_set="", gpu="h200", timeout=0.2)
    row = one("stock", "llama-2-7b", 1024, args)  # the worker cannot even import torch in 0.2 s
    assert (row["variant"], row["seq_len"], row["ok"], row["oom"]) == ("stock", 1024, False, False)
    assert row["error"].startswith("timed out after 0.2 s")
