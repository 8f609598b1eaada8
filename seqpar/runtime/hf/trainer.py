"""The transformers ``Trainer`` (and TRL's ``SFTTrainer``, any subclass) in any seqpar mode: ``with_seqpar(Trainer)``.

    from trl import SFTTrainer
    from seqpar.runtime.hf.trainer import SeqparArguments, with_seqpar

    trainer = with_seqpar(SFTTrainer)(model=..., args=SFTConfig(...), train_dataset=..., seqpar=SeqparArguments(
        mode="zigzag_ring_attn", sp_degree=4))       # or SeqparArguments.from_plan("plan.json")
    trainer.train(); trainer.evaluate()

What changes, and why each piece is needed for exact numbers (launch with torchrun / accelerate launch as usual):
- groups: ranks are split into sequence-parallel groups of sp_degree consecutive ranks (global rank = dp_rank x sp +
  sp_rank, as seqpar.runtime.train.engine does), so the ranks that exchange K/V every layer share the fastest link.
- data: the train and eval loaders use a DistributedSampler over the dp_degree data-parallel groups, seeded with
  ``args.seed`` and indexed by the dp rank, so every rank of a group loads the same batch (accelerate's loader would give
  each rank its own). The loaders are not passed through ``accelerator.prepare``; the Trainer moves inputs to the device.
- inputs: ``compute_loss`` calls seqpar's ``prepare_inputs`` on the collated batch (labels shifted over the whole
  sequence, global position ids, packed documents' boundaries), runs the model on this rank's shard, and takes
  ``seqpar.loss``: the token mean over the group's whole sequences.
- uneven rows: the kernels attend causally over the whole row, so padding on the right is exact once its labels are
  masked (no real token attends to a later one); padding on the left or inside a row is refused. A row whose length the
  mode cannot split (packing's short last row, a padding-free batch, a row of a mixed-length batch) is padded to the
  split's multiple with masked labels (``uneven_rows="pad"``, the default: what padding to the multiple would give),
  or dropped from the data before the loader is built and counted (``uneven_rows="drop"``: ``seqpar_dropped`` and one
  log line).
- scaling: every engine the Trainer wraps (DDP, FSDP, DeepSpeed) averages gradients over all dp x sp ranks, while the
  group's gradient is the SUM of its ranks' shares (seqpar.runtime.parallel.loss). The loss goes through ``_scale_grad`` (forward
  identity, backward x sp_degree), so updates equal the single-process ones and the logged loss stays the true mean.
  The Trainer divides by the accumulation steps as usual (``loss_is_scaled_for_ga = False``).
- evaluation: ``prediction_step`` returns the group's exact loss and no logits (they are sharded); the Trainer's
  gather then averages over groups, so ``eval_loss`` is the same for every sp degree (transformers < 5.16 under its own
  context parallelism multiplied it by cp_size). The eval set must split evenly over the groups' batches (no padded
  duplicates), else a SeqparError names the sizes.
- exit: a script that ends after ``train()`` / ``evaluate()`` must exit 0. gloo's worker thread frees a finished
  collective's tensors itself (the eval loss gather is the last one), under the GIL; at the interpreter's teardown that
  aborts the process ("terminate called without an active exception"). The first trainer registers an exit hook that
  lets those threads finish while the interpreter is whole (seqpar.runtime.launch.stopping.settle).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import check_mode, degrees, split_multiple, splits_sequence, ulysses_arg
from seqpar.runtime.hf.apply import apply
from seqpar.runtime.parallel.inputs import prepare_inputs
from seqpar.runtime.parallel.loss import IGNORE_INDEX
from seqpar.runtime.parallel.loss import loss as group_loss

__all__ = ["SeqparArguments", "SeqparTrainerMixin", "even_rows", "with_seqpar"]

log = logging.getLogger(__name__)
UNEVEN_ROWS = ("pad", "drop")


@dataclass(frozen=True)
class SeqparArguments:
    """The seqpar side of a Trainer run: the mode, the sequence-parallel degree, usp's Ulysses degree and, optionally,
    seqpar's checkpointing policy (none | full | offload | selective; None leaves the Trainer's gradient_checkpointing)
    with its split over the layers (checkpoint_layers, offload_layers, offload_stride, kept_saves, kept_host_layers: the
    plan's fields, seqpar.apply's arguments) and the page-locked host GiB each process may hold for them
    (pinned_budget_gib: the plan's stated pinned_host_gib per rank; None = seqpar's default). uneven_rows: a row whose
    length the mode cannot split is padded to the split's multiple with masked labels ("pad") or dropped from the data
    and counted ("drop")."""

    mode: str
    sp_degree: int = 1
    ulysses_degree: int | None = None
    checkpointing: str | None = None
    checkpoint_layers: int | None = None
    offload_layers: int | None = None
    kept_saves: str = "all"
    kept_host_layers: int = 0
    pinned_budget_gib: float | None = None
    uneven_rows: str = "pad"
    offload_stride: int = 1

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.uneven_rows not in UNEVEN_ROWS:
            raise SeqparError(
                f"uneven_rows {self.uneven_rows!r} is not one of {', '.join(UNEVEN_ROWS)}; pad (rows padded to the mode's "
                "split with masked labels) or drop (rows the mode cannot split left out of the data, counted)"
            )
        if not splits_sequence(self.mode) and self.sp_degree != 1:
            raise SeqparError(f"{self.mode} keeps whole sequences: sp_degree must be 1, not {self.sp_degree}")
        degrees(self.mode, self.sp_degree, self.ulysses_degree)  # usp: ulysses_degree must divide sp_degree

    @classmethod
    def from_plan(cls, plan, uneven_rows: str = "pad") -> SeqparArguments:
        """The mode, degrees and checkpointing (with its split and pinned budget) of a LaunchPlan (or a plan file's path)."""
        from seqpar.plan.launch_plan import LaunchPlan

        p = plan if isinstance(plan, LaunchPlan) else LaunchPlan.load(plan)
        s = p.strategy
        u = ulysses_arg(s.mode, s.ulysses_degree)
        return cls(
            s.mode,
            s.sp_degree,
            u,
            s.checkpointing,
            s.checkpoint_layers,
            s.offload_layers,
            s.kept_saves,
            s.kept_host_layers,
            p.cluster.stated_pinned_gib_per_rank,
            uneven_rows,
            offload_stride=s.offload_stride,
        )

    @property
    def multiple(self) -> int:
        """The number a row's length must be a multiple of for the mode to split it over sp_degree ranks."""
        return split_multiple(self.mode, self.sp_degree, self.ulysses_degree)


def even_rows(inputs: dict[str, Any], multiple: int) -> dict[str, Any]:
    """A collated batch as seqpar's kernels take it: right padding (attention_mask 0 after the row's tokens) masked
    out of the labels, then every row padded on the right to a multiple of ``multiple`` tokens (labels -100; position ids,
    when given, a document of their own). Exact: attention is causal, so no real token attends to a padded one, and the
    padded ones score nothing. Left or inner padding is refused (real tokens would attend to it). Returns
    {"input_ids", "labels", "position_ids" (or None)}, each (B, S') with S' a multiple of ``multiple``."""
    ids = inputs["input_ids"]  # (B, S)
    labels = inputs.get("labels")  # None: the input ids themselves (prepare_inputs' default), unless padded below
    pos = inputs.get("position_ids")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise SeqparError(
                "the batch is padded on the left or inside a row (attention_mask holds a 0 before a 1), and seqpar's kernels "
                "attend causally over the whole row; pad on the right (tokenizer.padding_side = 'right'), pack examples "
                "(e.g. SFTConfig(packing=True)) or use padding-free batches with position_ids"
            )
        labels = (ids if labels is None else labels).masked_fill(mask == 0, IGNORE_INDEX)
    extra = -ids.shape[1] % multiple
    if extra:
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], extra)], dim=1)  # (B, S'): never attended to, never scored
        labels = ids[:, :-extra] if labels is None else labels
        labels = torch.cat([labels, labels.new_full((labels.shape[0], extra), IGNORE_INDEX)], dim=1)
        if pos is not None:
            pos = pos[None] if pos.dim() == 1 else pos
            tail = torch.arange(extra, dtype=pos.dtype, device=pos.device).expand(pos.shape[0], extra)
            pos = torch.cat([pos, tail], dim=1)  # the padding starts a document of its own
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _row_lengths(dataset) -> list[int]:
    """The token count of every row of a dataset with an input_ids column (an Arrow column read, for datasets)."""
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            import pyarrow.compute as pc

            return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
    except ImportError:
        pass
    return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


