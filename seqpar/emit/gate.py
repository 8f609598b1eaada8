"""The verdict of ``seqpar check CONFIG...``: the merged readings (check.py) made a workload, a cluster and a strategy
(what the tool's keys do not say from the flags, the files' seqpar: block or a default: sources.py), predicted by the
cost model, and, when they do not fit, the fastest single change the tool can write that fits."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from seqpar.emit import tool_module
from seqpar.emit.assumed import RECORDS
from seqpar.emit.check import SCRIPT_DEFAULTS, ConfigCheck, merge, merge_assumed, read_all
from seqpar.emit.nearest import expressible
from seqpar.emit.sources import NO_BLOCK, OWN_SPLIT, given_flags, launch_cluster
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan, Rationale, TrainingSpec
from seqpar.plan.lora import lora_text
from seqpar.plan.modes import splits_sequence
from seqpar.plan.rules import kept_problems, layout_problems, split_problems
from seqpar.plan.specs import Strategy, Workload


def check_configs(paths: list[Path], flags, note=print, coeffs=None, given: set[str] | None = None) -> ConfigCheck:
    """The OOM verdict for one launch's tool configs (see check.py); ``flags``: seqpar check's RequestFlags; ``given``:
    the flags given on the command line (given_flags). Each value comes from the tool's keys, else a given flag, else the
    files' seqpar: block (seqpar.emit.assumed), else a default, and each default is one "assumed:" line."""
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.memory import estimate_memory
    from seqpar.advisor.cost.predict import predict
    from seqpar.emit.capabilities import TABLE
    from seqpar.plan.units import parse_seq_len
    from seqpar.profiles import get_model

    c = coeffs or load_coefficients()
    readings = read_all(paths)
    where = ", ".join(r.path.name for r in readings)
    v, block, said = merge(readings), merge_assumed(readings), []
    given = given_flags(flags) if given is None else given
    caps = TABLE[_judge(readings)]
    for name, pin in flags.pins().items():
        if pin is None:
            continue
        if name in OWN_SPLIT and not caps.layer_split:  # seqpar's own layer split: only a script that runs it has it
            flag = OWN_SPLIT[name]
            raise SeqparError(
                f"{flag} {pin}: {where} cannot split checkpointing by layer (a seqpar plan field); drop {flag}, "
                "or check a seqpar plan that has it"
            )
        if name in v and v[name] != pin:
            raise SeqparError(
                f"--{name.replace('_', '-')} {pin} disagrees with {where} ({v[name]}); drop the flag or change the config"
            )
        was = f"; the seqpar: block says {block[name]}" if name in block and block[name] != pin else ""
        v[name] = pin
        said.append(f"given: {name} {pin} (--{name.replace('_', '-')}{was})")

    def take(name: str, flag: str | None, value, why: str) -> None:
        """``name`` from a given flag, else the block, else ``value`` (an assumption, with ``why``)."""
        if name in v:
            return
        if flag is not None and flag in given:
            v[name] = getattr(flags, flag)
            said.append(f"given: {name} {v[name]} (--{flag.replace('_', '-')})")
        elif name in block:
            v[name] = block[name]
        else:
            if value is None:
                raise SeqparError(why)
            v[name] = value
            said.append(f"assumed: {name} {value} ({why})")

    take("model", "model", flags.model, f"no file names the model, {NO_BLOCK} and no --model")
    if "seq_len" not in v and flags.seq_len is not None:
        v["seq_len"] = parse_seq_len(flags.seq_len)
        said.append(f"given: seq_len {v['seq_len']} (--seq-len)")
    take("seq_len", None, None, f"{where} does not say the sequence length; pass --seq-len (e.g. --seq-len 128k)")
    take("micro_batch_size", "micro_batch", flags.micro_batch, f"{NO_BLOCK} and no --micro-batch")
    if "mode" in v and not splits_sequence(v["mode"]):
        v.setdefault("sp_degree", 1)
    for name, value in SCRIPT_DEFAULTS.items():
        take(name, None, value, f"a plain transformers script's default; {NO_BLOCK}")
    if caps.layer_split:  # the script's split of its checkpointing over the layers; none unless something says one
        same = block.get("checkpointing") == v["checkpointing"]  # a split of another policy is no split of this one
        for name in OWN_SPLIT:
            v.setdefault(name, block[name] if same and name in block else Strategy.model_fields[name].default)
    cl, cluster_note = launch_cluster(v, block, flags, where, said)
    note(f"cluster: {cluster_note}")
    model = get_model(v["model"])
    sp, world = v["sp_degree"], cl.world_size
    if world % sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise SeqparError(f"{where}: the sequence-parallel degree {sp} does not divide the {world} GPUs; use one of {divisors}")
    if v["sharding"].startswith("zero"):
        v["optimizer"] = "adamw"  # DeepSpeed's bf16 keeps an fp32 master copy of AdamW
    take("optimizer", "optimizer", flags.optimizer, f"{NO_BLOCK} and no --optimizer")
    take("dtype", None, "fp32" if cl.accelerator == "cpu" else "bf16", f"no file sets the precision; {NO_BLOCK}")
    s = Strategy.over(
        v["mode"],
        sp,
        world,
        **{k: v[k] for k in ("checkpointing", "sharding", "loss_impl", "gradient_accumulation_steps", "fused_ops")},
        tiled_mlp=v["tiled_mlp"],
        **({k: v[k] for k in OWN_SPLIT} if caps.layer_split else {}),
    )
    ga, micro = v["gradient_accumulation_steps"], v["micro_batch_size"]
    tokens = ga * micro * v["seq_len"] * s.dp_degree if ga > 1 else None
    extra = {k: v.get(k, block.get(k)) for k in ("lora", "doc_lens")}
    extra["lora"] = _lora(v.get("lora"), flags.lora_spec(), block.get("lora"), where)
    w = Workload(
        model=model,
        seq_len=v["seq_len"],
        micro_batch_size=micro,
        tokens_per_step=tokens,
        dtype=v["dtype"],
        optimizer=v["optimizer"],
        **{k: x for k, x in extra.items() if x is not None},
    )
    problems = layout_problems(s, w.seq_len, model, cl)
    if caps.layer_split:  # the script's split, as seqpar.apply would refuse it
        L = model.num_layers
        problems += split_problems(s.checkpointing, s.checkpoint_layers, s.offload_layers, L, model.name)
        split = (s.checkpointing, s.checkpoint_layers, s.offload_layers, s.kept_saves, s.kept_host_layers, s.tiled_mlp)
        problems += kept_problems(*split, L, model.name, cl.accelerator == "cuda")
    if problems:
        raise SeqparError(f"{where}: {problems[0]}")
    plan = _as_plan(w, cl, s, where)
    mem = estimate_memory(w, cl, s, c, **caps.runtime())  # priced as the tool runs it
    res = ConfigCheck(readings, _judge(readings), plan, predict(w, cl, s, c, **caps.runtime()), mem.reason, said)
    res.emitted = {k: block[k] for k in RECORDS if k in block}
    if not res.fits:
        _fix(res, c)
    return res


