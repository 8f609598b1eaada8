"""The best strategy a tool can express for a plan's workload on its cluster (``seqpar advise --emit TOOL``).

The tool's space is the advisor's own search (seqpar.advisor.search: ``enumerate_strategies``, ``evaluate``,
``layer_split_variant``) with the tool's row of the capability table (capabilities.py) pinned and filtered: one request
per mode the tool runs and sharding it runs that mode on, the user's pins mapped to the tool's nearest values, every
strategy the search enumerates kept only where the tool runs it unchanged (``nearest.expressible``), and the per-layer
checkpoint / offload split re-picked by memory only for a tool whose script can split (DeepSpeed's). The fastest that
fits wins, one the tool can run on this cluster (capabilities.cannot_run) before one it cannot; with a pinned mode, the
nearest of the tool's modes for it that fits. Where nothing fits, the smallest footprint and why it does not fit (the
binding constraint); where nothing even splits the model, the rule that refuses the nearest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from seqpar.emit.capabilities import ALL_SHARDINGS, OPTIONS, Caps, Unsupported, cannot_run
from seqpar.emit.nearest import expressible, lacks_note, split_notes, stride_notes
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.modes import splits_sequence, takes_ulysses_degree
from seqpar.plan.rules import NO_SPLIT, checkpointing_text, layout_problems
from seqpar.plan.specs import Strategy, Workload

PINS = ("mode", "sp_degree", "ulysses_degree", "checkpointing", "checkpoint_layers", "offload_layers", "kept_saves")
PINS += ("kept_host_layers", "sharding", "loss_impl", "fused_ops", "tiled_mlp")
SPLIT_PINS = ("checkpoint_layers", "offload_layers", "kept_saves", "kept_host_layers")


@dataclass
class Found:
    """The tool's best strategy (None where nothing it expresses splits the model), whether it fits, and why not."""

    strategy: Optional[Strategy]
    fits: bool
    predicted: int  # strategies predicted
    fitting: int  # of them, those that fit
    refused: str = ""  # the binding constraint, where nothing fits (or nothing is valid)
    notes: list[str] = field(default_factory=list)


def plan_pins(plan: LaunchPlan) -> dict:
    """The pins a plan implies when the request's are not at hand: every choice of a plan whose policy is 'pinned' (the
    user pinned them all), else only its fused kernels (an optional dependency the advisor never picks unasked)."""
    s = plan.strategy
    if plan.rationale.policy == "pinned":
        return {k: getattr(s, k) for k in PINS}
    return {"fused_ops": s.fused_ops}


def search(caps: Caps, plan: LaunchPlan, w: Workload, pins: dict, coeffs) -> Found:
    """The fastest strategy ``caps``' tool expresses that fits ``w`` on the plan's cluster (see the module docstring)."""
    from seqpar.advisor.search import describe

    cl = plan.cluster
    pins = {k: v for k, v in pins.items() if v is not None}
    modes = list(caps.modes_for(pins["mode"])) if "mode" in pins else list(caps.runs)  # Unsupported: no equivalent
    # a pinned degree the tool's modes cannot take (Ulysses over more ranks than heads) is re-picked
    for attempt in (pins, {k: v for k, v in pins.items() if k not in ("sp_degree", "ulysses_degree")}):
        invalid: list[str] = []
        groups = [_predicted(caps, mode, w, cl, attempt, coeffs, invalid) for mode in modes]
        if any(groups):
            break
    every = [x for g in groups for x in g]
    if not every:
        why = invalid[0] if invalid else "no strategy it runs forms one"
        return Found(None, False, 0, 0, refused=f"{caps.tool} runs none of its modes here: {why}")
    fitting = [x for x in every if x.fits]
    # with a pinned mode, the nearest of the tool's modes for it that has a strategy that fits
    pool = next((g for g in groups if any(x.fits for x in g)), every) if "mode" in pins else every
    runs = [x for x in pool if x.fits]
    if runs:
        best = min(runs, key=lambda x: (bool(cannot_run(caps, x.strategy, cl.accelerator, cl.world_size)), -x.tokens_per_s))
        found = Found(best.strategy, True, len(every), len(fitting))
    else:
        low = min(every, key=lambda x: x.peak_gib)
        why = f"the smallest footprint, {describe(low.strategy)}, {low.why}"
        found = Found(low.strategy, False, len(every), 0, refused=f"nothing {caps.tool} expresses fits: {why}")
    found.notes = changes(caps, plan.strategy, found.strategy, w, cl, found)
    return found


