"""offload_stride in the plan, the cost model and the search: one offloaded layer input in k waits in host memory,
backward recomputes the others from it (seqpar.runtime.memory.activation_checkpoint runs it; tests/runtime/memory/
test_offload_stride.py checks it exact and counts what it keeps and reruns). No torch here."""

from __future__ import annotations

import pytest

from seqpar.advisor.answer import checkpointing_short
from seqpar.advisor.cluster import resolve_cluster
from seqpar.advisor.cost.memory import estimate_memory, host_bytes
from seqpar.advisor.cost.throughput import estimate_time
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost, describe, max_seq_len
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.options import LayerSplit, layer_split
from seqpar.plan.rules import plan_problems, split_problems
from seqpar.plan.specs import LoraSpec, Workload
from seqpar.profiles import get_model

from seqpar_testing.advisor import L7, M7, C, dp, h200, work

M70 = get_model("llama-3.3-70b")
QLORA = LoraSpec(rank=32, base_dtype="nf4")


def test_layer_split_with_a_stride():
    assert layer_split("offload", 32, None, None, offload_stride=2) == LayerSplit(32, 0, 0, stride=2)
    sp = layer_split("offload", 80, None, 73, offload_stride=2)
    assert (sp.host, sp.gpu, sp.host_inputs, sp.recomputed_inputs, sp.recomputed) == (73, 7, 37, 36, 116)
    sp = layer_split("offload", 32, 24, 10, offload_stride=3)
    assert (sp.host_inputs, sp.recomputed_inputs, sp.recomputed, sp.kept) == (4, 6, 30, 8)
    assert layer_split("full", 32, offload_stride=2).stride == 1  # nothing offloaded: no stride
    assert layer_split("offload", 32, None, 0, offload_stride=2) == layer_split("full", 32)