def _drop_uneven(dataset, multiple: int, description: str, why: str):
    """The rows whose length is a multiple of ``multiple``, and (rows, tokens) of those left out."""
    lengths = _row_lengths(dataset)
    keep = [i for i, n in enumerate(lengths) if n % multiple == 0]
    if len(keep) == len(lengths):
        return dataset, (0, 0)
    if not keep:
        raise SeqparError(
            f"none of the {len(lengths)} {description} rows has a length that is a multiple of {multiple} ({why}): "
            f"pack to a multiple of {multiple} (e.g. max_length), or SeqparArguments(uneven_rows='pad')"
        )
    dropped = (len(lengths) - len(keep), sum(n for i, n in enumerate(lengths) if n % multiple))
    kept = dataset.select(keep) if hasattr(dataset, "select") else torch.utils.data.Subset(dataset, keep)
    return kept, dropped


_exit_hook: list[bool] = []


def _settle_at_exit() -> None:
    """Once per process: settle torch.distributed's worker threads at exit, before the interpreter tears down (atexit
    hooks run while it is whole)."""
    if not _exit_hook:
        import atexit

        from seqpar.runtime.launch.stopping import settle

        atexit.register(settle)
        _exit_hook.append(True)


class _ScaleGrad(torch.autograd.Function):
    """Forward: the loss itself (what is logged); backward: the gradient times ``factor`` (the sp degree)."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _Loader(DataLoader):
    """A DataLoader whose ``set_epoch`` (called by the Trainer each epoch) reseeds its DistributedSampler."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class SeqparTrainerMixin:
    """Put before the Trainer class in the bases (``with_seqpar`` does it): ``class T(SeqparTrainerMixin, Trainer)``."""

    def __init__(self, *args, seqpar: SeqparArguments, **kwargs):
        super().__init__(*args, **kwargs)
        if not dist.is_initialized():
            raise SeqparError("seqpar's Trainer integration needs torch.distributed: launch with torchrun or accelerate launch")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % seqpar.sp_degree:
            raise SeqparError(f"sp_degree {seqpar.sp_degree} does not divide the {world} ranks; use a divisor of {world}")
        if seqpar.checkpointing is not None and self.args.gradient_checkpointing:
            raise SeqparError(
                f"checkpointing {seqpar.checkpointing!r} is seqpar's and args.gradient_checkpointing is the Trainer's: set "
                f"one (gradient_checkpointing=False, or SeqparArguments(checkpointing=None))"
            )
        self.seqpar = seqpar
        self.seqpar_dp_degree, self.seqpar_dp_rank, self.seqpar_sp_rank = (
            world // seqpar.sp_degree,
            rank // seqpar.sp_degree,
            rank % seqpar.sp_degree,
        )
        group = None
        for g in range(self.seqpar_dp_degree):  # new_group is collective: every rank builds every group, in order
            ranks = list(range(g * seqpar.sp_degree, (g + 1) * seqpar.sp_degree))
            made = dist.new_group(ranks)
            group = made if g == self.seqpar_dp_rank else group
        self.seqpar_group = group
        apply(
            self.model,
            seqpar.mode,
            group,
            seqpar.ulysses_degree,
            checkpointing=seqpar.checkpointing,
            checkpoint_layers=seqpar.checkpoint_layers,
            offload_layers=seqpar.offload_layers,
            kept_saves=seqpar.kept_saves,
            kept_host_layers=seqpar.kept_host_layers,
            pinned_budget_gib=seqpar.pinned_budget_gib,
            offload_stride=seqpar.offload_stride,
        )
        _settle_at_exit()
        self.model_accepts_loss_kwargs = False  # seqpar.loss is a mean over the group's tokens, not a sum over items
        self.loss_is_scaled_for_ga = False  # so the Trainer divides it by the accumulation steps
        self._seqpar_checked = False
        self.seqpar_dropped: dict[str, dict[str, int]] = {}  # uneven_rows="drop": per loader, what it left out

    # ----- data: every rank of a group loads the same batch

    def _seqpar_loader(self, dataset, description: str, batch_size: int, *, train: bool) -> DataLoader:
        collator = self.data_collator
        try:
            import datasets

            is_hf = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf = False
        if is_hf:
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        s = self.seqpar
        if s.uneven_rows == "drop" and s.multiple > 1:
            why = f"{s.mode} at sp_degree {s.sp_degree} splits a row into multiples of {s.multiple}"
            dataset, (rows, tokens) = _drop_uneven(dataset, s.multiple, description, why)
            self.seqpar_dropped[description] = {"rows": rows, "tokens": tokens, "kept_rows": len(dataset)}
            if rows and dist.get_rank() == 0:
                log.warning(
                    "seqpar dropped %d %s rows (%d tokens) whose length is not a multiple of %d (%s); %d rows remain. "
                    "SeqparArguments(uneven_rows='pad') pads them instead.", rows, description, tokens, s.multiple, why,
                    len(dataset),
                )  # fmt: skip
        dp, dp_rank = self.seqpar_dp_degree, self.seqpar_dp_rank
        if not train and len(dataset) % (dp * batch_size):
            raise SeqparError(
                f"the eval set's {len(dataset)} examples do not split into batches of {batch_size} over {dp} data-parallel "
                f"groups (a multiple of {dp * batch_size} does); trim or pad the eval set so no example counts twice"
            )
        sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=train, seed=self.args.seed)
        return _Loader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collator,
            drop_last=self.args.dataloader_drop_last,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise SeqparError("training needs a train_dataset")
        return self._seqpar_loader(self.train_dataset, "training", self._train_batch_size, train=True)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise SeqparError("evaluation needs an eval_dataset")
        return self._seqpar_loader(dataset, "evaluation", self.args.eval_batch_size, train=False)

    # ----- the loss: prepare_inputs, the model on this rank's shard, seqpar.loss over the group

    def _seqpar_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        s = self.seqpar
        rows = even_rows(inputs, s.multiple)
        check = self.seqpar_group if not self._seqpar_checked else None  # once: every rank of a group holds the same batch
        shard = prepare_inputs(
            rows["input_ids"],
            s.mode,
            self.seqpar_sp_rank,
            s.sp_degree,
            labels=rows["labels"],
            position_ids=rows["position_ids"],
            ulysses_degree=s.ulysses_degree,
            check_group=check,
            require_scored=False,  # a packed row may hold no assistant token; the loss is the group's scored-token mean
        )
        self._seqpar_checked = True
        docs = {}
        if "cu_seqlens" in shard:  # packed documents: transformers' names reach seqpar's attention
            docs = {"cu_seq_lens_q": shard["cu_seqlens"], "cu_seq_lens_k": shard["cu_seqlens"]}
        out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False, **docs)
        return group_loss(out.logits.float(), shard["labels"], self.seqpar_group)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        loss = self._seqpar_loss(model, inputs)
        if torch.is_grad_enabled():
            loss = _ScaleGrad.apply(loss, float(self.seqpar.sp_degree))
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """The group's exact loss on the batch; no logits (each rank holds a shard of them)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self._seqpar_loss(model, inputs)
        return loss.detach(), None, None


def with_seqpar(trainer_cls: type) -> type:
    """``trainer_cls`` (transformers.Trainer, trl.SFTTrainer, ...) with SeqparTrainerMixin first in its bases."""
    return type(f"Seqpar{trainer_cls.__name__}", (SeqparTrainerMixin, trainer_cls), {})