def _lora(read, flag, block, where: str):
    """The adapters: the tool's keys, else the --lora-* flags, else the seqpar: block (None: full fine-tuning);
    SeqparError when the flags ask for other adapters than the files train."""
    if read is not None and flag is not None and read != flag:
        raise SeqparError(
            f"--lora-rank and its flags ask for {lora_text(flag)}, but {where} trains {lora_text(read)}; drop the flags "
            "or change the config"
        )
    return read if read is not None else flag if flag is not None else block


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
        cand = evaluate(w, cl, v, c, **mod.CAPS.runtime())
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
        f"optimizer {w.optimizer}, on {res.plan.cluster.world_size}x {res.plan.cluster.gpu.name}"
        + (f", {lora_text(w.lora)}" if w.lora is not None else ""),
    ]
    cr = CheckResult(res.fits, p, terms, res.fix, res.fix_strategy, res.reason, 0 if res.fits else 1, res.plan)
    lines = head + [f"CANNOT RUN on this cluster: {why}" for why in res.blocked] + check_lines(cr)
    if res.fix_keys:
        lines.append(f"in {res.tool}'s keys: " + "; ".join(res.fix_keys))
    if res.not_understood:
        lines.append("PARTIAL verdict: the cost model does not describe " + "; ".join(res.not_understood))
    lines += res.defaults  # one line per value no file said: "given: ..." (a flag) or "assumed: ..." (a default)
    if res.plan.cluster.accelerator == "cuda":  # the gate's allocator (seqpar.advisor.cost.memory.estimate_memory)
        lines.append(
            "assumed: the job runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as --emit's command sets it "
            "(the default allocator fragments at long lengths and can fail below the predicted peak)"
        )
    if res.emitted:
        lines.append(emitted_line(res))
    if res.ignored:
        lines.append("ignored (not read by seqpar): " + ", ".join(res.ignored))
    return lines


def emitted_line(res: ConfigCheck) -> str:
    """Whether the prediction is the one --emit recorded in the files' seqpar: block (within 0.1%)."""
    p, e = res.prediction, res.emitted
    was = (e.get("predicted_peak_memory_gib"), e.get("predicted_tokens_per_s"))
    now = (p.peak_memory_gib, p.tokens_per_s)
    same = all(a is not None and abs(a - b) <= 1e-3 * max(abs(b), 1e-9) for a, b in zip(was, now))
    said = f"peak {was[0]} GiB, {was[1]:,.0f} tokens/s" if None not in was else "an incomplete record"
    if same:
        return f"as --emit predicted ({said}, recorded in the files' seqpar: block)"
    return f"--emit predicted {said} (the files' seqpar: block); the files or the flags have changed it since"


def config_json(res: ConfigCheck) -> dict:
    w, cl = res.plan.workload, res.plan.cluster
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
            **({"lora": w.lora.model_dump()} if w.lora is not None else {}),
        },
        "cluster": {k: getattr(cl, k) for k in ("accelerator", "nodes", "gpus_per_node", "host_ram_gib", "pinned_host_gib")}
        | {"gpu": cl.gpu.name},
        "strategy": res.plan.strategy.model_dump(),
        "prediction": res.prediction.model_dump(),
        "not_understood": res.not_understood,
        "defaults": res.defaults,
        "emitted": res.emitted,
        "ignored": res.ignored,
    }


__all__ = ["check_configs", "config_diff", "config_json", "config_lines", "emitted_line"]
