"""autodist: the automatic plan search (cost model, SPMD solver, pipeline solver).

``pas_policy="autodist"`` with its `pas_config` keys (`AutodistConfig`). docs/autodist.md
describes the cost model, the solvers and every key.
"""
from .config import AutodistConfig
from .plan_file import PlanRecord, StalePlanError, load_plan, read_plan, save_plan
from .policy import AutodistWarning, apply_record, autodist, search
from .progress import ProfileProgress, progress_hook, set_progress_hook
from .report import format_plan
from .spmd_solver import NoPlanFits

__all__ = ["AutodistConfig", "AutodistWarning", "NoPlanFits", "PlanRecord", "ProfileProgress", "StalePlanError",
           "apply_record", "autodist", "format_plan", "load_plan", "progress_hook", "read_plan", "save_plan", "search",
           "set_progress_hook"]
