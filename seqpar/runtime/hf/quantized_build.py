"""A 4-bit (QLoRA) base built one piece at a time, so the model never exists whole in 16 bits.

Why: quantizing after building (seqpar.runtime.hf.lora.quantize_base on a whole model) needs the whole model in the
plan's dtype first. Llama-3.3-70B holds 141 GB of weights in bf16: random weights created on an 80 GB GPU run out of
memory before training starts, and a ``--model-path`` folder loaded whole runs out of a 125 GiB host, while its 4-bit
base (the steady state the plan prices, seqpar.advisor.cost.lora) fits. Here the model is built on the meta device
(shapes, no storage) and then materialized on the run's device piece by piece, in the model's order:

* a decoder layer (the model's ``_no_split_modules``, the unit transformers itself never splits): allocated in the
  plan's dtype, filled, and its linear layers (seqpar.plan.specs.LORA_ALL_LINEAR) replaced at once by bitsandbytes'
  NF4 ``Linear4bit`` through quantize_base itself (so the same modules, quantized on the same device: the same bits as
  the build-then-quantize path), which drops the layer's 16-bit weights before the next layer is allocated;
* every other module holding tensors (embeddings, norms, RoPE, the output head): allocated and filled in the plan's
  dtype, as QLoRA keeps them; a head tied to the embeddings is tied again at the end, never allocated on its own.

The peak is so the steady state plus one decoder layer in the plan's dtype (and bitsandbytes' temporaries for one
linear layer while it quantizes).

Where the values come from:

* random (no folder): transformers' own init, the model's ``_init_weights`` applied to each module of the piece as
  ``PreTrainedModel.initialize_weights`` applies it (children first, under
  ``transformers.initialization.guard_torch_init_functions``; transformers 5.25, modeling_utils.py), drawn after
  seeding torch with a number made of the run's seed and the piece's name. Every rank so draws the same values without
  any transfer (each quantizes its own copy: quantization is deterministic). The seed does not depend on the device;
  the numbers are that device's generator's (CPU and CUDA draw different values from one seed), so a job, whose ranks
  share a device type, agrees with itself;
* a save_pretrained folder (``--model-path``) or a checkpoint (``--init-from``): each tensor read from its safetensors
  file when its piece is allocated (``safe_open``, one tensor at a time, a file mapped only while a piece reads from
  it), cast to the piece's dtype, after every name and shape was checked against the model from the headers alone
  (one line naming the folder, before anything is allocated). The read tensors are marked as transformers' loader
  marks them (``_is_hf_initialized``), so the same init pass then fills only what no file holds (RoPE's
  non-persistent ``inv_freq``), as ``from_pretrained`` does.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from seqpar.plan.errors import SeqparError
from seqpar.plan.safe import printable


def tied_names(model) -> set[str]:
    """Names a checkpoint may leave out because they share another's storage: a tied model's output head."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return set(getattr(model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}


