"""Model FLOPs of a training step: the one count behind predicted MFU (seqpar.advisor.cost.throughput) and measured MFU
(seqpar.runtime.train.report), so a measured/predicted pair compares like with like.

Per sequence (window) of S tokens, forward + backward, recomputation not counted (MFU counts the model's FLOPs, not the
work the hardware did; nanoGPT's ``estimate_mfu`` and the PaLM paper's MFU count the same way):
* matmuls: 6 * N_mm * S (Kaplan et al. 2020; Narayanan et al. 2021, eq. 3), N_mm = the parameters that take part in a
  matmul for every token: the decoder layers without their norms, plus the LM head. The input embedding is a lookup,
  not a product, so it is left out (nanoGPT counts its tied embedding once, as the LM head).
* causal attention: forward 2 * S^2 * a * d per layer (half of the full-mask 4 * S^2 * a * d: S^2/2 query-key pairs,
  the exact S(S+1)/2 to within 1/S), backward 2.5x the forward (FlashAttention-2, Dao 2023), 3.5x the forward in all.
* packed documents (a workload's ``doc_lens``): a query attends only to its own document, so a window costs the sum over
  the documents it holds of 2 * l^2 * a * d per layer, not 2 * S^2 * a * d. ``square_fraction`` is the expected
  sum of l^2 over S^2 (below).

Packing (``window_square_tokens``): documents are concatenated and cut into windows of S tokens (seqpar.runtime.data.windows),
so a window holds the pieces of documents it cuts: a document crossing a window edge counts as two pieces, one longer
than the window as window-sized pieces plus the ends. Sum of piece^2 over a window = sum over its tokens of the length of
the piece holding the token; with the window edges at a uniformly random offset into a document of l tokens, the
expected sum of its pieces' squares is
    g(l, S) = l^2 - l^3 / (3S)           for l <= S   (cut in two with probability l/S),
              S l - S^2 / 3              for l >= S,
and a window holds S / E[l] documents on average: E[sum piece^2] = S * E[g(l, S)] / E[l], at most S^2 (one document,
``doc_lens`` None). Dependency-free: it reads a seqpar.plan.specs.ModelSpec's fields and a DocMix's histogram.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from seqpar.plan.lora import adapter_params

# Read by their fields only: specs.DocMix calls square_fraction, so this module stands below seqpar.plan.specs.
ModelSpec = Any  # a seqpar.plan.specs.ModelSpec
DocMix = Any  # a seqpar.plan.specs.DocMix


def layer_matmul_params(m: ModelSpec) -> int:
    """Parameters of one decoder layer that take part in a matmul: the layer without its two norm weights."""
    return m.layer_params - 2 * m.hidden_size


def matmul_params(m: ModelSpec) -> int:
    """Parameters that take part in a matmul per token: every decoder layer's, plus the LM head."""
    return m.num_layers * layer_matmul_params(m) + m.vocab_size * m.hidden_size


def piece_squares(length: float, seq_len: int) -> float:
    """g(l, S): the expected sum of squares of the pieces windows of S tokens cut a document of ``length`` tokens into."""
    l, S = float(length), float(seq_len)
    return l * l - l**3 / (3 * S) if l <= S else S * l - S * S / 3


def window_square_tokens(histogram: Iterable[tuple[float, float]], seq_len: int) -> float:
    """E[sum over one window's document pieces of l^2] for documents of these (length, share) bins (module docstring)."""
    bins = list(histogram)
    total = sum(p for _, p in bins)
    mean = sum(l * p for l, p in bins) / total
    return seq_len * sum(p * piece_squares(l, seq_len) for l, p in bins) / total / mean


def square_fraction(histogram: Iterable[tuple[float, float]], seq_len: int) -> float:
    """E[sum l^2] / S^2 of packed windows: the share of one-document-per-window causal attention FLOPs they cost."""
    return min(1.0, window_square_tokens(histogram, seq_len) / (float(seq_len) * seq_len))


def attention_fwd_flops(m: ModelSpec, seq_len: int, doc_lens: Optional[DocMix] = None) -> float:
    """Causal attention forward FLOPs of one sequence over all layers: 2 * S^2 * a * d per layer, times the packed
    documents' square_fraction when ``doc_lens`` is given."""
    dense = 2.0 * seq_len * seq_len * m.num_attention_heads * m.head_dim * m.num_layers
    return dense if doc_lens is None else dense * square_fraction(doc_lens.histogram, seq_len)


def model_flops_per_sequence(m: ModelSpec, seq_len: int, doc_lens: Optional[DocMix] = None, lora: Any = None) -> float:
    """Forward + backward model FLOPs of one sequence of seq_len tokens: 6 * N_mm * S + 3.5 * attention forward
    (of its packed documents when ``doc_lens`` is given). With ``lora`` (a seqpar.plan.specs.LoraSpec) the base is
    frozen, so its backward computes only the inputs' gradients: 4 * N_mm * S, plus 6 FLOPs per token and adapter
    parameter (seqpar.plan.lora)."""
    if lora is not None:
        linear = 4.0 * matmul_params(m) + 6.0 * adapter_params(m, lora)
    else:
        linear = 6.0 * matmul_params(m)
    return linear * seq_len + 3.5 * attention_fwd_flops(m, seq_len, doc_lens)


__all__ = [
    "attention_fwd_flops",
    "layer_matmul_params",
    "matmul_params",
    "model_flops_per_sequence",
    "piece_squares",
    "square_fraction",
    "window_square_tokens",
]
