"""How a registered mode splits a sequence and its heads over sp_degree ranks: the degrees, the length multiple, the
head rule, with the errors that name the numbers and a fix. The plan, the advisor and the runtime all check with these.

Heads (a head split over U ranks: Ulysses, usp_attn's Ulysses part): the query heads must divide by U; the KV heads must
divide by U or, when fewer, U must be a multiple of them (each KV head is then replicated U/Hkv times, as DeepSpeed and
ALST do).
"""

from __future__ import annotations

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes.registry import describe, hybrid_names


def nearest_multiples(value: int, multiple: int) -> tuple[int, int]:
    """The multiples of ``multiple`` just below and just above ``value`` (below is at least ``multiple``)."""
    below = max(multiple, value - value % multiple)
    above = below if value % multiple == 0 else value - value % multiple + multiple
    return below, above


def degrees(mode: str, sp_degree: int, ulysses_degree: int | None = None) -> tuple[int, int]:
    """(ring_degree, ulysses_degree) of a mode over sp_degree ranks: the sequence split and the head split; validates the
    mode and the degrees. ``ulysses_degree`` is a hybrid mode's (usp_attn: it must divide sp_degree); the others take
    None or 1."""
    rule = describe(mode).degrees
    if sp_degree < 1:
        raise SeqparError(f"world_size must be >= 1, got {sp_degree}")
    if rule == "hybrid":
        if ulysses_degree is None or ulysses_degree < 1 or sp_degree % ulysses_degree:
            raise SeqparError(
                f"{mode} needs ulysses_degree dividing world_size {sp_degree}, got {ulysses_degree}; "
                f"pick one of {[u for u in range(1, sp_degree + 1) if sp_degree % u == 0]}"
            )
        return sp_degree // ulysses_degree, ulysses_degree
    if ulysses_degree not in (None, 1):
        raise SeqparError(
            f"ulysses_degree={ulysses_degree} is for {hybrid_names()} only; {mode} takes the group alone (pass None)"
        )
    if rule == "none":
        return 1, 1
    if rule == "heads":
        return 1, sp_degree
    return sp_degree, 1  # the sequence over the whole group


def head_degree(mode: str, sp_degree: int, ulysses_degree: int | None = None) -> int:
    """Over how many ranks the mode splits heads (1 = no head split)."""
    return degrees(mode, sp_degree, ulysses_degree)[1] if describe(mode).splits_heads else 1


def split_multiple(mode: str, sp_degree: int, ulysses_degree: int | None = None) -> int:
    """The number seq_len must be a multiple of for the mode to split it exactly over sp_degree ranks."""
    ring, uly = degrees(mode, sp_degree, ulysses_degree)
    layout = describe(mode).layout
    if layout == "whole":
        return 1
    if layout == "zigzag":
        return 2 * ring
    if layout == "zigzag+contiguous":
        return 2 * ring * uly
    return sp_degree  # contiguous chunks


def _multiple_words(mode: str, mult: int) -> str:
    layout = describe(mode).layout
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


__all__ = ["check_heads", "check_split", "degrees", "head_degree", "nearest_multiples", "split_multiple"]
