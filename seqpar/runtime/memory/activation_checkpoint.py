"""Activation checkpointing: the plan's ``checkpointing`` policy applied to a transformers model, in one place.

``seqpar.apply(model, mode, checkpointing=...)`` calls ``apply_checkpointing``; the trainer calls ``seqpar.apply`` with the
plan's ``strategy.checkpointing``, so the API, the trainer and the CLI's plans all go through here (torchtitan's
activation_checkpoint.py: one function applies one policy).

| policy    | what backward recomputes                          | how                                                            |
|-----------|---------------------------------------------------|----------------------------------------------------------------|
| none      | nothing                                           | the model's own checkpointing switched off                     |
| full      | every decoder layer                               | transformers' layer checkpointing, non-reentrant               |
| offload   | every decoder layer; its input waits in host RAM  | reentrant checkpointing under seqpar.runtime.memory.offload (Unsloth) |
| offload, offload_stride k | every layer; 1 input in k in host RAM, the others rebuilt from it in backward | the same; a recipe saved in place of the others (nested checkpointing) |
| selective | every layer but attention: its out + lse are kept | non-reentrant, and seqpar.runtime.memory.selective in the attention   |

The split (the plan's ``checkpoint_layers`` and ``offload_layers``; Megatron's recompute_num_layers with its block method
and its cpu_offloading_num_layers): the policy applies to the first ``checkpoint_layers`` decoder layers only; the last
ones keep all their activations and recompute nothing (memory-budget checkpointing: the memory a step leaves unused buys
back their recomputation). Under offload, the first ``offload_layers`` of the checkpointed layers send their input to
host memory and the others keep it on the GPU (plain non-reentrant checkpointing, as ``full``). Unset = every layer.
The stride (the plan's ``offload_stride`` k): of the offloaded layers only the first and every k-th after it send
their input to host memory; backward recomputes each other one's input from the nearest of those below, one more
forward of the layers between (seqpar.runtime.memory.strided_offload.StridedOffload: a group of k layers runs k - 1 more layer
forwards and holds up to k - 1 layer inputs on the GPU at once), for 1/k of the host memory. 1 = every offloaded
layer sends its own.
Under selective, seqpar.apply keeps attention's out + lse in the checkpointed layers only: the others never recompute,
so a kept entry there would only hold a fingerprint of q and references until backward.
Layers are transformers' GradientCheckpointingLayer instances in module order (``decoder_layers``): each has its own
``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``, which is all a split needs.

Adding a policy: a row in ``POLICIES`` (and a branch in ``apply_checkpointing`` if it needs more than those switches).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

from seqpar.plan.errors import SeqparError
from seqpar.plan.options import CHECKPOINTING, KEPT_SAVES, layer_split
from seqpar.plan.rules import kept_problems, split_problems


@dataclass(frozen=True)
class Policy:
    name: str
    use_reentrant: bool | None  # torch.utils.checkpoint's use_reentrant; None: no checkpointing
    offload: bool  # each layer's input kept in (pinned) host memory until backward
    keep_attention: bool  # attention keeps its out + lse for the recomputation (seqpar.runtime.memory.selective)


# One row per name of seqpar.plan.options.CHECKPOINTING (the plan's values), in its order.
POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("none", None, False, False),
        Policy("full", False, False, False),
        Policy("offload", True, True, False),
        Policy("selective", False, False, True),
    )
}
assert tuple(POLICIES) == CHECKPOINTING, "seqpar.plan.options.CHECKPOINTING and POLICIES must name the same policies"


def policy(name: str) -> Policy:
    if name not in POLICIES:
        raise SeqparError(f"checkpointing {name!r} is unknown; use one of {', '.join(POLICIES)}")
    return POLICIES[name]


def from_deprecated(checkpointing: str | None, offload_checkpoints: bool | None, keep_attention: bool | None) -> str | None:
    """The policy the old booleans ask for (with a DeprecationWarning), or ``checkpointing`` when they are not passed."""
    old = {k: v for k, v in (("offload_checkpoints", offload_checkpoints), ("keep_attention", keep_attention)) if v is not None}
    if not old:
        return checkpointing
    warnings.warn(
        f"seqpar.apply({', '.join(f'{k}={v}' for k, v in old.items())}) is deprecated; pass "
        "checkpointing='offload' (offload_checkpoints) or checkpointing='selective' (keep_attention)",
        DeprecationWarning,
        stacklevel=3,
    )
    if offload_checkpoints and keep_attention:
        raise SeqparError(
            "keep_attention (selective checkpointing) and offload_checkpoints exclude each other: pick one checkpointing policy"
        )
    implied = "offload" if offload_checkpoints else "selective" if keep_attention else None
    if implied is not None and checkpointing not in (None, implied):
        raise SeqparError(
            f"checkpointing={checkpointing!r} contradicts {', '.join(f'{k}={v}' for k, v in old.items())}; "
            "pass checkpointing alone"
        )
    return checkpointing if implied is None else implied


def _checkpoint_layers(model, use_reentrant: bool) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)  # 5.x name; the old one warns there
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def is_checkpointing(model) -> bool:
    """Whether the model's layers checkpoint (transformers 5's name first; 4.x has the older one)."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


