"""The words seqpar's answers use, explained once for `seqpar --help` and `seqpar advise --help` (markdown)."""

GLOSSARY = """**Words in the answers**

- **sp / dp**: the sequence-parallel degree (ranks that share one sequence) and the data-parallel degree (groups that
  each train their own sequences); sp x dp = the ranks.
- **modes**: zigzag_ring_attn passes keys and values around a ring, balanced for causal attention; dist_flash_attn
  balances the ring's work by pairs; ulysses_attn splits heads with all-to-alls; usp_attn is Ulysses groups x a ring.
- **zero2 / zero3**: DeepSpeed ZeRO shards the optimizer state and gradients (2), and the weights too (3);
  **zero3_offload** keeps them in host RAM; **fsdp** is PyTorch's FSDP2 (like zero3); **ddp** shards nothing.
- **checkpointing**: activations recomputed in backward instead of kept; **selective**: the first N layers only;
  **offload**: the layer inputs kept in host RAM.
- **chunked loss**: the loss over the logits a chunk of tokens at a time, never the whole fp32 logits.
- **tiled MLP** / **fused ops**: each MLP a tile of tokens at a time; Liger-Kernel's fused RMSNorm, RoPE, SwiGLU.
- **MFU**: model FLOPs utilization, the model's FLOPs per second over the GPUs' datasheet peak.
- **bill**: predicted wall time and GPU-hours of the training steps of the whole run.
"""

__all__ = ["GLOSSARY"]
