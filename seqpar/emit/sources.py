"""Where each value of a launch ``seqpar check`` reads comes from, after the tool's own keys: the flags given on the
command line, then the files' ``seqpar:`` block (seqpar.emit.assumed), then a default, which the check names on a line
of its own ("assumed: ..."). Here: which flags were given, and the cluster (the keys num_processes, num_machines and
use_cpu first; then --gpu/--gpus/--nodes/--cluster/--host-ram-gib; then the block; then the probe or seqpar's default).
"""

from __future__ import annotations

from seqpar.plan.errors import SeqparError

OWN_SPLIT = {
    "checkpoint_layers": "--recompute-layers",
    "offload_layers": "--offload-layers",
    "kept_saves": "--kept-saves",
    "kept_host_layers": "--kept-host-layers",
}
NO_BLOCK = "no seqpar: block"


def given_flags(flags, ctx=None) -> set[str]:
    """The RequestFlags fields given on the command line: those whose source in the typer context ``ctx`` is not the
    default, else (no context: a call from Python) those off their defaults."""
    import dataclasses

    out = set()
    for f in dataclasses.fields(flags):
        src = ctx.get_parameter_source(f.name) if ctx is not None else None
        if src is not None and src.name != "DEFAULT" or src is None and getattr(flags, f.name) != f.default:
            out.add(f.name)
    return out


def launch_cluster(v: dict, block: dict, flags, where: str, said: list[str]):
    """The cluster: the tool's keys (num_processes, num_machines, use_cpu), then the flags, then the seqpar: block, then
    the probe or the default; each value taken from none of the first three goes to ``said`` as an assumption."""
    from seqpar.advisor.cluster import cpu_cluster, resolve_cluster, with_pinned_host
    from seqpar.profiles import get_link, gpu_profile

    f = flags
    world, nodes, cpu = v.get("world_size"), v.get("nodes"), v.get("accelerator") == "cpu"
    if cpu and f.gpu is not None and gpu_profile(f.gpu).spec.name != "cpu":
        raise SeqparError(
            f"{where} runs on CPU ranks (use_cpu true or distributed_type MULTI_CPU), but --gpu {f.gpu} names a GPU; drop "
            "--gpu, or the config's CPU key"
        )
    if f.cluster is not None:
        cl, why = resolve_cluster(None, None, None, f.cluster, f.host_ram_gib, pinned_host=f.pinned_host_gib)
        if world and cl.world_size != world:
            raise SeqparError(
                f"{where}: num_processes {world} but --cluster {f.cluster} has {cl.world_size} ranks; make them agree"
            )
        return cl, why
    if nodes and f.nodes is not None and f.nodes != nodes:
        raise SeqparError(f"--nodes {f.nodes} disagrees with {where} (num_machines {nodes}); drop the flag or change the config")
    nodes = nodes or f.nodes or block.get("nodes") or 1
    gpu = f.gpu or ("cpu" if cpu else None) or block.get("gpu")
    if world and f.gpus is not None and f.gpus * nodes != world:
        raise SeqparError(f"{where}: num_processes {world} is not --gpus x --nodes ({f.gpus} x {nodes}); make them agree")
    world = world or (f.gpus * nodes if f.gpus else None) or block.get("world_size")
    if world and world % nodes:
        raise SeqparError(f"{where}: {world} ranks do not split over {nodes} nodes; make num_processes a multiple of them")
    gpus = world // nodes if world else None
    ram = f.host_ram_gib if f.host_ram_gib is not None else block.get("host_ram_gib")
    pinned = f.pinned_host_gib if f.pinned_host_gib is not None else block.get("pinned_host_gib")
    if gpu is not None and gpu_profile(gpu).spec.name == "cpu":
        cl = cpu_cluster(world or 1)
        why = f"{cl.world_size} CPU ranks, gloo" + (" (use_cpu)" if cpu else "")
        if world is None:
            said.append(f"assumed: 1 CPU rank (no file says the ranks, {NO_BLOCK} and no --gpus)")
        if ram is not None:
            cl = cl.model_copy(update={"host_ram_gib": ram})
        else:
            said.append(f"assumed: host RAM {cl.host_ram_gib:.0f} GiB (this machine's; {NO_BLOCK} and no --host-ram-gib)")
    else:
        cl, why = resolve_cluster(gpu, gpus, nodes, None, ram)
        probed = cl.source == "probed" or "from the probe" in why
        src = "this machine's, probed" if probed else "seqpar's default, EasyContext's 8x A100-80G"
        if gpu is None:
            said.append(f"assumed: GPU {cl.gpu.name} ({NO_BLOCK} and no --gpu; {src})")
        if gpus is None:
            said.append(f"assumed: {cl.gpus_per_node} GPUs per node (no file says the ranks, {NO_BLOCK} and no --gpus; {src})")
        if ram is None:
            ram_src = "this machine's" if cl.source == "probed" else "twice its GPUs' memory"
            said.append(f"assumed: host RAM {cl.host_ram_gib:.0f} GiB per node ({ram_src}; {NO_BLOCK} and no --host-ram-gib)")
    links = {k: get_link(block[k]) for k in ("intra_node_link", "inter_node_link") if k in block}
    if links and f.gpu is None:  # the block's cluster was probed with links other than the GPU's usual ones
        cl = cl.model_copy(update=links)
    if pinned is not None:
        cl = with_pinned_host(cl, pinned, "--pinned-host-gib" if f.pinned_host_gib is not None else f"{where}'s pinned_host_gib")
    if block.get("gpu") and gpu == block.get("gpu") and f.gpu is None:
        why = f"from the seqpar: block of {where}: {cl.nodes} node(s) x {cl.gpus_per_node} {cl.gpu.name}"
    return cl, why


__all__ = ["NO_BLOCK", "OWN_SPLIT", "given_flags", "launch_cluster"]
