"""LoRA and QLoRA in the tools' own keys, both ways: what each writes for a plan's ``workload.lora`` and what
``seqpar check`` reads back into it.

* TRL (trl 1.16.0 ``trainer/model_config.py`` ``ModelConfig``, ``trainer/utils.py`` ``get_peft_config`` and
  ``get_quantization_config``): ``use_peft``, ``lora_r`` (default 16), ``lora_alpha`` (32), ``lora_dropout`` (0.05),
  ``lora_target_modules`` (default None: peft's per-model list, ``q_proj v_proj`` for Llama, Mistral and Qwen: peft
  0.21.2 ``utils/constants.py``), ``load_in_4bit`` with ``bnb_4bit_quant_type`` (nf4) and ``use_bnb_nested_quant``
  (double quantization, default false), ``dtype`` (the base's load dtype and the 4-bit compute dtype). Its SFTTrainer
  casts a quantized model's adapters to bf16 (``trainer/sft_trainer.py``): the adamw-bf16 regime.
* Axolotl (``utils/schemas/peft.py``, ``loaders/model.py`` at axolotl-ai-cloud/axolotl 067b021): ``adapter`` lora |
  qlora, ``lora_r``, ``lora_alpha``, ``lora_dropout`` (default 0), ``lora_target_modules`` or ``lora_target_linear:
  true`` (every linear), ``load_in_4bit`` (qlora: nf4 with ``bnb_4bit_use_double_quant`` always on).
* ArcticTraining (0.8 ``config/model.py``, ``model/hf_factory.py``): ``model.peft_config``, a peft config's arguments
  with ``peft_type: LORA`` (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``); it loads no 4-bit base.
accelerate's YAML and a DeepSpeed JSON carry no LoRA key (the user's script applies peft): the files' ``seqpar:``
block says it (seqpar.emit.assumed).

A key that changes memory in a way the cost model does not describe (DoRA, modules trained whole, 8-bit bases, a
target other than a decoder block's linears, single quantization) goes to the reading's ``not_understood``.
"""

from __future__ import annotations

from typing import Any, Optional

from seqpar.emit.common import Reading, count
from seqpar.plan.errors import SeqparError
from seqpar.plan.specs import LORA_ALL_LINEAR, LoraSpec, Workload

PEFT_DEFAULT_TARGETS = ["q_proj", "v_proj"]  # peft's list for llama, mistral, qwen2, qwen3 (module docstring)


def is_all(lora: LoraSpec) -> bool:
    return sorted(lora.target_modules, key=LORA_ALL_LINEAR.index) == list(LORA_ALL_LINEAR)


# --------------------------------------------------------------------------------------------- write


