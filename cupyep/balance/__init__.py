"""Load balance for expert parallelism: where each expert's replicas live.

- ``planner``: ``rebalance_experts(weight [L, E], num_replicas, num_groups,
  num_nodes, num_gpus)`` -> a Placement (hierarchical and global policies,
  NumPy only);
- ``placement``: ``Placement`` (phy2log, log2phy, logcnt), the replica a
  token's slot takes (``physical_topk``, two rules), per-GPU loads and
  their balancedness (``report``);
- ``migration``: the moves from one placement to another (``align``,
  ``plan_moves``), when they pay (``MigrationPolicy``), and the per-step
  re-planning behind an imbalance alarm (``OnlineBalancer``);
- ``layer``: one MoE layer's balancing around each step (``LayerBalancer``:
  periodic EPLB from history, online behind an alarm, or per step from the
  step's own loads) and the loads a step counts (``step_loads``).

A dispatch of physical ids (``num_experts=placement.num_physical``) runs on
every route unchanged; cupyep.moe.MoELayer takes a placement.
"""
from .placement import REPLICA_RULES, Placement, balancedness, physical_topk, received, report
from .planner import POLICIES, pack, rebalance_experts, replicate
from .migration import MigrationPolicy, Move, OnlineBalancer, align, plan_moves, replan
from .layer import MODES as BALANCE_MODES, LayerBalancer, per_step_decision, step_loads

__all__ = ["replan", "per_step_decision", "BALANCE_MODES", "LayerBalancer", "step_loads", "MigrationPolicy", "Move", "OnlineBalancer", "align", "plan_moves", "Placement", "REPLICA_RULES", "POLICIES", "balancedness", "pack", "physical_topk", "rebalance_experts",
           "received", "replicate", "report"]
