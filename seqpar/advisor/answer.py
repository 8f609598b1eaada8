"""`seqpar advise`'s answer on one screen, and the pieces of the rationale that `explain` shares with it.

``answer_rows`` is what advise prints by default, in the order people act on it: the plan (mode, degrees, the strategy's
choices), the prediction, the bill, the command to run next, then one or two lines of why and where the rest is
(``seqpar explain`` / ``advise --verbose`` print the plan's sections, its reasons and its alternatives). It stays within
about 16 lines at 80 columns, so the answer and the notes on stderr fit one screen.

``disagreement`` is the one line saying where the guide's decision tree and the cost model part, with the predicted
difference. ``alternative_groups`` folds the plan's alternatives by what they change from the plan (another mode, another
sharding, another checkpointing and sharding...), the best of each group shown once: the search keeps the best strategy
per changed choice, and several of them differ only by a layer count or by a fraction of a percent. Display only: the
plan's JSON keeps every alternative.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from seqpar.advisor.bill import NOT_COUNTED, bill_lines, duration, plan_bill
from seqpar.plan.display import shown_fields
from seqpar.plan.launch_plan import Alternative, LaunchPlan
from seqpar.plan.lora import lora_text
from seqpar.plan.modes import splits_sequence, takes_ulysses_degree
from seqpar.plan.rules import checkpointed_layers, layers_of, offloaded_layers
from seqpar.plan.specs import ClusterSpec, Strategy
from seqpar.plan.units import format_tokens

_COUNTS = re.compile(r"\((\d+) strategies predicted, (\d+) fit, (\d+) invalid\)")
_FASTER = re.compile(r"^faster, [^()]*\([^()]*\), ")


def percent(gain: float) -> str:
    """+0.6% / -3%: a tenth of a percent below 1%, where a whole percent would read "-0%"."""
    return f"{gain:+.1%}" if abs(gain) < 0.01 else f"{gain:+.0%}"


def ranks_text(c: ClusterSpec) -> str:
    """Where the plan runs, in its own words: "8x a100-80g-sxm on 1 node", "2 nodes x 8 h100-sxm", "2 CPU ranks (gloo)"."""
    if c.accelerator == "cpu":
        return f"{c.world_size} CPU rank{'s' if c.world_size != 1 else ''} (gloo)"
    if c.nodes == 1:
        return f"{c.gpus_per_node}x {c.gpu.name} on 1 node"
    return f"{c.nodes} nodes x {c.gpus_per_node} {c.gpu.name}"


def degrees_text(s: Strategy) -> str:
    """The degrees: "sp 8 x dp 1", "sp 8 (ulysses 2 x ring 4) x dp 1", "dp 8" (whole sequences)."""
    if not splits_sequence(s.mode):
        return f"dp {s.dp_degree}"
    hybrid = f" (ulysses {s.ulysses_degree} x ring {s.ring_degree})" if takes_ulysses_degree(s.mode) else ""
    return f"sp {s.sp_degree}{hybrid} x dp {s.dp_degree}"


def checkpointing_short(s: Strategy, num_layers: int) -> str:
    """The checkpointing policy and how many layers it covers, in a few words ("selective (31 of 32 layers)")."""
    if s.checkpointing == "none":
        return "none"
    ck, off = checkpointed_layers(s, num_layers), offloaded_layers(s, num_layers)
    recomputed = f", {ck} recomputed" if ck != num_layers else ""
    if s.checkpointing == "offload" and s.offload_stride > 1:
        text = (
            f"offload ({off} of {num_layers} layers offloaded, 1 in {s.offload_stride} of their inputs in host memory "
            f"({layers_of(s, num_layers).host_inputs}), backward recomputes the rest{recomputed})"
        )
    elif s.checkpointing == "offload" and off != ck:
        text = f"offload ({off} of {num_layers} layers' inputs in host memory{recomputed})"
    else:
        text = s.checkpointing if ck == num_layers else f"{s.checkpointing} ({ck} of {num_layers} layers)"
    if s.kept_saves != "all":
        text += f", the rest keep {s.kept_saves}" + (f" ({s.kept_host_layers} on the host)" if s.kept_host_layers else "")
    return text


def options_text(s: Strategy) -> list[str]:
    """The strategy's options that differ from their defaults, as their Strategy rows read ("fused ops liger", "tiled MLP")."""
    fields = type(s).model_fields
    out = []
    for k, sh in shown_fields(s).items():
        v = getattr(s, k)
        if v != fields[k].default:
            out.append(sh.row if isinstance(v, bool) else f"{sh.row} {v}")
    return out


