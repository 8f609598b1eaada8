"""The sequence-parallel modes and what they share: the attention entry point, kernels, documents, communication, layout, inputs and the loss."""
