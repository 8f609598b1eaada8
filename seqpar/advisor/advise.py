"""One entry point for advice: run the request's policy (the cost-model search, or the guide's rules) and note the cluster.

The CLI and the staged recipes stay thin by calling ``advise(req, cluster_note)``.
"""

from __future__ import annotations

from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.rules import advise_by_rules
from seqpar.advisor.search import advise_by_cost
from seqpar.plan.launch_plan import LaunchPlan


def advise(req: AdviseRequest, cluster_note: str = "") -> LaunchPlan:
    """The plan for a request under req.policy, with ``cluster_note`` (where the cluster came from) in its rationale."""
    plan = advise_by_cost(req) if req.policy == "cost" else advise_by_rules(req)
    r = plan.rationale
    return plan.model_copy(update={"rationale": r.model_copy(update={"cluster_note": cluster_note or r.cluster_note})})
