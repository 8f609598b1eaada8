"""Describe the machine through NVML (pynvml, from nvidia-ml-py): GPUs, links, topology; plus nodes from the launcher's variables.

``probe(nvml=None)`` imports pynvml unless given a module-like object with the same functions (tests pass an NVML double).
Without NVML (no driver, a laptop) the result says so and ``to_cluster()`` returns None, so the advisor falls back to flags
or the default cluster. Nothing here imports torch: NVML answers without creating a CUDA context.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field

from seqpar.plan.errors import SeqparError
from seqpar.plan.specs import ClusterSpec, GpuSpec
from seqpar.plan.units import GIB
from seqpar.profiles import get_link, gpu_profile, match_nvml_name


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProbedGpu(_Result):
    index: int = Field(description="NVML device index.")
    name: str = Field(description="Name as NVML reports it.")
    profile: Optional[str] = Field(description="The matching seqpar GPU profile, None when there is none.")
    memory_total_gib: float = Field(description="Total device memory, GiB (NVML).")
    memory_reserved_gib: Optional[float] = Field(
        default=None, description="Of the total, what the driver keeps (NVML v2 'reserved'); None where the driver has no v2."
    )
    memory_free_gib: float = Field(description="Free device memory now, GiB (NVML).")
    compute_capability: str = Field(description="CUDA compute capability, e.g. '9.0'.")
    nvlinks_active: int = Field(description="NVLink links in the enabled state (0 where NVLink is absent or unsupported).")
    pcie_gen: Optional[int] = Field(description="Maximum PCIe generation of the link (the current one drops when idle).")
    pcie_width: Optional[int] = Field(description="Maximum PCIe link width (lanes).")


class IbPort(_Result):
    device: str = Field(description="HCA name, e.g. mlx5_0.")
    port: int = Field(description="Port number.")
    state: str = Field(description="Port state, e.g. ACTIVE.")
    rate_gbps: float = Field(description="Link rate, Gb/s.")
    link_layer: str = Field(description="InfiniBand or Ethernet (RoCE).")


class ProbeResult(_Result):
    nvml_available: bool = Field(description="Whether NVML answered.")
    reason: str = Field(description="What the probe found, or why it found nothing.")
    driver_version: str = Field(default="", description="NVIDIA driver version.")
    gpus: list[ProbedGpu] = Field(default_factory=list, description="The GPUs visible to this process.")
    topology: list[list[str]] = Field(
        default_factory=list, description="Pairwise path: NVLink, PCIe switch, host bridge, cross-socket."
    )
    nodes: int = Field(default=1, description="Nodes of the job (torchrun or SLURM variables; 1 otherwise).")
    node_rank: int = Field(default=0, description="This node's rank in the job.")
    world_size: int = Field(default=1, description="Processes in the job (WORLD_SIZE or SLURM_NTASKS; 1 otherwise).")
    rank: int = Field(default=0, description="This process's global rank (RANK or SLURM_PROCID).")
    launcher: str = Field(default="none", description="torchrun, slurm or none: where nodes/ranks came from.")
    host_ram_gib: Optional[float] = Field(default=None, description="MemTotal of this host, GiB.")
    ib_ports: list[IbPort] = Field(default_factory=list, description="InfiniBand/RoCE ports from /sys/class/infiniband.")

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def matched_gpu(self) -> Optional[GpuSpec]:
        """The profile all GPUs share, or None (none found, unknown model, or a mix)."""
        names = {g.profile for g in self.gpus}
        if len(names) != 1 or None in names:
            return None
        return gpu_profile(names.pop()).spec

    def to_cluster(self, host_ram_gib: Optional[float] = None) -> Optional[ClusterSpec]:
        """The probed cluster (source='probed'); None without NVML or GPUs; SeqparError for GPUs seqpar has no profile for."""
        if not self.nvml_available or not self.gpus:
            return None
        spec = self.matched_gpu()
        if spec is None:
            found = sorted({g.name for g in self.gpus})
            raise SeqparError(
                f"probed GPU(s) {', '.join(found)} have no seqpar profile (or are mixed); declare one with --gpu NAME"
            )
        # Measured beats datasheet: the memory NVML reports (smaller under MIG) replaces the profile's figure.
        update = {"memory_gib": min(g.memory_total_gib for g in self.gpus)}
        reserved = [g.memory_reserved_gib for g in self.gpus if g.memory_reserved_gib is not None]
        if reserved:  # what CUDA can reach on the tightest GPU, from the driver itself
            update["driver_reserved_gib"] = max(reserved)
        spec = spec.model_copy(update=update)
        if self.gpu_count > 1 and all(t == "NVLink" for i, row in enumerate(self.topology) for j, t in enumerate(row) if i != j):
            kind = gpu_profile(spec.name).intra_node_link
            intra = kind if kind.startswith("nvlink") else ("nvlink4" if spec.compute_capability == "9.0" else "nvlink3")
        else:
            gens = [g.pcie_gen for g in self.gpus if g.pcie_gen]
            intra = "pcie5" if gens and min(gens) >= 5 else "pcie4"
        inter = None
        if self.nodes > 1:
            ib = [p.rate_gbps for p in self.ib_ports if p.state.upper() == "ACTIVE" and p.link_layer.lower() == "infiniband"]
            inter = get_link("ib_ndr" if ib and max(ib) >= 400 else "ib_hdr" if ib and max(ib) >= 200 else "ethernet")
        return ClusterSpec(
            accelerator="cuda",
            nodes=self.nodes,
            gpus_per_node=self.gpu_count,
            gpu=spec,
            intra_node_link=get_link(intra),
            inter_node_link=inter,
            host_ram_gib=host_ram_gib or self.host_ram_gib or 2.0 * self.gpu_count * spec.memory_gib,
            source="probed",
        )


def read_host_ram_gib(meminfo: str | Path = "/proc/meminfo") -> Optional[float]:
    """MemTotal from /proc/meminfo in GiB, or None where there is no such file (macOS, Windows)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2  # the file counts kB (KiB)
    except OSError:
        return None
    return None


