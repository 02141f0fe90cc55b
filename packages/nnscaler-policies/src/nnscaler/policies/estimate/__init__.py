"""Planning a cluster you do not have: an analytic cost model (roofline per op class, ring
collectives per link, the 1F1B bubble, memory with ZeRO and recomputation) over a described
cluster (`load_cluster`), a decoder-only transformer read from a Hugging Face config on the meta
device (`ModelSpec`, mixture-of-experts models included), and a search over tensor, context,
pipeline, data and expert parallel degrees, ZeRO, micro-batch size and recomputation (`search`);
`calibrate` fits a cluster's compute efficiency to one measured step.
``nnscaler plan estimate`` is its command; docs/autodist.md ("Planning a cluster you do not have")
states every constant and its source.
"""
from .calibrate import calibrate
from .cluster import Cluster, ClusterError, GPU, KNOWN_GPUS, Link, SHIPPED, load_cluster, parse_cluster
from .model import ModelConfigError, ModelSpec
from .plan_cost import Estimate, Plan, Workload, estimate_plan
from .report import result_json, save_estimate, trainer_fragment
from .search import NoPlanFitsCluster, SearchResult, search

__all__ = ["Cluster", "ClusterError", "Estimate", "GPU", "KNOWN_GPUS", "Link", "ModelConfigError", "ModelSpec",
           "NoPlanFitsCluster", "Plan", "SHIPPED", "SearchResult", "Workload", "calibrate", "estimate_plan",
           "load_cluster",
           "parse_cluster", "result_json", "save_estimate", "search", "trainer_fragment"]
