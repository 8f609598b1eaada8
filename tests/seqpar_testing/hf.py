"""Tiny transformers models built from configs (no hub) and the comparison of a loss and its gradients with plain
transformers': what the hf, memory and eval tests share.

``make_model(family)`` builds a seeded random-weight causal LM of Llama (MHA), Mistral (GQA), Qwen2 (GQA, qkv bias) or
Qwen3 (q/k norm); ``group_grads`` sums a model's gradients over the sequence-parallel group; ``compare_loss_and_grads``
appends an assert_close message per mismatch, so a rank reports every failing case at once. ``packed_batch`` packs
documents of known lengths into rows and ``per_document_reference`` runs each document alone (the packed tests' reference).
``plain_state`` copies a 4-bit model's values dequantized (the 4-bit tests' reference).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

B, S = 2, 32  # batch > 1; S divisible by 2W for W = 4 and by 2*R*U for usp
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def families() -> list[str]:
    """The families this transformers version has (Qwen3 arrived in 4.51; the suite also runs on 4.48)."""
    import transformers

    return [f for f in FAMILIES if f != "qwen3" or hasattr(transformers, "Qwen3ForCausalLM")]


def make_model(family: str):
    """A tiny random-weight causal LM, built from a config (no hub), seeded so every rank builds the same weights."""
    import transformers

    common = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    kinds = {  # (config class, model class, extra config)
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
        # Mistral keeps its default 4096-token sliding window: longer than S, so full causal attention is exact
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    }
    config_name, model_name, extra = kinds[family]
    config, cls = getattr(transformers, config_name)(**common, **extra), getattr(transformers, model_name)
    torch.manual_seed(0)
    model = cls(config).float()
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # the qkv-bias case is really covered
    return model


def batch():
    """(input_ids, labels) of shape (B, S), part of the labels masked."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (B, S), generator=g)  # (B, S)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt: shards hold different numbers of counted tokens
    labels[1, 20:23] = -100
    return ids, labels


def available_modes() -> list[str]:
    from seqpar.plan.modes import names

    return list(names())


def param_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where it has none)."""
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def group_grads(model) -> dict[str, torch.Tensor]:
    """The sequence-parallel group's gradient of every parameter: the sum of its ranks' (one all-reduce)."""
    import torch.distributed as dist

    grads = param_grads(model)
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    dist.all_reduce(flat)
    return {n: g.view_as(grads[n]) for n, g in zip(grads, flat.split([g.numel() for g in grads.values()]))}


def compare_loss_and_grads(failures: list, case: str, loss, ref_loss, grads: dict, ref_grads: dict) -> None:
    """Append to ``failures`` what differs: the loss (fp32 round-off), then the first gradient outside 1e-5 relative."""
    try:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        failures.append(f"{case} loss: {e}")
    for name, ref in ref_grads.items():
        try:  # relative error <= 1e-5 of the tensor's scale (elementwise rtol alone fails on entries near zero)
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        except AssertionError as e:
            failures.append(f"{case} grad {name}: {e}")
            return


# packed rows: documents of these lengths fill the S tokens of a row (OTHER: a row with other boundaries)
LENGTHS, OTHER = (7, 1, 12, 3, 9), (20, 4, 8)


def _bounds(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def packed_batch(rows=(LENGTHS, LENGTHS)):
    """(ids, labels, position ids) of B rows, each packing documents of the given lengths."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (len(rows), S), generator=g)  # (B, S)
    labels = ids.clone()
    labels[:, 8:11] = -100  # a masked prompt inside the third document
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])  # (B, S)
    return ids, labels, pos


def per_document_reference(base, ids, labels, rows):
    """Token-weighted mean cross-entropy of every document run alone through plain transformers, and its gradients."""
    base.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for b, lengths in enumerate(rows):
        bounds = _bounds(lengths)
        for a, e in zip(bounds, bounds[1:]):
            logits = base(input_ids=ids[b : b + 1, a:e]).logits[0, :-1]  # (l-1, V)
            target = labels[b, a + 1 : e]
            total = total + F.cross_entropy(logits.float(), target, ignore_index=-100, reduction="sum")
            count += int((target != -100).sum())
    loss = total / count
    loss.backward()
    return loss.detach(), param_grads(base)


def char_model(folder: Path) -> str:
    """A local model folder with a character tokenizer (printable ASCII, newline, <s>, </s>) and a tiny random Llama."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = ["<s>", "</s>", "[UNK]", "\n"] + [chr(c) for c in range(32, 127)]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


def cuda_llama(hidden=1024, layers=8, vocab=4096, heads=8, kv_heads=8):
    """A seeded random-weight Llama in bf16 on the GPU (the GPU tests' model)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=65536,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def plain_state(model) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s parameters and persistent buffers on the host by name, a 4-bit weight dequantized
    (seqpar.runtime.checkpoint.adapter.dequantized); bitsandbytes' quantization statistics are left out: what a plain
    model with the 4-bit model's values loads, the reference the 4-bit tests hold the runtime to."""
    from seqpar.runtime.checkpoint.adapter import dequantized, is_4bit

    out = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        for pname, p in module.named_parameters(recurse=False):
            t = dequantized(module) if (is_4bit(module) and pname == "weight") else p.detach()
            out[prefix + pname] = t.to(device="cpu", copy=True)
        for bname, b in module.named_buffers(recurse=False):
            if b is not None and bname not in module._non_persistent_buffers_set:
                out[prefix + bname] = b.detach().to(device="cpu", copy=True)
    return out
