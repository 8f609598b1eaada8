"""Rich renderings for people: a launch plan (``seqpar explain``, ``seqpar advise``), a probe result, the profile tables.

Each ``*_tables`` function returns renderables so callers (and the cost-model's richer explain) can add their own sections;
``render_plan`` prints them in order: the plan's sections, its Training settings (training.py) and predicted bill
(bill.py), the reasons and the launch line; ``render_answer`` prints `seqpar advise`'s one-screen answer (answer.py).
Profile listings keep whole names at 80 columns and round their figures. JSON output never goes through here: the CLI
dumps the pydantic models directly.
"""

from __future__ import annotations

import shlex
from typing import Iterable

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table

from seqpar.advisor.answer import answer_rows, disagreement
from seqpar.advisor.bill import NOT_COUNTED, bill_lines, plan_bill
from seqpar.advisor.training import training_rows
from seqpar.plan.display import rows as option_rows
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.lora import adapter_params, lora_text
from seqpar.plan.modes import takes_ulysses_degree
from seqpar.plan.options import PINNED_FRACTION
from seqpar.plan.rules import checkpointing_text
from seqpar.plan.specs import ClusterSpec, GpuSpec, LinkSpec, ModelSpec, Workload
from seqpar.plan.units import format_tokens


def _kv(title: str, rows: Iterable[tuple[str, object]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    for k, v in rows:
        t.add_row(k, str(v))
    return t


def params_text(n: int) -> str:
    """6738415616 -> '6.74B', 106560 -> '107K'."""
    return f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M" if n >= 1e5 else f"{n / 1e3:.3g}K"


def cluster_line(c: ClusterSpec) -> str:
    inter = f", {c.inter_node_link.kind} between nodes" if c.inter_node_link else ""
    return f"{c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name} ({c.gpu.memory_gib:.1f} GiB), {c.intra_node_link.kind} inside the node{inter}"


def documents_line(w: Workload) -> str:
    """What a window holds: one document, or packed documents with their mix and the attention they cost."""
    mix = w.doc_lens
    if mix is None:
        return "one per window (attention over the whole window)"
    f = mix.at(w.seq_len).sum_sq_fraction
    return f"packed, mean {mix.mean_tokens:,.0f} tokens: attention {100 * f:.2g}% of one document per window ({mix.source})"


def lora_line(w: Workload) -> str:
    """What trains under LoRA: the adapters, with their size, on a frozen (maybe 4-bit) base."""
    return f"{lora_text(w.lora)}: {params_text(adapter_params(w.model, w.lora))} adapter parameters"


def plan_summary(plan: LaunchPlan) -> str:
    """One line: mode, degrees, seq_len, model, cluster."""
    s, w = plan.strategy, plan.workload
    degrees = f"sp {s.sp_degree} x dp {s.dp_degree}" + (
        f" (ulysses {s.ulysses_degree} x ring {s.ring_degree})" if takes_ulysses_degree(s.mode) else ""
    )
    return f"{s.mode}, {degrees}, seq_len {w.seq_len} ({format_tokens(w.seq_len)}), {w.model.name}, {cluster_line(plan.cluster)}"


def plan_tables(plan: LaunchPlan, plan_path: str | None = "plan.json", warn: bool = True) -> list[RenderableType]:
    """The plan's sections; ``plan_path``: where the plan is, for the launch line (None: it was not written); ``warn``:
    whether the Training section repeats the RoPE warning (`seqpar advise` says it once, on stderr)."""
    w, c, s, r = plan.workload, plan.cluster, plan.strategy, plan.rationale
    out: list[RenderableType] = [
        _kv(
            "Workload",
            [
                (
                    "model",
                    f"{w.model.name} ({params_text(w.model.num_params)} params, {w.model.num_layers} layers, "
                    f"{w.model.num_attention_heads} heads / {w.model.num_key_value_heads} KV heads)",
                ),
                ("seq_len", f"{w.seq_len} ({format_tokens(w.seq_len)})"),
                ("micro-batch", w.micro_batch_size),
                ("tokens per step", w.tokens_per_step or "one micro-batch per DP rank"),
                ("dtype / optimizer", f"{w.dtype} / {w.optimizer}"),
                *([("trains", lora_line(w))] if w.lora is not None else []),  # a full fine-tuning: every weight
                ("documents", documents_line(w)),
            ],
        ),
        _kv(
            "Cluster",
            [
                ("hardware", cluster_line(c)),
                ("host RAM per node", f"{c.host_ram_gib:.0f} GiB"),
                (
                    "page-locked at most",
                    f"{c.pinned_gib_per_node:.0f} GiB per node"
                    + (" (stated)" if c.pinned_host_gib is not None else f" ({PINNED_FRACTION:.0%} of host RAM, default)"),
                ),
                ("source", c.source),
                ("note", r.cluster_note or "-"),
            ],
        ),
        _kv(
            "Strategy",
            [
                ("mode", s.mode),
                (
                    "degrees",
                    f"sp {s.sp_degree} x dp {s.dp_degree}"
                    + (f", ulysses {s.ulysses_degree} x ring {s.ring_degree}" if takes_ulysses_degree(s.mode) else ""),
                ),
                ("tokens per rank", w.seq_len // s.sp_degree),
                ("checkpointing", checkpointing_text(s, w.model.num_layers)),
                ("sharding", s.sharding),
                ("loss", s.loss_impl),
                *option_rows(s),
                ("grad accumulation", s.gradient_accumulation_steps),
            ],
        ),
    ]
    if plan.prediction is not None:
        p = plan.prediction
        out.append(
            _kv(
                "Prediction",
                [
                    (
                        "peak memory",
                        f"{p.peak_memory_gib:.1f} GiB allocated, {p.reserved_memory_gib:.1f} GiB reserved of {p.capacity_gib:.1f} GiB"
                        + ("  [bold red]OOM risk[/]" if p.oom_risk else ""),
                    ),
                    ("throughput", f"{p.tokens_per_s:,.0f} tokens/s, step {p.step_time_s:.2f} s, MFU {p.mfu:.1%}"),
                ],
            )
        )
    out.append(_kv("Training", [row for row in training_rows(plan) if warn or "warning" not in row[0]]))
    bill = plan_bill(plan)
    if bill is not None:
        out.append(_kv("Predicted bill", [("", line) for line in bill_lines(bill)] + [("", f"[dim]{NOT_COUNTED}[/]")]))
    why = Table(title=f"Why ({r.policy})", show_header=False, title_justify="left", box=None, pad_edge=False)
    why.add_column()
    for i, step in enumerate(r.rule_path, 1):
        why.add_row(f"[dim]rule {i}[/] {step}")
    split = disagreement(plan)  # in place of the search's terse "rules: X; cost model: Y" (the alternatives: explain.py)
    for reason in r.reasons:
        why.add_row(f"- {split if split and reason.startswith(f'rules: {r.rules_choice}; ') else reason}")
    out.append(why)
    launch = " ".join(shlex.quote(a) if not a.startswith("$") else a for a in plan.launch.command)
    runs = f"{plan.launch.launcher} on each node" + (f" (stage 0 of {len(plan.stages)})" if plan.stages else "")
    run = f"seqpar launch {plan_path}" if plan_path else "not written: add -o plan.json to write it, then seqpar launch plan.json"
    out.append(
        _kv(
            "Launch",
            [
                ("run", run),
                (runs, launch or "-"),
                ("env", " ".join(f"{k}={v}" for k, v in plan.launch.env.items()) or "-"),
            ],
        )
    )
    return out


def render_plan(plan: LaunchPlan, console: Console, plan_path: str | None = "plan.json", warn: bool = True) -> None:
    console.print(f"[bold]{plan_summary(plan)}[/]", soft_wrap=False)  # wrapped at the terminal's width, like the tables
    for t in plan_tables(plan, plan_path, warn):
        console.print(t)
        console.print()


def render_answer(plan: LaunchPlan, console: Console, plan_path: str | None, details: str) -> None:
    """`seqpar advise`'s one-screen answer (answer.answer_rows); ``details``: the command that prints the rest."""
    console.print(_kv("", answer_rows(plan, plan_path, details)))


def probe_tables(res) -> list[RenderableType]:
    """Tables of a seqpar.advisor.probe.ProbeResult."""
    head = _kv(
        "Probe",
        [
            ("NVML", res.reason),
            ("driver", res.driver_version or "-"),
            ("nodes", f"{res.nodes} (node rank {res.node_rank}; rank {res.rank} of {res.world_size}; from {res.launcher})"),
            ("host RAM", f"{res.host_ram_gib:.1f} GiB" if res.host_ram_gib else "unknown"),
            (
                "InfiniBand",
                ", ".join(f"{p.device}/{p.port} {p.state} {p.rate_gbps:g} Gb/s {p.link_layer}" for p in res.ib_ports) or "none",
            ),
        ],
    )
    out: list[RenderableType] = [head]
    if res.gpus:
        t = Table(title="GPUs", title_justify="left")
        for col in ("#", "name", "profile", "memory GiB (free)", "cc", "NVLinks", "PCIe"):
            t.add_column(col)
        for g in res.gpus:
            t.add_row(
                str(g.index),
                g.name,
                g.profile or "[red]none[/]",
                f"{g.memory_total_gib:.1f} ({g.memory_free_gib:.1f})",
                g.compute_capability,
                str(g.nvlinks_active),
                f"gen{g.pcie_gen} x{g.pcie_width}" if g.pcie_gen else "-",
            )
        out.append(t)
    if len(res.gpus) > 1:
        t = Table(title="Topology", title_justify="left")
        t.add_column("")
        for g in res.gpus:
            t.add_column(f"GPU{g.index}")
        for g, row in zip(res.gpus, res.topology):
            t.add_row(f"GPU{g.index}", *row)
        out.append(t)
    return out


def _listing(title: str, *cols: str) -> Table:
    """A profile listing that keeps whole names at 80 columns and in a pipe: no vertical rules, names never wrapped or
    cut (the other columns give way), figures right-aligned."""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, col in enumerate(cols):
        t.add_column(col, no_wrap=i < 2, justify="left" if i < 2 else "right", overflow="fold")
    return t


def profile_tables(gpus: list[GpuSpec], links: list[LinkSpec], models: list[ModelSpec]) -> list[RenderableType]:
    tg = _listing("GPUs", "name", "NVML name", "memory GiB", "bf16 TFLOP/s", "HBM GB/s")
    for g in gpus:
        tg.add_row(g.name, g.display_name, f"{g.memory_gib:.1f}", f"{g.bf16_tflops:g}", f"{g.hbm_bandwidth_gb_s:g}")
    tl = _listing("Links", "kind", "GB/s per direction")
    for link in links:
        tl.add_row(link.kind, f"{link.bandwidth_gb_s:g}")
    tm = _listing("Models", "name", "arch", "params", "layers", "hidden", "heads/KV", "head", "vocab", "max pos")
    for m in models:
        tm.add_row(
            m.name,
            m.architecture,
            params_text(m.num_params),
            str(m.num_layers),
            str(m.hidden_size),
            f"{m.num_attention_heads}/{m.num_key_value_heads}",
            str(m.head_dim),
            str(m.vocab_size),
            format_tokens(m.max_position_embeddings),
        )
    return [tg, tl, tm]


def figure(v: object) -> str:
    """A profile's value for people: whole floats without '.0', others to 4 significant digits (79.6474609375 -> 79.65)."""
    if isinstance(v, float):
        return f"{v:.0f}" if v.is_integer() else f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def spec_table(spec) -> Table:
    """Any profile model (GpuSpec, LinkSpec, ModelSpec) as a two-column table, figures rounded (--json has them exact)."""
    return _kv(getattr(spec, "name", getattr(spec, "kind", "")), [(k, figure(v)) for k, v in spec.model_dump().items()])
