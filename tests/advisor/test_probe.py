"""The NVML probe, driven by an NVML double (the only fake): 1 GPU (the project's H200: PCIe gen5, no NVLink), 2 and 8 GPUs
with and without NVLink, unknown boards, no driver; nodes from torchrun/SLURM variables; InfiniBand ports from a sysfs tree."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from seqpar.advisor.cluster import resolve_cluster
from seqpar.advisor.probe import infiniband_ports, probe
from seqpar.plan.errors import SeqparError

MIB = 2**20
LEVEL_LABEL = {
    pynvml.NVML_TOPOLOGY_SINGLE: "PCIe switch",
    pynvml.NVML_TOPOLOGY_MULTIPLE: "PCIe switch",
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: "host bridge",
    pynvml.NVML_TOPOLOGY_NODE: "host bridge",
    pynvml.NVML_TOPOLOGY_SYSTEM: "cross-socket",
}


class NVMLDouble:
    """The subset of pynvml that seqpar.advisor.probe calls, answering like a machine of ``n`` identical GPUs.

    ``nvlinks``: active links per GPU (0 = NVLink absent: state queries answer NotSupported, as on the lone H200).
    ``level(a, b)``: the PCIe common-ancestor level between two GPUs.
    """

    NVMLError = pynvml.NVMLError

    def __init__(
        self,
        name,
        n,
        mem_mib,
        cc,
        nvlinks=0,
        pcie=(5, 16),
        level=lambda a, b: pynvml.NVML_TOPOLOGY_SINGLE,
        present=True,
        reserved_mib=None,
    ):
        self.name, self.n, self.mem_mib, self.cc, self.nvlinks, self.pcie, self.level, self.present = (
            name,
            n,
            mem_mib,
            cc,
            nvlinks,
            pcie,
            level,
            present,
        )
        self.calls = []
        self.reserved_mib = reserved_mib
        if reserved_mib is not None:  # a driver with the memory info's version 2, which reports the driver's reserve
            self.nvmlMemory_v2 = pynvml.nvmlMemory_v2
        for k in dir(pynvml):  # the real constants, so the probe reads the same numbers it would from pynvml
            if k.startswith("NVML_"):
                setattr(self, k, getattr(pynvml, k))

    def nvmlInit(self):
        self.calls.append("init")
        if not self.present:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        assert 0 <= i < self.n
        return i

    def nvmlDeviceGetName(self, h):
        return self.name

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        if version is None:
            return SimpleNamespace(total=self.mem_mib * MIB, free=(self.mem_mib - 600) * MIB, used=600 * MIB)
        assert version == pynvml.nvmlMemory_v2 and self.reserved_mib is not None
        used = 600 - self.reserved_mib
        return SimpleNamespace(
            total=self.mem_mib * MIB, reserved=self.reserved_mib * MIB, free=(self.mem_mib - 600) * MIB, used=used * MIB
        )

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.cc

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= self.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        return pynvml.NVML_P2P_STATUS_OK if self.nvlinks else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.level(a, b)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self.pcie[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self.pcie[1]

    def nvmlSystemGetDriverVersion(self):
        return "580.95.05"


def two_sockets(a, b):
    """8 PCIe GPUs: pairs under one switch, 0-3 on socket 0 and 4-7 on socket 1."""
    if a // 2 == b // 2:
        return pynvml.NVML_TOPOLOGY_SINGLE
    if a // 4 == b // 4:
        return pynvml.NVML_TOPOLOGY_HOSTBRIDGE
    return pynvml.NVML_TOPOLOGY_SYSTEM


# (id, double, expected profile, expected intra-node link, expected NVLinks per GPU)
MACHINES = [
    ("1x H200 (project machine)", lambda: NVMLDouble("NVIDIA H200", 1, 143771, (9, 0)), "h200", "pcie5", 0),
    ("2x H100 SXM, NVLink", lambda: NVMLDouble("NVIDIA H100 80GB HBM3", 2, 81559, (9, 0), nvlinks=18), "h100-sxm", "nvlink4", 18),
    ("2x L40S, PCIe switch", lambda: NVMLDouble("NVIDIA L40S", 2, 46068, (8, 9), pcie=(4, 16)), "l40s", "pcie4", 0),
    (
        "8x A100 SXM, NVLink",
        lambda: NVMLDouble("NVIDIA A100-SXM4-80GB", 8, 81920, (8, 0), nvlinks=12, pcie=(4, 16)),
        "a100-80g-sxm",
        "nvlink3",
        12,
    ),
    (
        "8x H100 PCIe, no NVLink",
        lambda: NVMLDouble("NVIDIA H100 PCIe", 8, 81559, (9, 0), level=two_sockets),
        "h100-pcie",
        "pcie5",
        0,
    ),
]


@pytest.mark.parametrize("label,make,profile,link,nvlinks", MACHINES, ids=[m[0] for m in MACHINES])
def test_probe_machines(label, make, profile, link, nvlinks):
    nv = make()
    res = probe(nvml=nv, env={}, ib_root="/nonexistent")
    assert res.nvml_available and res.gpu_count == nv.n
    assert nv.calls[0] == "init" and nv.calls[-1] == "shutdown"
    for i, g in enumerate(res.gpus):
        assert (g.index, g.name, g.profile) == (i, nv.name, profile)
        assert g.memory_total_gib == nv.mem_mib / 1024
        assert g.memory_free_gib == (nv.mem_mib - 600) / 1024
        assert g.compute_capability == f"{nv.cc[0]}.{nv.cc[1]}"
        assert (g.nvlinks_active, g.pcie_gen, g.pcie_width) == (nvlinks, nv.pcie[0], nv.pcie[1])
    for a in range(nv.n):
        for b in range(nv.n):
            want = "self" if a == b else "NVLink" if nvlinks else LEVEL_LABEL[nv.level(a, b)]
            assert res.topology[a][b] == want
    c = res.to_cluster()
    assert (c.source, c.nodes, c.gpus_per_node, c.gpu.name, c.intra_node_link.kind) == ("probed", 1, nv.n, profile, link)
    assert c.gpu.memory_gib == nv.mem_mib / 1024  # NVML's figure, not the datasheet's
    assert c.inter_node_link is None


def test_probe_reads_the_drivers_reserve_and_the_capacity_follows():
    """NVML v2's 'reserved' is memory no process can allocate: the probed GPU carries it, and the capacity the cost model
    gates against is NVML's total less it (what torch.cuda.mem_get_info reports as the total)."""
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.memory import capacity_bytes

    c = probe(nvml=NVMLDouble("NVIDIA H100 80GB HBM3", 2, 81559, (9, 0), reserved_mib=455), env={}).to_cluster()
    assert c.gpu.driver_reserved_gib == 455 / 1024
    assert capacity_bytes(c, load_coefficients()) == (81559 - 455) * MIB
    # a driver without version 2: the profile's measured reserve stays
    old = probe(nvml=NVMLDouble("NVIDIA H100 80GB HBM3", 1, 81559, (9, 0)), env={}).to_cluster()
    from seqpar.profiles import get_gpu

    assert old.gpu.driver_reserved_gib == get_gpu("h100-sxm").driver_reserved_gib


