"""The memory tests' model: a tiny 4-layer transformers Llama (enough layers for a checkpointing split with two ends and
a middle), its batch, its un-checkpointed reference, the bytes a forward saves for backward, and the allocation replay
that finds what a step holds at its peak."""

from __future__ import annotations

import torch

from seqpar_testing.hf import param_grads

L, B, S, HIDDEN = 4, 2, 32, 32


def make_model(layers: int = L, dtype=torch.float32):
    """A tiny random-weight Llama with ``layers`` layers in ``dtype``, seeded so every rank builds the same weights."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def batch():
    """(input_ids, labels) of shape (B, S), the first sequence's prompt masked."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (B, S), generator=g)  # (B, S)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def reference():
    """The un-checkpointed model, its loss on ``batch()`` and every parameter's gradient (the model's grads cleared)."""
    ids, labels = batch()
    base = make_model()
    ref = base(input_ids=ids, labels=labels)
    ref.loss.backward()
    grads = param_grads(base)
    base.zero_grad(set_to_none=True)
    return base, ref.loss.detach(), grads


def saved_bytes(model, ids) -> tuple[dict, int, object]:
    """Bytes saved for backward during one forward: per decoder layer (each storage counted once per layer: RoPE's
    cos/sin, shared by the layers, count in each that saves them) and in all (each storage once; the memory they
    hold); parameters are left out (they exist either way). Returns (per layer, total, the loss)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    per_layer, total, where = {}, {}, [None]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            per_layer.setdefault(where[0], {})[storage.data_ptr()] = storage.nbytes()
            total[storage.data_ptr()] = storage.nbytes()
        return t

    handles = []
    for i, layer in enumerate(model.model.layers):  # hooks on __call__: transformers checkpoints forward, inside them
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, None)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    for h in handles:
        h.remove()
    return {k: sum(v.values()) for k, v in per_layer.items()}, sum(total.values()), loss


def allocation_peak(fn):
    """Run ``fn`` under torch's profiler and replay its allocations and frees: the peak of what ``fn`` allocated on top
    of what was live before it (from the allocator's running total each event carries, so events of the same
    nanosecond cannot reorder it), and the tensors live then as (bytes, allocating op), replayed in time order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(e, parent):
        for child in e.children:
            walk(child, e)
        if e.tag == torch._C._profiler._EventType.Allocation:
            f = e.extra_fields
            events.append((e.start_time_ns, f.total_allocated, f.ptr, f.alloc_size, parent.name if parent else "?"))

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    events.sort()
    if not events:
        return 0, []
    base = events[0][1] - events[0][3]
    top = max(range(len(events)), key=lambda k: events[k][1])
    live = {}
    for _, _, ptr, size, op in events[: top + 1]:
        if size > 0:
            live[ptr] = (size, op)
        else:
            live.pop(ptr, None)
    return events[top][1] - base, list(live.values())
