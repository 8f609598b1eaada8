"""The five sequence-parallel modes and their facts, stated once: the schema, the advisor and the runtime all read them here.

Dependency-free (no pydantic, no torch). For each mode (EasyContext's names):

| mode               | layout of rank r of W                                   | split multiple | degrees (ring, ulysses) | heads split |
|--------------------|----------------------------------------------------------|----------------|-------------------------|-------------|
| data_parallel      | the whole sequence                                       | 1              | (1, 1)                  | no          |
| zigzag_ring_attn   | chunks r and 2W-1-r of 2W (balanced causal work)         | 2W             | (W, 1)                  | no          |
| dist_flash_attn    | contiguous chunk r of W (LightSeq's balanced schedule)   | W              | (W, 1)                  | no          |
| ulysses_attn       | contiguous chunk r of W, all-to-all to a head split      | W              | (1, W)                  | over W      |
| usp_attn           | zigzag over R ring ranks, then contiguous over U Ulysses | 2RU            | (R, U), W = R x U       | over U      |

Heads (Ulysses, and usp_attn's Ulysses part over U ranks): the query heads must divide by U; the KV heads must divide by
U or, when fewer, U must be a multiple of them (each KV head is then replicated U/Hkv times, as DeepSpeed and ALST do).

Adding a mode: a row in ``MODES_TABLE`` and ``seqpar/runtime/<mode>.py`` with its forward and backward (see
``seqpar/runtime/parallel/attention.py``); the advisor's cost terms for it live in ``seqpar/advisor/cost/memory.py`` and
``throughput.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.plan.errors import SeqparError


@dataclass(frozen=True)
class ModeFacts:
    """What every layer needs to know about one mode."""

    name: str  # EasyContext's name, the plan's ``strategy.mode``
    implementation: (
        str  # transformers attn_implementation name (never containing "flash": transformers 5 reads that as a hub kernel)
    )
    module: str  # runtime module: seqpar.runtime.<module> exposes forward, backward and <name>_attention (runtime/attention.py)
    layout: str  # "whole" | "zigzag" | "contiguous" | "zigzag+contiguous"
    splits_heads: bool  # all-to-all over heads (Ulysses, USP's Ulysses part)
    rotates_kv: bool  # K,V blocks travel between ranks (ring, dist flash)
    needs_checkpointing: bool  # its schedule is only run with gradient checkpointing (EasyContext: dist_flash_attn)
    summary: str  # one line for people


MODES_TABLE: tuple[ModeFacts, ...] = (
    ModeFacts(
        "data_parallel",
        "seqpar_local",
        "data_parallel",
        "whole",
        False,
        False,
        False,
        "no split: every rank holds whole sequences",
    ),
    ModeFacts(
        "zigzag_ring_attn",
        "seqpar_zigzag_ring",
        "zigzag_ring_attn",
        "zigzag",
        False,
        True,
        False,
        "ring attention over a zigzag split (ring-flash-attention, PyTorch CP's head-tail balancer)",
    ),
    ModeFacts(
        "dist_flash_attn",
        "seqpar_lightseq",
        "dist_flash_attn",
        "contiguous",
        False,
        True,
        True,
        "LightSeq / DistFlashAttn's balanced causal schedule over contiguous chunks",
    ),
    ModeFacts(
        "ulysses_attn",
        "seqpar_ulysses",
        "ulysses_attn",
        "contiguous",
        True,
        False,
        False,
        "DeepSpeed-Ulysses: all-to-all from a sequence split to a head split around local attention",
    ),
    ModeFacts(
        "usp_attn",
        "seqpar_usp",
        "usp_attn",
        "zigzag+contiguous",
        True,
        True,
        False,
        "USP: Ulysses inside groups of consecutive ranks, zigzag ring across the groups",
    ),
)

FACTS: dict[str, ModeFacts] = {m.name: m for m in MODES_TABLE}
MODES: tuple[str, ...] = tuple(FACTS)


def facts(mode: str) -> ModeFacts:
    """The facts of a mode; SeqparError naming the valid modes for an unknown one."""
    check_mode(mode)
    return FACTS[mode]


def check_mode(mode: str, what: str = "mode") -> None:
    if mode not in FACTS:
        raise SeqparError(f"{what} {mode!r} is unknown; use one of {', '.join(MODES)}")


def nearest_multiples(value: int, multiple: int) -> tuple[int, int]:
    """The multiples of ``multiple`` just below and just above ``value`` (below is at least ``multiple``)."""
    below = max(multiple, value - value % multiple)
    above = below if value % multiple == 0 else value - value % multiple + multiple
    return below, above


def degrees(mode: str, sp_degree: int, ulysses_degree: int | None = None) -> tuple[int, int]:
    """(ring_degree, ulysses_degree) of a mode over sp_degree ranks; validates the mode and the degrees.

    ``ulysses_degree`` is usp_attn's (it must divide sp_degree); the other modes take None or 1."""
    check_mode(mode)
    if sp_degree < 1:
        raise SeqparError(f"world_size must be >= 1, got {sp_degree}")
    if mode == "usp_attn":
        if ulysses_degree is None or ulysses_degree < 1 or sp_degree % ulysses_degree:
            raise SeqparError(
                f"usp_attn needs ulysses_degree dividing world_size {sp_degree}, got {ulysses_degree}; "
                f"pick one of {[u for u in range(1, sp_degree + 1) if sp_degree % u == 0]}"
            )
        return sp_degree // ulysses_degree, ulysses_degree
    if ulysses_degree not in (None, 1):
        raise SeqparError(f"ulysses_degree={ulysses_degree} is for usp_attn only; {mode} takes the group alone (pass None)")
    if mode == "data_parallel":
        return 1, 1
    if mode == "ulysses_attn":
        return 1, sp_degree
    return sp_degree, 1  # zigzag_ring_attn, dist_flash_attn


