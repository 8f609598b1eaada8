"""Model FLOPs of a training step: the one count behind predicted MFU (seqpar.advisor.throughput) and measured MFU
(seqpar.runtime.report), so a measured/predicted pair compares like with like.

Per sequence of S tokens, forward + backward, recomputation not counted (MFU counts the model's FLOPs, not the work the
hardware did; nanoGPT's ``estimate_mfu`` and the PaLM paper's MFU count the same way):
* matmuls: 6 * N_mm * S (Kaplan et al. 2020; Narayanan et al. 2021, eq. 3), N_mm = the parameters that take part in a
  matmul for every token: the decoder layers without their norms, plus the LM head. The input embedding is a lookup,
  not a product, so it is left out (nanoGPT counts its tied embedding once, as the LM head).
* causal attention: forward 2 * S^2 * a * d per layer (half of the full-mask 4 * S^2 * a * d), backward 2.5x the forward
  (FlashAttention-2, Dao 2023), 3.5x the forward in all.
Dependency-free: it reads a seqpar.schema.ModelSpec's fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seqpar.schema import ModelSpec


def layer_matmul_params(m: ModelSpec) -> int:
    """Parameters of one decoder layer that take part in a matmul: the layer without its two norm weights."""
    return m.layer_params - 2 * m.hidden_size


def matmul_params(m: ModelSpec) -> int:
    """Parameters that take part in a matmul per token: every decoder layer's, plus the LM head."""
    return m.num_layers * layer_matmul_params(m) + m.vocab_size * m.hidden_size


def attention_fwd_flops(m: ModelSpec, seq_len: int) -> float:
    """Causal attention forward FLOPs of one sequence over all layers: 2 * S^2 * a * d per layer."""
    return 2.0 * seq_len * seq_len * m.num_attention_heads * m.head_dim * m.num_layers


def model_flops_per_sequence(m: ModelSpec, seq_len: int) -> float:
    """Forward + backward model FLOPs of one sequence of seq_len tokens: 6 * N_mm * S + 3.5 * attention forward."""
    return 6.0 * matmul_params(m) * seq_len + 3.5 * attention_fwd_flops(m, seq_len)


__all__ = ["attention_fwd_flops", "layer_matmul_params", "matmul_params", "model_flops_per_sequence"]