def strategy_text(s: Strategy, num_layers: int) -> str:
    """The choices beside mode and degrees: checkpointing, sharding, loss, options, gradient accumulation."""
    parts = [f"checkpointing {checkpointing_short(s, num_layers)}", f"sharding {s.sharding}", f"loss {s.loss_impl}"]
    parts += options_text(s)
    if s.gradient_accumulation_steps > 1:
        parts.append(f"{s.gradient_accumulation_steps} micro-batches per step")
    return ", ".join(parts)


def disagreement(plan: LaunchPlan) -> str | None:
    """One line on the guide's tree against the cost model's pick, with the predicted difference; None where the cost
    model did not weigh the tree's mode (the rules policy, a pinned mode)."""
    r, mine = plan.rationale, plan.strategy.mode
    tree = r.rules_choice
    prefix = f"rules: {tree}; cost model: "
    reason = next((x for x in r.reasons if x.startswith(prefix)), None) if tree else None
    if reason is None:
        return None
    if tree == mine:
        return f"the guide's tree and the cost model agree: {mine}"
    p = plan.prediction
    theirs = [a.prediction for a in r.alternatives if a.strategy.mode == tree and a.prediction and not a.prediction.oom_risk]
    if p is not None and theirs:
        t = max(theirs, key=lambda x: x.tokens_per_s)
        gain = p.tokens_per_s / t.tokens_per_s - 1
        return (
            f"the guide's tree says {tree}; the cost model picks {mine}, predicted {percent(gain).lstrip('+')} faster "
            f"({p.tokens_per_s:,.0f} vs {t.tokens_per_s:,.0f} tokens/s)"
        )
    return f"the guide's tree says {tree}; the cost model picks {reason[len(prefix) :]}"


@dataclass(frozen=True)
class Group:
    """Alternatives that change the same choices of the plan: the best of them, and how many more there are."""

    changes: str  # "sharding zero3_offload + tiled MLP": what the best one changes, with its values
    best: Alternative
    more: int


def _changes(plan: LaunchPlan, a: Strategy) -> list[tuple[str, str]]:
    """(choice, what ``a`` has instead) for each choice where ``a`` differs from the plan's strategy. Another mode is a
    choice of its own per mode (its degrees said only where they are not the plan's); a layer count alone is no change
    (it follows the memory the other choices leave)."""
    s, n = plan.strategy, plan.workload.model.num_layers
    out: list[tuple[str, str]] = []
    if a.mode != s.mode:
        if (a.sp_degree, a.dp_degree) != (s.sp_degree, s.dp_degree):
            out.append((f"mode {a.mode}", f"{a.mode} {degrees_text(a)}"))
        elif takes_ulysses_degree(a.mode):
            out.append((f"mode {a.mode}", f"{a.mode} (ulysses {a.ulysses_degree} x ring {a.ring_degree})"))
        else:
            out.append((f"mode {a.mode}", a.mode))
    elif (a.sp_degree, a.ulysses_degree, a.dp_degree) != (s.sp_degree, s.ulysses_degree, s.dp_degree):
        out.append(("degrees", degrees_text(a)))
    if a.checkpointing != s.checkpointing:
        out.append(("checkpointing", f"checkpointing {checkpointing_short(a, n)}"))
    for name, label in (("kept_saves", "kept saves"), ("sharding", "sharding"), ("loss_impl", "loss")):
        if getattr(a, name) != getattr(s, name):
            out.append((label, f"{label} {getattr(a, name)}"))
    for k, sh in shown_fields(s).items():
        mine, theirs = getattr(s, k), getattr(a, k)
        if theirs != mine:
            out.append((sh.row, (sh.row if theirs else f"no {sh.row}") if isinstance(theirs, bool) else f"{sh.row} {theirs}"))
    return out


def alternative_groups(plan: LaunchPlan) -> list[Group]:
    """The plan's alternatives folded by what they change (another mode: one group per mode; otherwise the choices
    changed), in the order the advisor lists them, the best of each group (fastest that fits, else the smallest peak)."""
    groups: dict[tuple, list[Alternative]] = {}
    for a in plan.rationale.alternatives:
        key = tuple(k for k, _ in _changes(plan, a.strategy)) + (a.prediction is not None and a.prediction.oom_risk,)
        groups.setdefault(key, []).append(a)

    def rank(a: Alternative):
        p = a.prediction
        return (0, -p.tokens_per_s) if p is not None and not p.oom_risk else (1, p.peak_memory_gib if p else 0.0)

    out = []
    for members in groups.values():
        best = min(members, key=rank)
        changes = " + ".join(text for _, text in _changes(plan, best.strategy))
        out.append(Group(changes or "the layer split", best, len(members) - 1))
    return out