def head_degree(mode: str, sp_degree: int, ulysses_degree: int | None = None) -> int:
    """Over how many ranks the mode splits heads (1 = no head split)."""
    return degrees(mode, sp_degree, ulysses_degree)[1] if facts(mode).splits_heads else 1


def split_multiple(mode: str, sp_degree: int, ulysses_degree: int | None = None) -> int:
    """The number seq_len must be a multiple of for the mode to split it exactly over sp_degree ranks."""
    ring, uly = degrees(mode, sp_degree, ulysses_degree)
    layout = FACTS[mode].layout
    if layout == "whole":
        return 1
    if layout == "zigzag":
        return 2 * ring
    if layout == "zigzag+contiguous":
        return 2 * ring * uly
    return sp_degree  # contiguous chunks


def _multiple_words(mode: str, mult: int) -> str:
    layout = FACTS[mode].layout
    if layout == "zigzag":
        return f"2*sp_degree = {mult}"
    if layout == "zigzag+contiguous":
        return f"2*ring_degree*ulysses_degree = {mult}"
    return f"sp_degree = {mult}"


def check_split(mode: str, seq_len: int, sp_degree: int, ulysses_degree: int | None = None) -> None:
    """SeqparError with the nearest valid lengths when the mode cannot split seq_len over sp_degree ranks."""
    mult = split_multiple(mode, sp_degree, ulysses_degree)
    if seq_len < 1:
        raise SeqparError(f"seq_len {seq_len} must be positive")
    if seq_len % mult:
        below, above = nearest_multiples(seq_len, mult)
        raise SeqparError(
            f"seq_len {seq_len} is not divisible by {_multiple_words(mode, mult)}, which {mode} needs; "
            f"nearest valid: {below} or {above}"
        )


def check_heads(
    mode: str, q_heads: int, kv_heads: int, sp_degree: int, ulysses_degree: int | None = None, owner: str | None = None
) -> None:
    """SeqparError unless the mode's head split (Ulysses) can split the query heads and split or replicate the KV heads.

    ``owner`` names whose heads they are in the message (a model name); None for bare tensors."""
    u = head_degree(mode, sp_degree, ulysses_degree)
    if u == 1:
        return
    if q_heads % u:
        who = f"{owner} has" if owner else "there are"
        raise SeqparError(
            f"{mode} splits heads over {u} ranks but {who} {q_heads} query heads ({q_heads} % {u} != 0); "
            f"use usp_attn with a ulysses_degree dividing {q_heads}, or zigzag_ring_attn"
        )
    if kv_heads % u and u % kv_heads:
        whose = f"{owner}'s " if owner else ""
        raise SeqparError(
            f"{mode} over {u} ranks can neither split nor replicate {whose}{kv_heads} KV heads ({kv_heads} % {u} != 0 and "
            f"{u} % {kv_heads} != 0); use usp_attn with a ulysses_degree dividing {kv_heads}, or zigzag_ring_attn"
        )


__all__ = [
    "FACTS",
    "MODES",
    "MODES_TABLE",
    "ModeFacts",
    "check_heads",
    "check_mode",
    "check_split",
    "degrees",
    "facts",
    "head_degree",
    "nearest_multiples",
    "split_multiple",
]
