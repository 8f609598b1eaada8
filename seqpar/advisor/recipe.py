"""Progressive context-extension recipes: a staged launch plan, each stage planned for its own sequence length.

EasyContext extends Llama-2-7B to 1M tokens in stages that raise the sequence length and the RoPE base together
(train_scripts/EasyContext-1M-Llama-2-7B.sh, jzhang38/EasyContext): about 1M tokens per optimizer step, data parallel up to
64K, zigzag ring attention beyond, each stage starting from the previous stage's weights (its final rope theta is then
raised to 1e9 for 1M-token inference). ``advise_recipe`` plans every stage with the request's policy (the cost-model search
or the guide's rules) on the same cluster; ``seqpar launch`` runs the stages in order.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from seqpar.advisor.advise import advise
from seqpar.advisor.request import AdviseRequest
from seqpar.plan.errors import SeqparError
from seqpar.plan.jobspec import launch_spec
from seqpar.plan.launch_plan import LaunchPlan, Rationale, Stage


class RecipeStage(NamedTuple):
    seq_len: int
    rope_theta: float
    steps: int
    easycontext_mode: str  # what EasyContext ran on 8x A100-80G, for the record (the stage is re-planned here)


class Recipe(NamedTuple):
    description: str
    tokens_per_step: Optional[int]
    stages: tuple[RecipeStage, ...]
    cluster: Optional[str] = None  # the --cluster it is meant for when none is declared (None: probe, else the default)
    model: Optional[str] = None  # the --model it is meant for when none is given


RECIPES: dict[str, Recipe] = {
    "1M": Recipe(
        "EasyContext's Llama-2-7B schedule to 1M context (train_scripts/EasyContext-1M-Llama-2-7B.sh)",
        2**20,
        (
            RecipeStage(32768, 1e6, 1000, "data_parallel"),
            RecipeStage(65536, 5e6, 1000, "data_parallel"),
            RecipeStage(256000, 1e7, 500, "zigzag_ring_attn"),
            RecipeStage(256000, 2.5e7, 500, "zigzag_ring_attn"),
            RecipeStage(256000, 5e7, 150, "zigzag_ring_attn"),
            RecipeStage(512000, 1e8, 300, "zigzag_ring_attn"),
            RecipeStage(512000, 2.5e8, 90, "zigzag_ring_attn"),
        ),
    ),
    # CPU smoke recipe for the tiny model: the same mechanics (length and rope theta up, weights carried over) in seconds.
    "smoke": Recipe(
        "two short stages for CPU checks (tiny model, --cluster cpu:N)",
        None,
        (RecipeStage(64, 1e4, 3, "data_parallel"), RecipeStage(128, 1e5, 3, "zigzag_ring_attn")),
        cluster="cpu:2",
        model="tiny",
    ),
}


def get_recipe(name: str) -> Recipe:
    for key, r in RECIPES.items():
        if key.lower() == name.lower():
            return r
    raise SeqparError(f"recipe {name!r} is unknown; use one of {', '.join(RECIPES)}")


def recipe_seq_len(name: str) -> int:
    """The sequence length of a recipe's last stage (what `advise --recipe` plans for when no --seq-len is given)."""
    return get_recipe(name).stages[-1].seq_len


def advise_recipe(req: AdviseRequest, name: str, cluster_note: str = "") -> LaunchPlan:
    """A staged plan: every stage of the recipe planned for req's model and cluster (req.seq_len is not used).

    The top-level workload/strategy/prediction are the last (longest) stage's, so `seqpar explain` and `seqpar check` judge
    the hardest stage; ``stages`` lists all of them in order."""
    recipe = get_recipe(name)
    stages, last = [], None
    for i, st in enumerate(recipe.stages):
        stage_req = req.model_copy(
            update={"seq_len": st.seq_len, "tokens_per_step": req.tokens_per_step or recipe.tokens_per_step}
        )
        try:
            last = advise(stage_req, cluster_note)
        except SeqparError as e:
            raise SeqparError(f"recipe {name} stage {i} (seq_len {st.seq_len}): {e}") from None
        stages.append(
            Stage(
                seq_len=st.seq_len, rope_theta=st.rope_theta, steps=st.steps, strategy=last.strategy, prediction=last.prediction
            )
        )
    final = recipe.stages[-1]
    lines = [f"recipe {name}: {recipe.description}; {len(stages)} stages, each planned by the {req.policy} policy"]
    for i, (st, planned) in enumerate(zip(recipe.stages, stages)):
        s = planned.strategy
        lines.append(
            f"stage {i}: seq_len {st.seq_len}, rope_theta {st.rope_theta:g}, {st.steps} steps: {s.mode} sp {s.sp_degree} "
            f"dp {s.dp_degree} (EasyContext ran {st.easycontext_mode})"
        )
    r = last.rationale
    rationale = Rationale.model_validate({**r.model_dump(), "reasons": lines + list(r.reasons)})
    data = last.model_dump()
    data["training"] = {**data["training"], "steps": final.steps, "rope_theta": final.rope_theta}
    data["rationale"] = rationale.model_dump()
    data["stages"] = [s.model_dump() for s in stages]
    plan = LaunchPlan.model_validate(data)
    return plan.model_copy(update={"launch": launch_spec(plan)})  # the first stage's job: what seqpar launch runs first