def _predicted(caps: Caps, mode: str, w: Workload, cl, pins: dict, c, invalid: list) -> list:
    """Every strategy of ``mode`` the tool runs unchanged within the pins (mapped to the tool's values), predicted: the
    advisor's enumeration with the mode and, in turn, each sharding the tool runs it on pinned; for a tool whose script
    splits the checkpointing by layer, also each one's split that memory allows (as the advisor's search adds them).
    Why a strategy is invalid goes to ``invalid``."""
    from seqpar.advisor.request import AdviseRequest
    from seqpar.advisor.search import enumerate_strategies, evaluate, layer_split_variant

    own = {"mode": mode}
    own |= {name: caps.option(name, pins[name]) for name in OPTIONS if name in pins}
    own |= {k: pins[k] for k in SPLIT_PINS if k in pins and caps.layer_split}
    own |= {k: pins[k] for k in ("sp_degree", "ulysses_degree") if k in pins}
    if not takes_ulysses_degree(mode):
        own.pop("ulysses_degree", None)
    if "sharding" in pins:
        shardings = [caps.sharding(mode, pins["sharding"])]
    else:
        shardings = sorted(set(caps.shardings[mode].values()), key=ALL_SHARDINGS.index)
        if cl.accelerator == "cpu" and any(not x.startswith("zero") for x in shardings):
            shardings = [x for x in shardings if not x.startswith("zero")]  # as the advisor's search: ddp / FSDP2 on gloo
    workload = {k: getattr(w, k) for k in ("micro_batch_size", "tokens_per_step", "dtype", "optimizer", "lora", "doc_lens")}
    out = []
    for sh in shardings:
        try:
            req = AdviseRequest(model=w.model, seq_len=w.seq_len, cluster=cl, **workload, **own, sharding=sh)
        except SeqparError as e:  # the workload cannot run this sharding at all (the request's own rules)
            invalid.append(str(e))
            continue
        valid, bad = enumerate_strategies(req, w)
        invalid += [why for _, why in bad]
        runs = []
        for v in valid:  # a choice the tool applies differently on this sharding (FSDP's checkpointing), as it runs it
            v = caps.adjust(v)[0] if caps.adjust is not None else v
            if expressible(caps, v) and v not in runs:
                runs.append(v)
        # the tool's runtime: its norms whole, and TRL's SFTTrainer its own loss
        runtime = caps.runtime()  # priced as the tool runs it
        got = [evaluate(w, cl, s, c, **runtime) for s in runs]
        if caps.layer_split and req.checkpoint_layers is None and req.offload_layers is None:
            one = req.model_copy(update={"offload_stride": 1})  # no tool rebuilds offloaded inputs (nearest.stride_notes)
            splits = (layer_split_variant(w, cl, x.strategy, c, one, runtime) for x in list(got))
            got += [evaluate(w, cl, v, c, **runtime) for v in splits if v is not None]
        out += got
    return out


def changes(caps: Caps, old: Strategy, new: Strategy, w: Workload, cl, found: Found) -> list[str]:
    """One line per choice of the plan the tool lacks (why, and what it runs instead), one line for the choices the cost
    model re-picked among what the tool runs, and how the tool runs its mode where that is not seqpar's kernel."""
    from seqpar.advisor.search import describe

    if new == old:
        return []
    head = f"{caps.tool} runs {describe(new)}"
    if found.fits:
        head += f": the fastest of the {found.fitting} strategies it expresses that fit ({found.predicted} predicted)"
    lacked, repicked = [], []
    for name in ("mode", "sharding", *OPTIONS):
        a, b = getattr(old, name), getattr(new, name)
        if a == b:
            continue
        adjusted = caps.adjust(new.model_copy(update={name: a})) if caps.adjust is not None else (None, [])
        if _lacks(caps, name, a, new.mode):
            lacked.append(lacks_note(caps, name, a, b))
        elif adjusted[1] and getattr(adjusted[0], name) == b:  # the tool has it, but not with the rest of ``new``
            lacked += adjusted[1]
        else:
            repicked.append(f"{name} {a} -> {b}")
    if old.sp_degree != new.sp_degree and splits_sequence(new.mode):  # else the mode's line says it
        probe = new.model_copy(update={"sp_degree": old.sp_degree, "dp_degree": old.dp_degree})
        if old.sp_degree > 1 and layout_problems(probe, w.seq_len, w.model, cl):
            lacked.append(
                f"sp_degree {old.sp_degree} cannot split {w.model.name}'s heads or the sequence in {new.mode}; the cost "
                f"model picked {new.sp_degree}"
            )
        else:
            repicked.append(f"sp_degree {old.sp_degree} -> {new.sp_degree}")
    lacked += stride_notes(caps, old, new)
    if caps.layer_split:
        if any(getattr(old, k) != getattr(new, k) for k in NO_SPLIT if k != "offload_stride"):
            repicked.append(
                f"the per-layer split ({checkpointing_text(old, w.model.num_layers)} -> "
                f"{checkpointing_text(new, w.model.num_layers)})"
            )
    else:
        lacked += split_notes(caps, old, new, w.model.num_layers)
    out = [head] + lacked
    if repicked:
        out.append("re-picked by the cost model among what " + caps.tool + " runs: " + ", ".join(repicked))
    if new.mode in caps.approx:
        out.append(caps.approx[new.mode])
    return out


def _lacks(caps: Caps, name: str, value, mode: str) -> bool:
    """Whether the tool has no ``name`` = ``value`` (so the change is the tool's, not the cost model's)."""
    try:
        if name == "mode":
            return value not in caps.runs
        if name == "sharding":
            return caps.sharding(mode, value) != value
        return caps.option(name, value) != value
    except Unsupported:
        return True


__all__ = ["Found", "PINS", "changes", "plan_pins", "search"]