def test_probe_h200_matches_profile_memory():
    """The H200 profile stores memory as NVML reports it on the project's machine (143771 MiB)."""
    c = probe(nvml=NVMLDouble("NVIDIA H200", 1, 143771, (9, 0)), env={}).to_cluster()
    from seqpar.profiles import get_gpu

    assert c.gpu.model_dump() == get_gpu("h200").model_dump()


def test_probe_without_nvml_says_so_and_advise_falls_back():
    res = probe(nvml=NVMLDouble("NVIDIA H200", 1, 143771, (9, 0), present=False), env={})
    assert not res.nvml_available and "NVML is not available" in res.reason and res.gpus == []
    assert res.to_cluster() is None
    cluster, note = resolve_cluster(probe_fn=lambda: res)
    assert cluster.source == "default" and note.startswith("default: 8x A100-80G SXM") and "NVML is not available" in note
    assert (cluster.world_size, cluster.gpu.name, cluster.intra_node_link.kind) == (8, "a100-80g-sxm", "nvlink3")


def test_probe_real_pynvml_on_this_machine():
    res = probe()
    if res.nvml_available:
        pytest.skip("this machine has an NVIDIA driver; the double covers the no-driver path")
    assert "NVML" in res.reason and res.to_cluster() is None


def test_unknown_board_is_reported_not_guessed():
    res = probe(nvml=NVMLDouble("NVIDIA B200", 8, 183359, (10, 0), nvlinks=18), env={})
    assert res.gpus[0].profile is None and res.matched_gpu() is None
    with pytest.raises(SeqparError, match=r"NVIDIA B200 have no seqpar profile.*--gpu"):
        res.to_cluster()
    cluster, note = resolve_cluster(probe_fn=lambda: res)
    assert cluster.source == "default" and "no seqpar profile" in note