def why_lost(plan: LaunchPlan, a: Alternative) -> str:
    """Why the alternative lost, without what its numbers already say ("slower" is the tokens/s column)."""
    text, p = a.rejected_because, a.prediction
    if text.startswith("slower:"):
        return "slower"
    if p is not None and p.oom_risk:
        return f"risks OOM ({p.required_memory_gib:.1f} GiB needed + {p.memory_margin_gib:.1f} margin > {p.capacity_gib:.1f})"
    return _FASTER.sub("", text).removeprefix("but ")


def answer_rows(plan: LaunchPlan, plan_path: str | None, details: str) -> list[tuple[str, str]]:
    """The one-screen answer as (label, text) rows; ``plan_path``: where the plan was written (None: not written);
    ``details``: the command that prints the rest."""
    w, c, s, p = plan.workload, plan.cluster, plan.strategy, plan.prediction
    per_rank = f", {w.seq_len // s.sp_degree:,} per rank" if s.sp_degree > 1 else ""
    rows = [
        (
            "Plan",
            f"{s.mode}, {degrees_text(s)}: {w.model.name} at {format_tokens(w.seq_len)} tokens{per_rank}, on {ranks_text(c)}",
        ),
        ("", strategy_text(s, w.model.num_layers)),
    ]
    if w.lora is not None:  # what trains: the adapters on a frozen (maybe 4-bit) base
        rows.insert(1, ("", lora_text(w.lora)))
    if p is None:
        rows.append(("Prediction", "none: --policy rules does not model memory or speed (--policy cost, the default, does)"))
    else:
        oom = "  [bold red]RISKS OOM[/]" if p.oom_risk else ""
        rows.append(
            (
                "Prediction",
                f"{p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, {p.step_time_s:.3g} s per step; peak "
                f"{p.peak_memory_gib:.1f} GiB of {p.capacity_gib:.1f} ({p.reserved_memory_gib:.1f} reserved){oom}",
            )
        )
    bill = plan_bill(plan)
    for i, st in enumerate(plan.stages):
        cost = f": {duration(bill.stages[i].wall_s)}" if bill else ""
        rows.append(
            (
                "Stages" if i == 0 else "",
                f"{format_tokens(st.seq_len)}, RoPE {st.rope_theta:g}, {st.steps} steps, "
                f"{st.strategy.mode} {degrees_text(st.strategy)}{cost}",
            )
        )
    if bill is not None:
        rows.append(("Bill", f"{bill_lines(bill)[-1]} ({NOT_COUNTED.split(':')[0]})"))
    if any(x.prediction is not None and x.prediction.oom_risk for x in [plan, *plan.stages]):
        rows.append(("Next", "nothing fits: seqpar advise --max-seq-len with these flags says what does"))
    elif plan_path:
        rows.append(("Next", f"seqpar launch {plan_path}"))
    else:
        rows.append(("Next", "add -o plan.json to write the plan, then: seqpar launch plan.json"))
    rows += [("Why" if i == 0 else "", line) for i, line in enumerate(_why(plan))]
    n = len(alternative_groups(plan))
    what = f"{n} alternative{'s' if n != 1 else ''}, " if n else ""
    rows.append(("More", f"{details} for the reasons, {what}memory and time"))
    return rows


def _why(plan: LaunchPlan) -> list[str]:
    """One or two lines: how the plan was chosen, and where the guide's tree and the cost model part."""
    r = plan.rationale
    counts = next((m for m in map(_COUNTS.search, r.reasons) if m), None)
    if r.policy == "rules":
        head = f"the guide's tree: {r.rule_path[-1]}" if r.rule_path else "the guide's tree"
    elif r.policy == "pinned":
        head = "every choice pinned by the flags" + ("; the cost model predicted it" if plan.prediction else "")
    elif counts and int(counts[2]):
        head = f"the fastest of {int(counts[2]):,} strategies that fit ({int(counts[1]):,} predicted)"
    elif counts:
        head = f"none of {int(counts[1]):,} strategies predicted fits; this one needs the least memory"
    else:
        head = f"{r.policy} policy"
    if plan.stages:
        head += f"; each of the {len(plan.stages)} stages planned for its own length"
    line = disagreement(plan)
    return [head] + ([line] if line else [])


__all__ = [
    "Group",
    "alternative_groups",
    "answer_rows",
    "checkpointing_short",
    "degrees_text",
    "disagreement",
    "options_text",
    "percent",
    "ranks_text",
    "strategy_text",
    "why_lost",
]
