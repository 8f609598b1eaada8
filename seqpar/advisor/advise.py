"""One entry point for advice: pick the policy (the cost-model search when it is installed, else the guide's rules) and run it.

The CLI stays thin by calling ``advise(req, cluster_note)``; ``default_policy()`` says which policy a plain ``seqpar advise`` uses.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.rules import advise_by_rules
from seqpar.schema import LaunchPlan


def cost_model_available() -> bool:
    """True once seqpar.advisor.search (the cost-model search) exists in this install."""
    return importlib.util.find_spec("seqpar.advisor.search") is not None


def default_policy() -> str:
    return "cost" if cost_model_available() else "rules"


def advise(req: AdviseRequest, cluster_note: str = "", notes: Optional[list[str]] = None) -> LaunchPlan:
    """The plan for a request under req.policy; ``notes`` collects lines for stderr (e.g. a policy fallback)."""
    notes = [] if notes is None else notes
    extra = []
    if req.policy == "cost":
        if cost_model_available():
            from seqpar.advisor.search import advise_by_cost  # imported late: the cost model is optional

            plan = advise_by_cost(req)
        else:
            msg = "--policy cost: the cost model (seqpar.advisor.search) is not installed in this version; used the guide's rules"
            notes.append(msg)
            extra.append(msg)
            plan = advise_by_rules(req.model_copy(update={"policy": "rules"}))
    else:
        plan = advise_by_rules(req)
    r = plan.rationale
    update = {"cluster_note": cluster_note or r.cluster_note, "reasons": list(r.reasons) + extra}
    return plan.model_copy(update={"rationale": r.model_copy(update=update)})