def _stop_checkpointing(model) -> None:
    if is_checkpointing(model):
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


def _offloaded_checkpoint(function, *args, pinned_budget_gib: float | None = None, **kwargs):
    """Checkpoint one layer with its inputs kept in (pinned) host memory until backward (the Unsloth variant).

    Reentrant checkpointing saves exactly the layer inputs with save_for_backward, so the offload hooks move just those
    (B, S, hidden) tensors to the host (pinned within a budget, seqpar.runtime.memory.offload.pinned_budget); the recomputation
    in backward brings them back."""
    from torch.utils.checkpoint import checkpoint

    from seqpar.runtime.memory.offload import HostOffload, pinned_budget

    kwargs.pop("use_reentrant", None)
    with HostOffload(pinned_budget(pinned_budget_gib)):
        return checkpoint(function, *args, use_reentrant=True, **kwargs)


def _drop_matmul_keeps(model) -> None:
    """A layer still running under an earlier kept_saves matmuls (seqpar.apply called again) loses its hooks first."""
    from seqpar.runtime.memory.matmul_keep import MatmulKeep

    for module in model.modules():
        f = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(f, MatmulKeep):
            f.remove()


def decoder_layers(model) -> list:
    """The model's decoder layers in order: transformers' GradientCheckpointingLayer instances in module order (4.52+).

    SeqparError when there are none, or when their number is not the config's num_hidden_layers (a model with more
    than one stack of them, e.g. a vision tower, whose split would be ambiguous)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers before 4.52: the model checkpoints its layers in its own forward
        GradientCheckpointingLayer = None
    layers = [m for m in model.modules() if GradientCheckpointingLayer is not None and isinstance(m, GradientCheckpointingLayer)]
    expected = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not layers or (isinstance(expected, int) and len(layers) != expected):
        raise SeqparError(
            f"{type(model).__name__}: checkpoint_layers/offload_layers split the decoder layers, but "
            f"{len(layers)} transformers GradientCheckpointingLayer modules were found for config.num_hidden_layers "
            f"{expected}; use a decoder-only model on transformers >= 4.52, or leave checkpoint_layers and offload_layers unset"
        )
    return layers


def apply_checkpointing(
    model,
    name: str,
    checkpoint_layers: int | None = None,
    offload_layers: int | None = None,
    kept_saves: str = "all",
    kept_host_layers: int = 0,
    pinned_budget_gib: float | None = None,
    offload_stride: int = 1,
) -> Policy:
    """Switch the model's activation checkpointing to the policy ``name``; returns the policy.

    checkpoint_layers: the policy applies to the first k decoder layers only, the rest keep their activations (None =
    all). offload_layers: under offload, the first k checkpointed layers send their input to host memory, the others
    keep it on the GPU (None = all). offload_stride k: of those, only the first and every k-th after it send their
    input to host memory, backward recomputes the others' (seqpar.runtime.memory.strided_offload.StridedOffload; 1 = each its
    own). kept_saves "matmuls": the layers past checkpoint_layers keep only their matmul
    outputs (seqpar.runtime.memory.matmul_keep), ``kept_host_layers`` of them in host memory (spread: LayerSplit.host_kept). pinned_budget_gib: the
    page-locked host GiB this process's offloaded inputs and host-kept outputs may hold together (the plan's
    ClusterSpec.stated_pinned_gib_per_rank; None = seqpar.runtime.memory.offload.pinned_budget's default). The attention side of
    ``selective`` (keeping out + lse) is switched by seqpar.apply, which reads the returned policy and the layers' flags.
    Call it after any gradient_checkpointing_enable() of your own: that call would put back the plain checkpoint function
    that ``offload`` replaces."""
    p = policy(name)
    if kept_saves not in KEPT_SAVES:
        raise SeqparError(f"kept_saves {kept_saves!r} is unknown; use one of {', '.join(KEPT_SAVES)}")
    if isinstance(offload_stride, bool) or not isinstance(offload_stride, int) or offload_stride < 1:
        raise SeqparError(
            f"offload_stride {offload_stride!r} is not a whole number >= 1; use 1 (every offloaded layer sends its own "
            "input to host memory) or more"
        )
    split = checkpoint_layers is not None or offload_layers is not None or offload_stride > 1
    layers = decoder_layers(model) if split or kept_saves != "all" or kept_host_layers else []
    owner = type(model).__name__
    problems = split_problems(name, checkpoint_layers, offload_layers, len(layers), owner, offload_stride) if split else []
    if not problems and layers:
        problems = kept_problems(name, checkpoint_layers, offload_layers, kept_saves, kept_host_layers, False, len(layers), owner)
    if problems:
        raise SeqparError(problems[0])
    _drop_matmul_keeps(model)
    if p.use_reentrant is None:
        _stop_checkpointing(model)
        return p
    _checkpoint_layers(model, p.use_reentrant)
    if p.offload:
        for module in model.modules():
            if hasattr(module, "gradient_checkpointing"):
                module._gradient_checkpointing_func = functools.partial(
                    _offloaded_checkpoint, pinned_budget_gib=pinned_budget_gib
                )
    cut = layer_split(name, len(layers), checkpoint_layers, offload_layers, kept_saves, kept_host_layers, offload_stride)
    ckpt, off = cut.checkpointed, cut.host  # host, then GPU-checkpointed, then kept (host-kept ones spread among them)
    if cut.matmuls:
        from seqpar.runtime.memory.matmul_keep import MatmulKeep

        previous, on_host = None, set(cut.host_kept)
        for i, layer in enumerate(layers[ckpt:], start=ckpt):
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = previous = MatmulKeep(layer, i in on_host, previous, pinned_budget_gib)
        layers = layers[:ckpt]  # the split below sets the checkpointed ones
    if split:
        from torch.utils.checkpoint import checkpoint

        from seqpar.runtime.memory.strided_offload import OffloadChain, StridedOffload

        plain = functools.partial(checkpoint, use_reentrant=False)
        chain = OffloadChain(cut.stride) if p.offload and cut.stride > 1 else None  # one per model: its forwards' records
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < ckpt  # the last layers keep their activations: nothing to recompute
            if p.offload and i >= off:
                layer._gradient_checkpointing_func = plain  # checkpointed, its input kept on the GPU
            elif chain is not None:
                layer._gradient_checkpointing_func = StridedOffload(chain, i, pinned_budget_gib)
    if p.offload and (not split or off > 0):
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is not None and not embeddings.weight.requires_grad:
            model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    return p
