"""Cluster descriptions: the default (EasyContext's hardware), one built from flags, a CPU (gloo) one, and the choice between them.

Precedence when advising: flags (``--gpu/--gpus/--nodes`` or ``--cluster cpu:N``), else what the probe finds, else the default.
Every resolution returns a note saying which, for ``rationale.cluster_note`` and stderr.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from pydantic import ValidationError

from seqpar.advisor.probe import probe, read_host_ram_gib
from seqpar.plan.errors import SeqparError
from seqpar.plan.files import first_error
from seqpar.plan.specs import ClusterSpec
from seqpar.profiles import get_link, gpu_profile

# EasyContext's published hardware: one DGX-style node of 8x A100-80G SXM with NVLink3. EasyContext publishes no host RAM;
# a DGX A100 ships 1 TB (320 GB model) or 2 TB (640 GB model), so 1 TiB is the conservative choice.
DEFAULT_GPU, DEFAULT_GPUS_PER_NODE, DEFAULT_HOST_RAM_GIB = "a100-80g-sxm", 8, 1024.0


# Bounds on a declared cluster: the search tries every degree up to the world size, so an absurd count would run for
# ever; these are well past any machine (the largest NVLink domains hold 576 GPUs; the largest jobs, ~10^5 GPUs).
MAX_GPUS_PER_NODE = 1024
MAX_NODES = 131072
MAX_CPU_RANKS = 1024


def default_cluster() -> ClusterSpec:
    """8x A100-80G SXM, NVLink3, one node: the hardware of EasyContext's published results."""
    return cluster_from_flags(DEFAULT_GPU, DEFAULT_GPUS_PER_NODE, 1, host_ram_gib=DEFAULT_HOST_RAM_GIB, source="default")


def cluster_from_flags(
    gpu: str, gpus: int = 8, nodes: int = 1, host_ram_gib: Optional[float] = None, source: str = "declared"
) -> ClusterSpec:
    """A homogeneous cluster of ``nodes`` x ``gpus`` (GPUs per node) of one GPU profile, with that board's usual links."""
    for what, v, most in (("--gpus", gpus, MAX_GPUS_PER_NODE), ("--nodes", nodes, MAX_NODES)):
        if not isinstance(v, int) or v < 1:
            raise SeqparError(f"{what} {v!r} must be a positive whole number; e.g. {what} 8")
        if v > most:
            raise SeqparError(f"{what} {v} is more than the {most} seqpar plans for; give {what} {most} or fewer")
    if host_ram_gib is not None and host_ram_gib <= 0:
        raise SeqparError(f"--host-ram-gib {host_ram_gib} must be positive; e.g. 1024")
    prof = gpu_profile(gpu)
    if prof.spec.name == "cpu":
        return cpu_cluster(gpus * nodes)
    # Without a figure, assume DGX-style nodes: host RAM twice the node's GPU memory (DGX A100/H100: 2 TB for 640 GB).
    ram = host_ram_gib if host_ram_gib is not None else max(64.0, 2.0 * gpus * round(prof.spec.memory_gib))
    return ClusterSpec(
        accelerator="cuda",
        nodes=nodes,
        gpus_per_node=gpus,
        gpu=prof.spec,
        intra_node_link=get_link(prof.intra_node_link),
        inter_node_link=get_link(prof.inter_node_link) if nodes > 1 else None,
        host_ram_gib=ram,
        source=source,
    )


def cpu_cluster(n: int) -> ClusterSpec:
    """``n`` CPU ranks on this host, talking gloo over loopback (tests, examples, smoke runs)."""
    if not isinstance(n, int) or n < 1:
        raise SeqparError(f"cpu cluster size {n!r} must be a positive whole number; e.g. --cluster cpu:2")
    if n > MAX_CPU_RANKS:
        raise SeqparError(
            f"--cluster cpu:{n}: more CPU ranks than the {MAX_CPU_RANKS} one host runs; give cpu:{MAX_CPU_RANKS} or fewer"
        )
    return ClusterSpec(
        accelerator="cpu",
        nodes=1,
        gpus_per_node=n,
        gpu=gpu_profile("cpu").spec,
        intra_node_link=get_link("loopback"),
        host_ram_gib=read_host_ram_gib() or 16.0,
        source="declared",
    )


