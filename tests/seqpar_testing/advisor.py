"""The advisor tests' setting for the per-layer checkpointing split and kept matmuls: Llama-2-7B (and Llama-3.2-1B) on
one H200 with a stated host RAM, the fitted coefficients, and a data_parallel strategy to vary. No torch."""

from __future__ import annotations

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.memory import estimate_memory
from seqpar.advisor.cost.throughput import estimate_time
from seqpar.plan.specs import ModelSpec, Strategy, Workload
from seqpar.profiles import get_model

C = load_coefficients()
M7, M1 = get_model("llama-2-7b"), get_model("llama-3.2-1b")
L7 = M7.num_layers
# the cost-model tests' hand-computable model: h 64, q 4 x 16, k/v 2 x 16 (GQA), I 128, 2 layers, vocabulary 256
TINY = ModelSpec(
    name="t",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
)


def h200(host_gib: float = 125.0):
    return cluster_from_flags("h200", 1).model_copy(update={"host_ram_gib": host_gib})


def work(model=M7, seq_len=65536, optimizer="none") -> Workload:
    return Workload(model=model, seq_len=seq_len, optimizer=optimizer)


def dp(**kw) -> Strategy:
    return Strategy(mode="data_parallel", **kw)


def both(w, cl, s):
    """The memory and the time prediction of one strategy."""
    return estimate_memory(w, cl, s, C), estimate_time(w, cl, s, C)