def test_flags_fill_gaps_from_probe():
    res = probe(nvml=NVMLDouble("NVIDIA H200", 1, 143771, (9, 0)), env={})
    cluster, note = resolve_cluster(nodes=2, probe_fn=lambda: res)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu.name, cluster.source) == (2, 1, "h200", "declared")
    assert "GPU type from the probe" in note and cluster.inter_node_link.kind == "ib_ndr"


def test_cuda_visible_devices_restricts():
    res = probe(nvml=NVMLDouble("NVIDIA A100-SXM4-80GB", 8, 81920, (8, 0), nvlinks=12), env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert [g.index for g in res.gpus] == [2, 3] and res.to_cluster().gpus_per_node == 2


def _ib_tree(root, ports):
    for dev, port, state, rate, layer in ports:
        d = root / dev / "ports" / str(port)
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "rate").write_text(rate + "\n")
        (d / "link_layer").write_text(layer + "\n")


@pytest.mark.parametrize(
    "env,nodes,node_rank,world,rank,launcher",
    [
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1", "RANK": "11"}, 2, 1, 16, 11, "torchrun"),
        ({"SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "3", "SLURM_NTASKS": "32", "SLURM_PROCID": "25"}, 4, 3, 32, 25, "slurm"),
        ({}, 1, 0, 1, 0, "none"),
    ],
)
def test_nodes_from_launcher_and_infiniband(tmp_path, env, nodes, node_rank, world, rank, launcher):
    _ib_tree(
        tmp_path,
        [
            ("mlx5_0", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand"),
            ("mlx5_1", 1, "1: DOWN", "10 Gb/sec (4X SDR)", "InfiniBand"),
        ],
    )
    res = probe(nvml=NVMLDouble("NVIDIA H100 80GB HBM3", 8, 81559, (9, 0), nvlinks=18), env=env, ib_root=tmp_path)
    assert (res.nodes, res.node_rank, res.world_size, res.rank, res.launcher) == (nodes, node_rank, world, rank, launcher)
    c = res.to_cluster()
    assert c.nodes == nodes and c.world_size == 8 * nodes
    assert (c.inter_node_link.kind if c.inter_node_link else None) == ("ib_ndr" if nodes > 1 else None)


def test_infiniband_ports_parsing(tmp_path):
    _ib_tree(
        tmp_path,
        [
            ("mlx5_0", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand"),
            ("mlx5_2", 1, "4: ACTIVE", "100 Gb/sec (4X EDR)", "Ethernet"),
        ],
    )
    ports = infiniband_ports(tmp_path)
    assert [(p.device, p.port, p.state, p.rate_gbps, p.link_layer) for p in ports] == [
        ("mlx5_0", 1, "ACTIVE", 200.0, "InfiniBand"),
        ("mlx5_2", 1, "ACTIVE", 100.0, "Ethernet"),
    ]
    assert infiniband_ports(tmp_path / "missing") == []


def test_host_ram_from_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       263852252 kB\nMemFree:        1000 kB\n")
    res = probe(nvml=NVMLDouble("NVIDIA H200", 1, 143771, (9, 0)), env={}, meminfo=tmp_path / "meminfo")
    assert res.host_ram_gib == 263852252 / 1024**2 and res.to_cluster().host_ram_gib == res.host_ram_gib