def _topology_label(nvml: Any, a: Any, b: Any) -> str:
    """NVLink when NVML reports NVLink peer-to-peer between the two; otherwise the PCIe common ancestor's level."""
    try:
        if nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK:
            return "NVLink"
    except nvml.NVMLError:
        pass
    try:
        level = nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    except nvml.NVMLError:
        return "unknown"
    if level <= nvml.NVML_TOPOLOGY_INTERNAL:
        return "same board"
    if level <= nvml.NVML_TOPOLOGY_MULTIPLE:
        return "PCIe switch"
    if level <= nvml.NVML_TOPOLOGY_NODE:
        return "host bridge"
    return "cross-socket"


def _nvlinks(nvml: Any, h: Any) -> int:
    active = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(h, link) == nvml.NVML_FEATURE_ENABLED:
                active += 1
        except nvml.NVMLError:  # NotSupported (no NVLink, e.g. a lone PCIe H200) or InvalidArgument past the last link
            break
    return active


def _maybe(fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception:  # NVML answers NotSupported for fields a board lacks; the probe reports None for them
        return None


def _reserved(nvml, handle) -> Optional[float]:
    """GiB the driver keeps out of CUDA's reach (NVML's memory info version 2), None where the driver or binding lacks it."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is None:
        return None
    got = _maybe(lambda: nvml.nvmlDeviceGetMemoryInfo(handle, version=version))
    reserved = getattr(got, "reserved", None)
    return reserved / GIB if isinstance(reserved, (int, float)) and reserved >= 0 else None


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _visible(count: int, env: Mapping[str, str]) -> list[int]:
    """Device indices this process may use: CUDA_VISIBLE_DEVICES when it lists integers, else all (NVML ignores the variable)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return list(range(count))
    items = [x.strip() for x in cvd.split(",") if x.strip()]
    if all(x.isdigit() for x in items):
        return [int(x) for x in items if int(x) < count]
    return list(range(count))


def _job(env: Mapping[str, str]) -> dict:
    """nodes, node_rank, world_size, rank and launcher from torchrun's or SLURM's variables (one process otherwise)."""
    if "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:
        world, local = int(env["WORLD_SIZE"]), max(1, int(env["LOCAL_WORLD_SIZE"]))
        return dict(
            nodes=max(1, world // local),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            world_size=world,
            rank=int(env.get("RANK", 0)),
            launcher="torchrun",
        )
    nn = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if nn:
        return dict(
            nodes=max(1, int(nn)),
            node_rank=int(env.get("SLURM_NODEID", 0)),
            world_size=int(env.get("SLURM_NTASKS", nn)),
            rank=int(env.get("SLURM_PROCID", 0)),
            launcher="slurm",
        )
    return dict(nodes=1, node_rank=0, world_size=1, rank=0, launcher="none")


def infiniband_ports(root: str | Path = "/sys/class/infiniband") -> list[IbPort]:
    """Ports under /sys/class/infiniband/<hca>/ports/<n>/ (state '4: ACTIVE', rate '400 Gb/sec (4X NDR)')."""
    out = []
    base = Path(root)
    if not base.is_dir():
        return out
    for hca in sorted(base.iterdir()):
        for port in sorted((hca / "ports").glob("*")):
            try:
                state = (port / "state").read_text().strip().split(":")[-1].strip()
                rate = float((port / "rate").read_text().split()[0])
                layer = (port / "link_layer").read_text().strip() if (port / "link_layer").exists() else "InfiniBand"
            except (OSError, ValueError, IndexError):
                continue
            out.append(IbPort(device=hca.name, port=int(port.name), state=state, rate_gbps=rate, link_layer=layer))
    return out


def probe(
    nvml: Any = None,
    env: Optional[Mapping[str, str]] = None,
    ib_root: str | Path = "/sys/class/infiniband",
    meminfo: str | Path = "/proc/meminfo",
) -> ProbeResult:
    """Probe this machine. ``nvml``: the pynvml module (default) or a double with the same functions."""
    env = os.environ if env is None else env
    common = dict(**_job(env), host_ram_gib=read_host_ram_gib(meminfo), ib_ports=infiniband_ports(ib_root))
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return ProbeResult(nvml_available=False, reason="pynvml is not installed (pip install nvidia-ml-py)", **common)
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return ProbeResult(
            nvml_available=False, reason=f"NVML is not available ({e}): no NVIDIA driver on this machine", **common
        )
    try:
        handles = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in _visible(nvml.nvmlDeviceGetCount(), env)]
        gpus = []
        for i, h in handles:
            name = _text(nvml.nvmlDeviceGetName(h))
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            reserved = _reserved(nvml, h)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            prof = match_nvml_name(name)
            gpus.append(
                ProbedGpu(
                    index=i,
                    name=name,
                    profile=prof.name if prof else None,
                    memory_total_gib=mem.total / GIB,
                    memory_reserved_gib=reserved,
                    memory_free_gib=mem.free / GIB,
                    compute_capability=f"{major}.{minor}",
                    nvlinks_active=_nvlinks(nvml, h),
                    pcie_gen=_maybe(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                    pcie_width=_maybe(nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                )
            )
        topo = [["self" if a == b else _topology_label(nvml, ha, hb) for b, hb in handles] for a, ha in handles]
        driver = _text(_maybe(nvml.nvmlSystemGetDriverVersion) or "")
    finally:
        nvml.nvmlShutdown()
    reason = f"NVML found {len(gpus)} GPU(s)" + (f": {gpus[0].name}" if gpus and len({g.name for g in gpus}) == 1 else "")
    return ProbeResult(nvml_available=True, reason=reason, driver_version=driver, gpus=gpus, topology=topo, **common)