@dataclass(frozen=True)
class FolderWeights:
    """The safetensors tensors a 4-bit build reads: {name: (file, shape)} from the headers (seqpar.runtime.hf.model's
    weight_index or checkpoint_index). ``label`` names the source in error lines; ``checkpoint``: a ``--init-from``
    folder, which must hold exactly the model's tensors (as load_weights requires), where a model folder may hold more."""

    index: dict[str, tuple[Path, list[int]]]
    label: str
    checkpoint: bool = False

    def check(self, wanted: dict[str, torch.Size]) -> None:
        """SeqparError (one line) unless every tensor in ``wanted`` ({name: shape}) is in the files with its shape."""
        missing = sorted(set(wanted) - set(self.index))
        unexpected = sorted(set(self.index) - set(wanted)) if self.checkpoint else []
        fix = "resume with the plan that wrote it" if self.checkpoint else "pass a complete folder"
        wrong = [f"it lacks {len(missing)} of the model's tensors (e.g. {printable(missing[0])})"] if missing else []
        if unexpected:
            wrong.append(f"it holds {len(unexpected)} tensors the model does not have (e.g. {printable(unexpected[0])})")
        if wrong:
            raise SeqparError(f"{self.label} does not fit the model: {' and '.join(wrong)}; {fix}")
        for name, shape in wanted.items():
            if list(shape) != self.index[name][1]:
                raise SeqparError(
                    f"{self.label} does not fit the model: its tensor {printable(name)} has shape "
                    f"{self.index[name][1]}, the model's has {list(shape)}; "
                    f"{fix if self.checkpoint else 'restore the folder or write it again with save_pretrained'}"
                )

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors ``names`` on the host, one at a time, each file opened once per call and closed after."""
        from safetensors import SafetensorError, safe_open

        by_file = sorted(names, key=lambda n: str(self.index[n][0]))
        for path, group in itertools.groupby(by_file, key=lambda n: self.index[n][0]):
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in group:
                        yield name, f.get_tensor(name)
            except (SafetensorError, OSError) as e:  # torn after its header was read
                first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
                raise SeqparError(
                    f"{self.label}: {printable(path.name)} cannot be read ({printable(first)}); restore the folder or "
                    "write it again with save_pretrained"
                ) from None


def materialize_4bit(
    model: nn.Module,
    weights: FolderWeights | None,
    *,
    seed: int,
    device,
    compute_dtype: torch.dtype | None = None,
) -> int:
    """Allocate ``model`` (built on the meta device) on ``device`` piece by piece, each decoder layer's linear layers
    quantized to NF4 as soon as the layer holds its values; values from ``weights``, or transformers' init seeded by
    ``seed`` and the piece's name when None. Returns how many linear layers became 4-bit. The global RNG is left seeded
    with ``seed`` (every rank in the same state after the build)."""
    from transformers import initialization as hf_init

    from seqpar.runtime.hf.lora import quantize_base

    device = torch.device(device)
    tied = tied_names(model)
    pieces = list(_pieces(model, tied))
    if weights is not None:  # every name and shape, from the headers, before anything is allocated
        weights.check({t: v.shape for name, piece, layer in pieces for t, v in _tensors(piece, layer, tied, prefix=name)})
    quantized = 0
    for name, piece, layer in pieces:
        piece.to_empty(device=device, recurse=layer)
        own = dict(_tensors(piece, layer, tied, prefix=name))
        if weights is not None:
            with torch.no_grad():
                for tname, value in weights.read(list(own)):
                    own[tname].copy_(value)
                    own[tname]._is_hf_initialized = True  # what from_pretrained marks: the init pass skips it
                    del value
        else:
            torch.manual_seed(piece_seed(seed, name))
        with torch.no_grad(), hf_init.guard_torch_init_functions():
            if layer:
                piece.apply(model._init_weights)  # children first, as initialize_weights walks the model
            else:
                model._init_weights(piece)
        del own
        if layer:
            quantized += quantize_base(piece, device=device, compute_dtype=compute_dtype)
    if tied:
        model.tie_weights()
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:  # a tensor no piece owns: a model layout this builder does not know
        raise SeqparError(
            f"{type(model).__name__}: the 4-bit build left {printable(left[0])} unallocated; use workload.lora.base_dtype "
            "bf16 for this model"
        )
    torch.manual_seed(seed)
    return quantized


def piece_seed(seed: int, name: str) -> int:
    """The seed of one piece's random values: the run's seed and the piece's name, nothing of the device or the rank."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _pieces(model: nn.Module, tied: set[str]) -> Iterator[tuple[str, nn.Module, bool]]:
    """(name, module, is a decoder layer) in the model's order: each decoder layer whole, and every other module that
    holds tensors of its own (but a tied head, whose weight is the embeddings')."""
    layers = set(getattr(model, "_no_split_modules", None) or ())
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p) for p in inside):
            continue
        if type(module).__name__ in layers:
            inside.append(f"{name}.")
            yield name, module, True
            continue
        own = list(_tensors(module, False, set(), prefix=name, persistent_only=False))
        if own and not all(n in tied for n, _ in own):
            yield name, module, False


def _tensors(
    module: nn.Module, recurse: bool, tied: set[str], *, prefix: str | None = None, persistent_only: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(full name, tensor) of ``module``'s parameters and persistent buffers (all buffers unless ``persistent_only``),
    named as the model's state dict names them, tied ones left out."""
    mods = module.named_modules(prefix=prefix or "") if recurse else [(prefix or "", module)]
    for mname, m in mods:
        for pname, p in m.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full not in tied:
                yield full, p
        for bname, b in m.named_buffers(recurse=False):
            if b is not None and not (persistent_only and bname in m._non_persistent_buffers_set):
                yield (f"{mname}.{bname}" if mname else bname), b


__all__ = ["FolderWeights", "materialize_4bit", "piece_seed", "tied_names"]
