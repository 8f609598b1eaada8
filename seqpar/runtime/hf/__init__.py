"""The transformers integration: any Hugging Face causal LM in any seqpar mode, the Trainer wrapper, EasyContext's entry points, and the model a run trains."""
