"""The verdict of ``seqpar check CONFIG...``: the merged readings (check.py) made a workload, a cluster and a strategy,
predicted by the cost model, and, when they do not fit, the fastest single change the tool can write that fits."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from seqpar.emit import tool_module
from seqpar.emit.check import SCRIPT_DEFAULTS, ConfigCheck, merge, read_all
from seqpar.emit.nearest import expressible
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan, Rationale, TrainingSpec
from seqpar.plan.modes import splits_sequence
from seqpar.plan.rules import layout_problems
from seqpar.plan.specs import Strategy, Workload


def _cluster(values: dict, flags, where: str):
    from seqpar.advisor.cluster import resolve_cluster

    world, nodes = values.get("world_size"), values.get("nodes")
    f = flags
    if world and f.cluster is None:
        n = f.nodes or nodes or 1
        gpus = f.gpus or (world // n if world % n == 0 else None)
        if gpus is None or gpus * n != world:
            raise SeqparError(f"{where}: num_processes {world} is not --gpus x --nodes ({f.gpus} x {n}); make them agree")
        return resolve_cluster(f.gpu, gpus, n, None, f.host_ram_gib, pinned_host=f.pinned_host_gib)
    cl, why = resolve_cluster(f.gpu, f.gpus, f.nodes, f.cluster, f.host_ram_gib, pinned_host=f.pinned_host_gib)
    if world and cl.world_size != world:
        raise SeqparError(f"{where}: num_processes {world} but --cluster {f.cluster} has {cl.world_size} ranks; make them agree")
    return cl, why


def check_configs(paths: list[Path], flags, note=print, coeffs=None) -> ConfigCheck:
    """The OOM verdict for one launch's tool configs (see check.py); ``flags``: seqpar check's RequestFlags."""
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.memory import estimate_memory
    from seqpar.advisor.cost.predict import predict
    from seqpar.plan.units import parse_seq_len
    from seqpar.profiles import get_model

    c = coeffs or load_coefficients()
    readings = read_all(paths)
    where = ", ".join(r.path.name for r in readings)
    v, defaults = merge(readings), []
    for name, pin in flags.pins().items():
        if pin is None:
            continue
        own = {
            "checkpoint_layers": "--recompute-layers",
            "offload_layers": "--offload-layers",
            "kept_saves": "--kept-saves",
            "kept_host_layers": "--kept-host-layers",
        }
        if name in own:  # seqpar's own layer split: none of these tools has it
            flag = own[name]
            raise SeqparError(
                f"{flag} {pin}: {where} cannot split checkpointing by layer (a seqpar plan field); drop {flag}, "
                "or check a seqpar plan that has it"
            )
        if name in v and v[name] != pin:
            raise SeqparError(
                f"--{name.replace('_', '-')} {pin} disagrees with {where} ({v[name]}); drop the flag or change the config"
            )
        v[name] = pin
        defaults.append(f"{name} {pin} (--{name.replace('_', '-')})")
    if "model" not in v:
        v["model"] = flags.model
        defaults.append(f"model {flags.model} (--model; no file names the model)")
    if "seq_len" not in v:
        if flags.seq_len is None:
            raise SeqparError(f"{where} does not say the sequence length; pass --seq-len (e.g. --seq-len 128k)")
        v["seq_len"] = parse_seq_len(flags.seq_len)
        defaults.append(f"seq_len {v['seq_len']} (--seq-len)")
    if "micro_batch_size" not in v:
        v["micro_batch_size"] = flags.micro_batch
        defaults.append(f"micro_batch_size {flags.micro_batch} (--micro-batch)")
    if "mode" in v and not splits_sequence(v["mode"]):
        v.setdefault("sp_degree", 1)
    for name, value in SCRIPT_DEFAULTS.items():
        if name not in v:
            v[name] = value
            defaults.append(f"{name} {value} (a plain transformers script's default)")
    cl, cluster_note = _cluster(v, flags, where)
    note(f"cluster: {cluster_note}")
    model = get_model(v["model"])
    sp, world = v["sp_degree"], cl.world_size
    if world % sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise SeqparError(f"{where}: the sequence-parallel degree {sp} does not divide the {world} GPUs; use one of {divisors}")
    if v["sharding"].startswith("zero"):
        v["optimizer"] = "adamw"  # DeepSpeed's bf16 keeps an fp32 master copy of AdamW
    v.setdefault("optimizer", flags.optimizer)
    v.setdefault("dtype", "fp32" if cl.accelerator == "cpu" else "bf16")
    s = Strategy.over(
        v["mode"],
        sp,
        world,
        checkpointing=v["checkpointing"],
        sharding=v["sharding"],
        loss_impl=v["loss_impl"],
        gradient_accumulation_steps=v["gradient_accumulation_steps"],
        fused_ops=v["fused_ops"],
        tiled_mlp=v["tiled_mlp"],
    )
    ga, micro = v["gradient_accumulation_steps"], v["micro_batch_size"]
    tokens = ga * micro * v["seq_len"] * s.dp_degree if ga > 1 else None
    w = Workload(
        model=model,
        seq_len=v["seq_len"],
        micro_batch_size=micro,
        tokens_per_step=tokens,
        dtype=v["dtype"],
        optimizer=v["optimizer"],
    )
    problems = layout_problems(s, w.seq_len, model, cl)
    if problems:
        raise SeqparError(f"{where}: {problems[0]}")
    plan = _as_plan(w, cl, s, where)
    mem = estimate_memory(w, cl, s, c)
    res = ConfigCheck(readings, _judge(readings), plan, predict(w, cl, s, c), mem.reason, defaults)
    if not res.fits:
        _fix(res, c)
    return res


def _judge(readings) -> str:
    kinds = [r.kind for r in readings]
    return "trl" if "trl" in kinds else kinds[-1]


def _as_plan(w, cl, s, where: str) -> LaunchPlan:
    """The configs as a plan object (not validated: the tool, not seqpar's runtime, runs it)."""
    why = Rationale(policy="pinned", reasons=[f"read from {where}"])
    return LaunchPlan.model_construct(
        schema_version=1, created_by="", created_at="", workload=w, cluster=cl, strategy=s, prediction=None, rationale=why,
        training=TrainingSpec(), stages=[],
    )  # fmt: skip


def _variants(caps, s: Strategy, w: Workload, cl):
    """(what changed, strategy) for each single change the tool can write that splits the sequence and the heads."""
    singles = [("checkpointing", ck) for ck in ("full", "selective", "offload")]
    singles += [("sharding", sh) for sh in ("zero2", "zero3", "zero3_offload", "fsdp")]
    singles += [("loss_impl", "chunked"), ("tiled_mlp", True)]
    out = [(f"{k} {val}", s.model_copy(update={k: val})) for k, val in singles if getattr(s, k) != val]
    world = cl.world_size
    for mode in sorted(caps.runs):
        for sp in [1] if not splits_sequence(mode) else [d for d in range(2, world + 1) if world % d == 0]:
            if (mode, sp) != (s.mode, s.sp_degree):  # one key changes: the accumulation stays the config's
                keep = {k: getattr(s, k) for k in ("checkpointing", "sharding", "loss_impl", "fused_ops", "tiled_mlp")}
                keep["gradient_accumulation_steps"] = s.gradient_accumulation_steps
                out.append((f"{mode} sp {sp}", Strategy.over(mode, sp, world, **keep)))
    return [(what, x) for what, x in out if expressible(caps, x) and not layout_problems(x, w.seq_len, w.model, cl)]


def _fix(res: ConfigCheck, c) -> None:
    from seqpar.advisor.search import describe, evaluate

    w, cl, s = res.plan.workload, res.plan.cluster, res.plan.strategy
    mod = tool_module(res.tool)
    best = None
    for what, v in _variants(mod.CAPS, s, w, cl):
        cand = evaluate(w, cl, v, c)
        if cand.fits and (best is None or cand.tokens_per_s > best[0]):
            best = (cand.tokens_per_s, what, v)
    if best is None:
        res.fix = f"no single change {res.tool} can write fits; more GPUs or a shorter sequence (seqpar advise --max-seq-len)"
        return
    res.fix = f"{best[1]} -> fits, {best[0]:,.0f} tokens/s ({describe(best[2])})"
    res.fix_strategy = best[2]
    res.fix_keys = config_diff(mod, res.plan, s, best[2])


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out |= _flat(v, key + ".") if isinstance(v, dict) and v else {key: v}
    return out


def config_diff(mod, plan: LaunchPlan, old: Strategy, new: Strategy) -> list[str]:
    """'file: key: value' for each key the tool's config changes from ``old`` to ``new`` (None: the key goes away)."""
    before, after = (mod.files(plan, x, Path("check"))[0] for x in (old, new))
    out = []
    for p in sorted(set(before) | set(after), key=str):
        a, b = (_flat(yaml.safe_load(t[p]) if p in t else {}) for t in (before, after))
        role = p.name.removeprefix("check.")
        out += [f"{role}: {k}: {json.dumps(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return out


def config_lines(res: ConfigCheck) -> list[str]:
    """What `seqpar check CONFIG...` says: what it read, the verdict as for a plan, what is partial, what came from where."""
    from seqpar.advisor.explain import check_lines
    from seqpar.advisor.gate import CheckResult

    p, w = res.prediction, res.plan.workload
    terms = sorted(p.memory_breakdown_gib.items(), key=lambda kv: -kv[1])[:4]
    head = [
        "read: " + ", ".join(f"{r.path} ({r.kind})" for r in res.readings),
        f"as seqpar models it: {w.model.name} at {w.seq_len} tokens, micro-batch {w.micro_batch_size}, {w.dtype}, "
        f"optimizer {w.optimizer}, on {res.plan.cluster.world_size}x {res.plan.cluster.gpu.name}",
    ]
    cr = CheckResult(res.fits, p, terms, res.fix, res.fix_strategy, res.reason, 0 if res.fits else 1, res.plan)
    lines = head + [f"CANNOT RUN on this cluster: {why}" for why in res.blocked] + check_lines(cr)
    if res.fix_keys:
        lines.append(f"in {res.tool}'s keys: " + "; ".join(res.fix_keys))
    if res.not_understood:
        lines.append("PARTIAL verdict: the cost model does not describe " + "; ".join(res.not_understood))
    if res.defaults:
        lines.append("not in the config: " + "; ".join(res.defaults))
    if res.ignored:
        lines.append("ignored (not read by seqpar): " + ", ".join(res.ignored))
    return lines


def config_json(res: ConfigCheck) -> dict:
    w = res.plan.workload
    terms = sorted(res.prediction.memory_breakdown_gib.items(), key=lambda kv: -kv[1])[:4]
    return {
        "fits": res.fits,
        "exit_code": 0 if res.fits and not res.blocked else 1,
        "cannot_run": res.blocked,
        "partial": bool(res.not_understood),
        "configs": [{"path": str(r.path), "kind": r.kind, "read": r.used} for r in res.readings],
        "reason": res.reason,
        "fix": res.fix,
        "fix_keys": res.fix_keys,
        "fix_strategy": res.fix_strategy.model_dump() if res.fix_strategy else None,
        "biggest_terms_gib": dict(terms),
        "workload": {
            "model": w.model.name,
            "seq_len": w.seq_len,
            "micro_batch_size": w.micro_batch_size,
            "dtype": w.dtype,
            "optimizer": w.optimizer,
        },
        "strategy": res.plan.strategy.model_dump(),
        "prediction": res.prediction.model_dump(),
        "not_understood": res.not_understood,
        "defaults": res.defaults,
        "ignored": res.ignored,
    }


__all__ = ["check_configs", "config_diff", "config_json", "config_lines"]
