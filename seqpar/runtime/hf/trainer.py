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
  ``seqpar.loss``: the token mean over the group's whole sequences. Padding masks are refused (the kernels are causal
  over the whole row): pack to a fixed length, or use padding-free batches with position_ids.
- scaling: every engine the Trainer wraps (DDP, FSDP, DeepSpeed) averages gradients over all dp x sp ranks, while the
  group's gradient is the SUM of its ranks' shares (seqpar.runtime.parallel.loss). The loss goes through ``_scale_grad`` (forward
  identity, backward x sp_degree), so updates equal the single-process ones and the logged loss stays the true mean.
  The Trainer divides by the accumulation steps as usual (``loss_is_scaled_for_ga = False``).
- evaluation: ``prediction_step`` returns the group's exact loss and no logits (they are sharded); the Trainer's
  gather then averages over groups, so ``eval_loss`` is the same for every sp degree (transformers < 5.16 under its own
  context parallelism multiplied it by cp_size). The eval set must split evenly over the groups' batches (no padded
  duplicates), else a SeqparError names the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import check_mode, degrees, splits_sequence, ulysses_arg
from seqpar.runtime.hf.apply import apply
from seqpar.runtime.parallel.inputs import prepare_inputs
from seqpar.runtime.parallel.loss import loss as group_loss

__all__ = ["SeqparArguments", "SeqparTrainerMixin", "with_seqpar"]


@dataclass(frozen=True)
class SeqparArguments:
    """The seqpar side of a Trainer run: the mode, the sequence-parallel degree, usp's Ulysses degree and, optionally,
    seqpar's checkpointing policy (none | full | offload | selective; None leaves the Trainer's gradient_checkpointing)
    with its split over the layers (checkpoint_layers, offload_layers, kept_saves, kept_host_layers: the plan's fields,
    seqpar.apply's arguments) and the page-locked host GiB each process may hold for them (pinned_budget_gib: the
    plan's stated pinned_host_gib per rank; None = seqpar's default)."""

    mode: str
    sp_degree: int = 1
    ulysses_degree: int | None = None
    checkpointing: str | None = None
    checkpoint_layers: int | None = None
    offload_layers: int | None = None
    kept_saves: str = "all"
    kept_host_layers: int = 0
    pinned_budget_gib: float | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if not splits_sequence(self.mode) and self.sp_degree != 1:
            raise SeqparError(f"{self.mode} keeps whole sequences: sp_degree must be 1, not {self.sp_degree}")
        degrees(self.mode, self.sp_degree, self.ulysses_degree)  # usp: ulysses_degree must divide sp_degree

    @classmethod
    def from_plan(cls, plan) -> SeqparArguments:
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
        )


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
        )
        self.model_accepts_loss_kwargs = False  # seqpar.loss is a mean over the group's tokens, not a sum over items
        self.loss_is_scaled_for_ga = False  # so the Trainer divides it by the accumulation steps
        self._seqpar_checked = False

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
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise SeqparError(
                "the batch is padded (attention_mask holds zeros), and seqpar's kernels attend causally over the whole row; "
                "pack examples to one length (e.g. SFTConfig(packing=True, packing_strategy='wrapped')) or use padding-free "
                "batches with position_ids"
            )
        s = self.seqpar
        check = self.seqpar_group if not self._seqpar_checked else None  # once: every rank of a group holds the same batch
        shard = prepare_inputs(
            ids,
            s.mode,
            self.seqpar_sp_rank,
            s.sp_degree,
            labels=inputs.get("labels"),
            position_ids=inputs.get("position_ids"),
            ulysses_degree=s.ulysses_degree,
            check_group=check,
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