def trl_keys(lora: LoraSpec) -> dict:
    """TRL's ModelConfig arguments for ``lora`` (written beside dtype bfloat16: the frozen base in bf16)."""
    out: dict = {
        "use_peft": True,
        "lora_r": lora.rank,
        "lora_alpha": _number(lora.alpha),
        "lora_dropout": lora.dropout,
        "lora_target_modules": "all-linear" if is_all(lora) else list(lora.target_modules),
    }
    if lora.base_dtype == "nf4":
        out |= {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": True}
    return out


def axolotl_keys(lora: LoraSpec) -> dict:
    """Axolotl's adapter keys for ``lora``."""
    out: dict = {"adapter": "qlora" if lora.base_dtype == "nf4" else "lora"}
    if lora.base_dtype == "nf4":
        out["load_in_4bit"] = True
    out |= {"lora_r": lora.rank, "lora_alpha": _number(lora.alpha), "lora_dropout": lora.dropout}
    out |= {"lora_target_linear": True} if is_all(lora) else {"lora_target_modules": list(lora.target_modules)}
    return out


def cannot_express(tool: str, lora: Optional[LoraSpec]) -> Optional[str]:
    """Why ``tool`` cannot train ``lora`` as the plan has it (None: it can)."""
    if lora is not None and lora.base_dtype == "nf4" and tool == "arctic":
        return (
            "ArcticTraining loads its base without 4-bit quantization (its model config has no such key), so it cannot "
            "train this plan's QLoRA; --emit trl or axolotl can, or re-advise without --qlora"
        )
    return None


def tool_workload(tool: str, w: Workload) -> tuple[Workload, Optional[str]]:
    """The workload as ``tool`` trains it, and why it differs from ``w`` (None where it does not): TRL's SFTTrainer
    casts a 4-bit base's adapters to bf16, so AdamW keeps its moments in bf16 (seqpar's adamw-bf16)."""
    lora = w.lora
    if tool == "trl" and lora is not None and lora.base_dtype == "nf4" and w.optimizer == "adamw":
        why = "TRL's SFTTrainer keeps a 4-bit base's adapters in bf16, so AdamW's moments are bf16: adamw-bf16 is predicted"
        return w.model_copy(update={"optimizer": "adamw-bf16"}), why
    return w, None


def arctic_peft_config(lora: LoraSpec) -> dict:
    """ArcticTraining's model.peft_config for ``lora`` (a bf16 base: cannot_express refuses a 4-bit one)."""
    return {
        "peft_type": "LORA",
        "r": lora.rank,
        "lora_alpha": _number(lora.alpha),
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
    }


def _number(x: float) -> int | float:
    """An integer alpha as an int (the tools' schemas type it int)."""
    return int(x) if float(x).is_integer() else x


# --------------------------------------------------------------------------------------------- read


def targets(value: Any, key: str, r: Reading) -> list[str]:
    """The decoder linears a target list names ('all-linear' = all seven); the names of nothing the cost model describes
    (the LM head, embeddings, a regular expression) go to ``not_understood``, and so does a list of none of them."""
    if isinstance(value, str):
        if value == "all-linear":
            return list(LORA_ALL_LINEAR)
        value = [value]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise SeqparError(f"{r.path}: {key} {value!r} is not a list of module names; fix the file")
    known = [x for x in LORA_ALL_LINEAR if x in value]
    other = [x for x in value if x not in LORA_ALL_LINEAR]
    if other:
        r.not_understood.append(f"{key} {' '.join(other)} (adapters on no decoder linear; predicted without them)")
    if not known:
        r.not_understood.append(f"{key}: none of {' '.join(LORA_ALL_LINEAR)} (predicted as all of them)")
        return list(LORA_ALL_LINEAR)
    return known


def number(value: Any, key: str, r: Reading, low: float, high: Optional[float] = None) -> float:
    """A finite number from ``low`` (inclusive) to ``high`` (exclusive); SeqparError naming the key otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= low
    ok = ok and value != float("inf") and (high is None or value < high)
    if not ok:
        span = f"from {low:g} to below {high:g}" if high is not None else f">= {low:g}"
        raise SeqparError(f"{r.path}: {key} {value!r} is not a number {span}; fix the file")
    return float(value)


def spec(r: Reading, rank: Any, alpha: Any, dropout: Any, target: list[str], nf4: bool, keys: tuple[str, str, str]) -> LoraSpec:
    """The LoraSpec of one tool's values (``keys``: its names of rank, alpha and dropout, for the messages)."""
    rk, ak, dk = keys
    n = count(rank, rk, r.path)
    most = LoraSpec.model_fields["rank"].metadata[-1].le
    if n > most:
        raise SeqparError(f"{r.path}: {rk} {n} is above {most}, more than seqpar models; fix the file")
    alpha = number(alpha, ak, r, 0.0)
    if alpha == 0:
        raise SeqparError(f"{r.path}: {ak} 0 scales the adapters to nothing; give a number > 0")
    return LoraSpec(
        rank=n,
        alpha=alpha,
        dropout=number(dropout, dk, r, 0.0, 1.0),
        target_modules=target,
        base_dtype="nf4" if nf4 else "bf16",
    )


def put(r: Reading, lora: LoraSpec, key: str) -> None:
    r.put("lora", lora, f"{key}: r {lora.rank}, alpha {lora.alpha:g}, {lora.base_dtype} base, on {' '.join(lora.target_modules)}")


TRL_KEYS = (
    "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
    "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora", "load_in_4bit", "load_in_8bit",
    "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage",
)  # fmt: skip


def read_trl(data: dict, r: Reading) -> Optional[LoraSpec]:
    """TRL's peft and bitsandbytes arguments into ``r`` (the lora value); None without use_peft."""
    if not data.get("use_peft"):
        for k in ("load_in_4bit", "load_in_8bit"):
            if data.get(k):
                r.not_understood.append(f"{k} true without use_peft (a quantized base trained whole)")
        return None
    nf4 = bool(data.get("load_in_4bit"))
    target = data.get("lora_target_modules")
    names = PEFT_DEFAULT_TARGETS if target is None else targets(target, "lora_target_modules", r)
    lora = spec(
        r,
        data.get("lora_r", 16),
        data.get("lora_alpha", 32),
        data.get("lora_dropout", 0.05),
        names,
        nf4,
        ("lora_r", "lora_alpha", "lora_dropout"),
    )
    put(r, lora, "use_peft" + (", load_in_4bit" if nf4 else "") + ("" if target is not None else " (peft's default targets)"))
    for k, why in (
        ("use_dora", "DoRA's magnitude vectors and its per-step weight norms"),
        ("lora_modules_to_save", "modules trained whole beside the adapters"),
        ("lora_target_parameters", "adapters on parameters, not linears"),
        ("load_in_8bit", "an 8-bit base"),
    ):
        if data.get(k):
            r.not_understood.append(f"{k} {data[k]!r} ({why})")
    if nf4 and not data.get("use_bnb_nested_quant"):
        r.not_understood.append(
            "use_bnb_nested_quant false (fp32 block scales: 1/21 byte per weight more than the double quantization predicted)"
        )
    if str(data.get("dtype", "float32")) == "float32" and not nf4:
        r.not_understood.append("dtype float32 with use_peft (the frozen base loaded in fp32; predicted in bf16)")
    return lora


def read_axolotl(data: dict, r: Reading) -> Optional[LoraSpec]:
    """Axolotl's adapter keys into ``r``; None without an adapter."""
    adapter = data.get("adapter")
    if not adapter:
        if data.get("load_in_4bit") or data.get("load_in_8bit"):
            r.not_understood.append("load_in_4bit/8bit without an adapter (a quantized base trained whole)")
        return None
    if adapter not in ("lora", "qlora"):
        r.not_understood.append(f"adapter {adapter!r} (predicted as full fine-tuning)")
        return None
    nf4 = adapter == "qlora" and bool(data.get("load_in_4bit"))
    if adapter == "qlora" and not nf4:
        r.not_understood.append("adapter qlora without load_in_4bit (axolotl then loads no 4-bit base; predicted bf16)")
    if data.get("lora_target_linear"):
        names = list(LORA_ALL_LINEAR)
    elif data.get("lora_target_modules") is not None:
        names = targets(data["lora_target_modules"], "lora_target_modules", r)
    else:
        names = PEFT_DEFAULT_TARGETS
    lora = spec(
        r,
        data.get("lora_r", 8),
        data.get("lora_alpha") if data.get("lora_alpha") is not None else 8,
        data.get("lora_dropout") or 0.0,
        names,
        nf4,
        ("lora_r", "lora_alpha", "lora_dropout"),
    )
    put(r, lora, f"adapter {adapter}" + (", load_in_4bit" if nf4 else ""))
    for k, why in (
        ("peft_use_dora", "DoRA's magnitude vectors"),
        ("lora_modules_to_save", "modules trained whole beside the adapters"),
        ("lora_target_parameters", "adapters on parameters, not linears"),
        ("load_in_8bit", "an 8-bit base"),
        ("peft_layers_to_transform", "adapters on some layers only"),
    ):
        if data.get(k):
            r.not_understood.append(f"{k} {data[k]!r} ({why})")
    return lora


def read_arctic(model: dict, r: Reading) -> Optional[LoraSpec]:
    """ArcticTraining's model.peft_config into ``r``; None without one."""
    pc = model.get("peft_config")
    if not pc:
        return None
    if not isinstance(pc, dict) or pc.get("peft_type") != "LORA":
        kind = pc.get("peft_type") if isinstance(pc, dict) else pc
        r.not_understood.append(f"model.peft_config peft_type {kind!r} (predicted as full fine-tuning)")
        return None
    target = pc.get("target_modules")
    names = PEFT_DEFAULT_TARGETS if target is None else targets(target, "model.peft_config.target_modules", r)
    keys = ("model.peft_config.r", "model.peft_config.lora_alpha", "model.peft_config.lora_dropout")
    lora = spec(r, pc.get("r", 8), pc.get("lora_alpha", 8), pc.get("lora_dropout", 0.0), names, False, keys)
    put(r, lora, "model.peft_config")
    for k, why in (("use_dora", "DoRA's magnitude vectors"), ("modules_to_save", "modules trained whole")):
        if pc.get(k):
            r.not_understood.append(f"model.peft_config.{k} {pc[k]!r} ({why})")
    return lora


__all__ = [
    "PEFT_DEFAULT_TARGETS",
    "TRL_KEYS",
    "arctic_peft_config",
    "axolotl_keys",
    "cannot_express",
    "is_all",
    "read_arctic",
    "read_axolotl",
    "read_trl",
    "targets",
    "tool_workload",
    "trl_keys",
]