def test_the_rules_refuse_a_stride_without_offload_or_beyond_the_offloaded_layers():
    (why,) = split_problems("selective", None, None, 32, "llama-2-7b", 2)
    assert "offload_stride 2" in why and "checkpointing is selective" in why and "use checkpointing offload" in why
    (why,) = split_problems("offload", None, 3, 32, "llama-2-7b", 4)
    assert why.startswith("offload_stride 4 is more than the 3 offloaded layers; use at most 3")
    assert split_problems("offload", None, 4, 32, "llama-2-7b", 4) == []
    w = work(seq_len=65536)
    bad = dp(checkpointing="full", offload_stride=2)
    assert any("offload_stride 2" in p for p in plan_problems(w, h200(), bad))
    with pytest.raises(ValueError, match="--offload-stride 2 .* --checkpointing is full"):
        AdviseRequest(model=M7, seq_len=65536, cluster=h200(), checkpointing="full", offload_stride=2)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_stride_divides_the_host_memory_and_costs_its_recomputed_inputs(k):
    """Host: one layer input per group of k. GPU: the backward of an offloaded layer holds up to k - 1 more inputs. Time:
    one more forward of each layer whose input is recomputed, fewer copies."""
    t, w, cl = 262144, work(seq_len=262144), h200(1000)
    one = dp(checkpointing="offload", fused_ops="liger", tiled_mlp=True)
    strided = one.model_copy(update={"offload_stride": k})
    layer = 2 * M7.hidden_size * t  # bf16 layer input (optimizer none)
    process = host_bytes(w, cl, dp(checkpointing="full"), C)
    assert host_bytes(w, cl, one, C) - process == pytest.approx(L7 * layer)
    assert host_bytes(w, cl, strided, C) - process == pytest.approx(-(-L7 // k) * layer)
    m1, mk = estimate_memory(w, cl, one, C), estimate_memory(w, cl, strided, C)
    b1, bk = m1.phase_terms["backward"], mk.phase_terms["backward"]
    assert bk["checkpointed_activations"] - b1["checkpointed_activations"] == pytest.approx((k - 1) * layer)
    assert {x: v for x, v in bk.items() if x != "checkpointed_activations"} == {
        x: v for x, v in b1.items() if x != "checkpointed_activations"
    }
    t1, tk = estimate_time(w, cl, one, C), estimate_time(w, cl, strided, C)
    assert tk.breakdown_s["compute"] > t1.breakdown_s["compute"] and tk.breakdown_s["elementwise"] > t1.breakdown_s["elementwise"]
    # the recomputed forwards are priced as the checkpointed layers' own: a stride's extra compute equals that of
    # recomputing as many more layers (a full-policy twin with the same count of recomputed layers is not expressible,
    # so compare against the linear share: (k - 1)/k of the layers once more)
    share = (L7 - -(-L7 // k)) / L7
    assert tk.step_time_s > t1.step_time_s * (1 + 0.1 * share)


def test_the_search_strides_only_where_the_host_is_short():
    """Llama-3.3-70B QLoRA r=32 on one H100: on a 125 GiB host its 80 layer inputs do not fit past ~87K tokens, so the
    longest plan sends one in two to the host and is longer; with 1 TB of host RAM no stride is needed at that length."""
    small, _ = resolve_cluster("h100", 1, None, None, 125)
    big, _ = resolve_cluster("h100", 1, None, None, 1000)
    n, s = max_seq_len(M70, small, ["data_parallel"], lora=QLORA)["data_parallel"]
    assert s.checkpointing == "offload" and s.offload_stride == 2 and n >= 100 * 1024
    w = Workload(model=M70, seq_len=n, lora=QLORA)
    mem = estimate_memory(w, small, s, C)
    assert mem.fits
    one = s.model_copy(update={"offload_stride": 1})
    assert estimate_memory(w, small, one, C).reason.startswith("host RAM")
    over = estimate_memory(w.model_copy(update={"seq_len": n + 5 * 1024}), small, s, C)
    assert not over.fits and not over.reason.startswith("host RAM")  # the GPU binds now, not the host
    req = AdviseRequest(model=M70, seq_len=n, cluster=big, lora=QLORA, mode="data_parallel")
    assert advise_by_cost(req).strategy.offload_stride == 1
    # a pinned stride is kept
    req = AdviseRequest(model=M70, seq_len=65536, cluster=small, lora=QLORA, mode="data_parallel", offload_stride=3)
    plan = advise_by_cost(req)
    assert plan.strategy.offload_stride == 3 and plan.strategy.checkpointing == "offload"
    assert "1 in 3 to host" in describe(plan.strategy)
    assert "1 in 3 of their inputs in host memory" in checkpointing_short(plan.strategy, M70.num_layers)


def test_a_plan_with_a_stride_round_trips():
    req = AdviseRequest(model=M7, seq_len=65536, cluster=h200(), optimizer="none", checkpointing="offload", offload_stride=2)
    plan = advise_by_cost(req)
    again = LaunchPlan.model_validate_json(plan.model_dump_json())
    assert again.strategy.offload_stride == 2 and again == plan
    s, w = plan.strategy, req.workload()
    sp = layer_split("offload", M7.num_layers, None, s.offload_layers, offload_stride=2)
    one = s.model_copy(update={"offload_stride": 1})
    layer = 2 * M7.hidden_size * 65536  # optimizer none: bf16 layer inputs
    saved = host_bytes(w, req.cluster, one, C) - host_bytes(w, req.cluster, s, C)
    assert sp.host >= 2 and saved == pytest.approx((sp.host - sp.host_inputs) * layer)


def test_a_pinned_stride_is_kept_where_fewer_layers_would_do_and_asks_for_offload():
    """A pinned stride above the layers the GPU needs offloaded still offloads at least that many (stride 1's split
    would drop the pin); a stride pin alone picks checkpointing offload; max_seq_len keeps a pinned stride 1."""
    cl, _ = resolve_cluster("h100", 1, None, None, 125)
    req = AdviseRequest(model=M7, seq_len=131072, cluster=cl, checkpointing="offload", offload_stride=12)
    s = advise_by_cost(req).strategy
    assert s.offload_stride == 12 and (s.offload_layers or M7.num_layers) >= 12
    alone = advise_by_cost(AdviseRequest(model=M7, seq_len=131072, cluster=cl, offload_stride=2)).strategy
    assert alone.checkpointing == "offload" and alone.offload_stride == 2
    n1, s1 = max_seq_len(M70, cl, ["data_parallel"], lora=QLORA, offload_stride=1)["data_parallel"]
    n2, s2 = max_seq_len(M70, cl, ["data_parallel"], lora=QLORA)["data_parallel"]
    assert s1.offload_stride == 1 and s2.offload_stride == 2 and n1 < n2


def test_a_stride_over_no_offloaded_layer_is_refused():
    (why,) = split_problems("offload", None, 0, 32, "llama-2-7b", 2)
    assert why.startswith("offload_stride 2 is more than the 0 offloaded layers")


def test_host_memory_holds_the_offloaded_inputs_in_the_residual_dtype():
    """DDP with fp32 parameters under autocast carries an fp32 residual stream: its offloaded layer inputs take 4 bytes
    per element on the host (as seqpar.runtime.memory.offload copies them), bf16 AdamW 2."""
    t, cl = 65536, h200(1000)
    for optimizer, r in (("adamw", 4), ("adamw-bf16", 2)):
        w = work(seq_len=t, optimizer=optimizer)
        off, full = dp(checkpointing="offload"), dp(checkpointing="full")
        assert host_bytes(w, cl, off, C) - host_bytes(w, cl, full, C) == pytest.approx(L7 * r * M7.hidden_size * t)


def test_a_head_with_rebuilt_layers_above_it_comes_back_twice():
    """Under a stride the host-held input of a group with rebuilt layers is copied back for the rebuild and again for
    its own layer's backward: one more copy per such group, priced at the pinned rate (a 1 TB host pins them all)."""
    from seqpar.advisor.cost.throughput import offload_copy_time

    assert layer_split("offload", 32, offload_stride=2).rebuilt_groups == 16
    assert layer_split("offload", 32, None, 9, offload_stride=4).rebuilt_groups == 2  # heads 0, 4, 8: 8 stands alone
    assert layer_split("offload", 32).rebuilt_groups == 0
    w, cl = work(seq_len=262144), h200(1000)
    layer = 2 * M7.hidden_size * 262144
    s2 = dp(checkpointing="offload", offload_stride=2)
    # with no compute to hide under, every copy is exposed: 16 inputs out and back, and 16 back again
    assert offload_copy_time(w, cl, s2, C, 0.0) == pytest.approx((2 * 16 + 16) * layer / (C.pinned_copy_gb_s * 1e9))


def test_no_tool_is_emitted_with_a_stride(tmp_path):
    """DeepSpeed's script runs seqpar.apply's layer split, but --emit gives no tool a stride: seqpar's own plan for the
    70B QLoRA on a 100 GiB host strides, DeepSpeed is priced offloading every input (as `seqpar check` of what it would
    write prices it), which does not fit: it says why, and writes the plan alone."""
    from typer.testing import CliRunner

    from seqpar.cli import app

    out = tmp_path / "plan.json"
    args = ["advise", "--model", "llama-3.3-70b", "--seq-len", "81920", "--gpu", "h100", "--gpus", "1"]
    args += ["--host-ram-gib", "100", "--lora-rank", "32", "--qlora", "--emit", "deepspeed", "-o", str(out)]
    r = CliRunner().invoke(app, args)
    assert LaunchPlan.model_validate_json(out.read_text()).strategy.offload_stride == 2  # seqpar's own plan strides
    assert "deepspeed has no offload_stride" in r.output and "emitted every offloaded layer's input" in r.output
    assert r.exit_code == 1 and "nothing deepspeed expresses fits" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