_CPU_RE = re.compile(r"^\s*cpu\s*:\s*(\S+)\s*$", re.I)


def parse_cluster(text: str) -> ClusterSpec:
    """``cpu:N`` -> cpu_cluster(N). (GPU clusters are declared with --gpu/--gpus/--nodes.)"""
    m = _CPU_RE.match(text)
    if not m:
        raise SeqparError(f"--cluster {text!r} is not understood; write cpu:N (e.g. cpu:2), or use --gpu NAME --gpus N --nodes N")
    try:
        n = int(m.group(1))
    except ValueError:
        raise SeqparError(f"--cluster {text!r}: {m.group(1)!r} is not a whole number; e.g. cpu:2") from None
    if n < 1:
        raise SeqparError(f"--cluster {text!r}: the rank count must be positive; e.g. cpu:2")
    return cpu_cluster(n)


def resolve_cluster(
    gpu: Optional[str] = None,
    gpus: Optional[int] = None,
    nodes: Optional[int] = None,
    cluster: Optional[str] = None,
    host_ram: Optional[float] = None,
    probe_fn: Optional[Callable] = None,
    pinned_host: Optional[float] = None,
) -> tuple[ClusterSpec, str]:
    """Flags, else the probe, else the default; returns the cluster and a note saying which (and why). ``pinned_host``
    (--pinned-host-gib) states the page-locked host memory per node of whichever it is."""
    c, note = _resolve(gpu, gpus, nodes, cluster, host_ram, probe_fn)
    return with_pinned_host(c, pinned_host), note


def with_pinned_host(c: ClusterSpec, gib: Optional[float], what: str = "--pinned-host-gib") -> ClusterSpec:
    """``c`` with ``gib`` of its nodes' host RAM page-lockable (None leaves the default share), judged by ClusterSpec's
    own rules; ``what`` names where the figure came from in the error."""
    if gib is None:
        return c
    try:
        return ClusterSpec.model_validate({**c.model_dump(), "pinned_host_gib": gib})
    except ValidationError as e:
        why = first_error(e)
        fix = "" if "pin at most" in why else "; give a positive, finite amount of GiB per node, e.g. 75"
        raise SeqparError(f"{what} {gib:g}: {why}{fix}") from None


def _resolve(
    gpu: Optional[str], gpus: Optional[int], nodes: Optional[int], cluster: Optional[str], host_ram: Optional[float], probe_fn
) -> tuple[ClusterSpec, str]:
    if cluster is not None:
        if gpu is not None or gpus is not None or nodes is not None:
            raise SeqparError("--cluster cannot be combined with --gpu/--gpus/--nodes; use one or the other")
        c = parse_cluster(cluster)
        return c, f"declared: --cluster {cluster.strip()} ({c.world_size} CPU ranks, gloo)"
    probed = None
    if gpu is None or gpus is None:
        probed = (probe_fn or probe)()
    if gpu is not None or gpus is not None or nodes is not None:
        # Fill what the flags leave open from the probe when it found profiled GPUs, else from the default.
        base = probed.matched_gpu() if probed is not None else None
        g = gpu or (base.name if base else DEFAULT_GPU)
        n_gpus = gpus or (probed.gpu_count if base else DEFAULT_GPUS_PER_NODE)
        c = cluster_from_flags(g, n_gpus, nodes or 1, host_ram_gib=host_ram, source="declared")
        src = "the probe" if base else "the default"
        filled = ([f"GPU type from {src}"] if gpu is None else []) + ([f"GPUs per node from {src}"] if gpus is None else [])
        return c, f"declared: {c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name}" + (f" ({'; '.join(filled)})" if filled else "")
    try:
        c = probed.to_cluster(host_ram_gib=host_ram) if probed is not None else None
    except SeqparError as e:
        c, why = None, str(e)
    else:
        why = probed.reason if probed is not None else "not probed"
    if c is not None:
        return c, f"probed: {c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name}, {c.intra_node_link.kind} inside the node"
    d = default_cluster()
    return (
        d,
        f"default: 8x A100-80G SXM, NVLink3, one node (EasyContext's published hardware); probe: {why}; declare yours with --gpu/--gpus/--nodes",
    )
