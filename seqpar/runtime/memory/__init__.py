"""Memory techniques applied to a transformers model: checkpointing policies, selective recompute, kept matmul outputs, host offload, tiled MLP, fused ops."""
