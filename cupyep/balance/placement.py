"""Where each expert's replicas live, how a token picks one, and how
balanced the result is (NumPy, and CuPy for the replica choice).

Rank g holds physical experts [g P / G, (g + 1) P / G): a dispatch of
physical ids over P experts (``dispatch(..., num_experts=P)``) needs
nothing else from any route, within or across nodes or in low-latency
mode. An expert's outputs are the same on each of its replicas, so the
combine of a physical dispatch is the logical routing's, with each slot
reduced on the rank of the replica it chose
(cupyep.moe.reference_forward(..., placement=...) is that oracle).

Replica rules (:func:`physical_topk`), deterministic and the same on every
rank:

- ``"round_robin"``: slot j of token t on rank r takes replica
  (r * T + t + j) mod c of its expert's c replicas, T the rank's tokens, so
  the replicas of an expert share its tokens evenly;
- ``"nearest"``: the replicas on the token's own rank, else on its node,
  else all of them, and among those round-robin as above: fewer rows cross
  ranks and nodes, at the price of a less even share.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..arrays import xp_of

REPLICA_RULES = ("round_robin", "nearest")


@dataclass(frozen=True)
class Placement:
    """A placement of P physical experts on G GPUs, per layer.

    Attributes:
        phy2log: [L, P] int64, the logical expert of each physical one.
        log2phy: [L, E, max_replicas] int64, each expert's physical experts
            in increasing order, -1 past its count.
        logcnt: [L, E] int64, replicas per expert (>= 1).
        num_gpus: G; num_nodes: N (consecutive GPUs per node).
        policy: the planner's policy ("hierarchical", "global", or "identity").
    """
    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    num_gpus: int
    num_nodes: int = 1
    policy: str = "identity"

    @classmethod
    def from_phy2log(cls, phy2log, num_experts: int, num_gpus: int, num_nodes: int = 1,
                     policy: str = "identity") -> "Placement":
        """The placement that ``phy2log`` [L, P] describes (every logical expert at least once)."""
        phy2log = np.asarray(phy2log, dtype=np.int64)
        if phy2log.ndim == 1:
            phy2log = phy2log[None]
        L, P = phy2log.shape
        if P % num_gpus or num_gpus % num_nodes:
            raise ValueError(f"{P} physical experts do not spread evenly over {num_gpus} GPUs in {num_nodes} nodes")
        if phy2log.min(initial=0) < 0 or phy2log.max(initial=0) >= num_experts:
            raise ValueError(f"phy2log holds ids outside [0, {num_experts})")
        logcnt = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log])
        if (logcnt == 0).any():
            raise ValueError("every logical expert needs at least one physical replica")
        log2phy = np.full((L, num_experts, int(logcnt.max())), -1, dtype=np.int64)
        for layer in range(L):
            order = np.argsort(phy2log[layer], kind="stable")  # physical ids grouped by expert, increasing
            start = np.concatenate([[0], np.cumsum(logcnt[layer])[:-1]])
            j = np.arange(P) - np.repeat(start, logcnt[layer])
            log2phy[layer, phy2log[layer, order], j] = order
        return cls(phy2log, log2phy, logcnt, int(num_gpus), int(num_nodes), policy)

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_gpus: int, num_nodes: int = 1) -> "Placement":
        """No replication: expert e on GPU e // (E / G), as without a placement."""
        return cls.from_phy2log(np.tile(np.arange(num_experts), (num_layers, 1)), num_experts, num_gpus, num_nodes)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt.shape[1])

    @property
    def experts_per_gpu(self) -> int:
        return self.num_physical // self.num_gpus

    def layer(self, index: int) -> "Placement":
        """The placement of one layer (L = 1)."""
        return Placement(self.phy2log[index:index + 1], self.log2phy[index:index + 1],
                         self.logcnt[index:index + 1], self.num_gpus, self.num_nodes, self.policy)

    def gpu_loads(self, weight) -> np.ndarray:
        """[L, G] float64: each GPU's load, its physical experts' share of
        ``weight`` [L, E] (an expert's load split evenly over its replicas)."""
        weight = np.asarray(weight, dtype=np.float64)
        share = np.take_along_axis(weight / self.logcnt, self.phy2log, axis=1)  # [L, P]
        return share.reshape(self.num_layers, self.num_gpus, self.experts_per_gpu).sum(-1)


def balancedness(loads) -> dict:
    """How even per-GPU loads [L, G] are: ``max_over_mean`` per layer (1.0 is
    perfect), their mean and worst, and ``time_ratio``: the sum over layers
    of the most loaded GPU over the sum of the means, which is what a layer
    whose time is its straggler's costs against a perfectly balanced one."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean(axis=1)
    peak = loads.max(axis=1)
    per_layer = np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0)
    return {"max_over_mean": [round(float(v), 4) for v in per_layer],
            "mean_max_over_mean": round(float(per_layer.mean()), 4),
            "worst_max_over_mean": round(float(per_layer.max()), 4),
            "time_ratio": round(float(peak.sum() / mean.sum()) if mean.sum() > 0 else 1.0, 4)}


def report(weight, placement: Placement) -> dict:
    """Balancedness before (no replication, experts in id order on the GPUs)
    and after ``placement``, for the loads ``weight`` [L, E]."""
    weight = np.asarray(weight, dtype=np.float64)
    before = Placement.identity(weight.shape[0], weight.shape[1], placement.num_gpus, placement.num_nodes)
    return {"policy": placement.policy, "num_physical": placement.num_physical, "num_gpus": placement.num_gpus,
            "before": balancedness(before.gpu_loads(weight)), "after": balancedness(placement.gpu_loads(weight))}


def physical_topk(topk_idx, placement: Placement, rank: int, rule: str = "round_robin", layer: int = 0):
    """Logical ``topk_idx`` [T, k] int64 (-1: no expert) of rank ``rank``'s
    tokens -> physical ids [T, k] int64 (-1 stays -1), by ``rule`` (module
    docstring). NumPy or CuPy in, the same module out; every rank computes
    its own tokens' choice, with no communication."""
    if rule not in REPLICA_RULES:
        raise ValueError(f"rule must be one of {REPLICA_RULES}, got {rule!r}")
    xp = xp_of(topk_idx)
    T, k = topk_idx.shape
    if not 0 <= rank < placement.num_gpus:
        raise ValueError(f"rank {rank} is outside the placement's {placement.num_gpus} GPUs")
    log2phy = xp.asarray(placement.log2phy[layer])
    logcnt = xp.asarray(placement.logcnt[layer])
    valid = topk_idx >= 0
    e = xp.where(valid, topk_idx, 0)
    turn = (rank * T + xp.arange(T, dtype=np.int64)[:, None] + xp.arange(k, dtype=np.int64)[None, :])
    if rule == "round_robin":
        cnt = logcnt[e]
        choice = log2phy[e, turn % cnt]
    else:
        per_gpu = placement.experts_per_gpu
        gpus_per_node = placement.num_gpus // placement.num_nodes
        cand = log2phy[e]  # [T, k, max_replicas]
        real = cand >= 0
        gpu = xp.where(real, cand, 0) // per_gpu
        near = real & (gpu == rank)
        node = real & (gpu // gpus_per_node == rank // gpus_per_node)
        pick = xp.where(near.any(-1, keepdims=True), near, xp.where(node.any(-1, keepdims=True), node, real))
        n = pick.sum(-1)  # >= 1: every expert has a replica
        # the (turn mod n)-th candidate in pick, in increasing physical order
        target = turn % n
        order = xp.cumsum(pick, axis=-1) - 1
        hit = pick & (order == target[..., None])
        choice = xp.take_along_axis(cand, xp.argmax(hit, axis=-1)[..., None], axis=-1)[..., 0]
    return xp.where(valid, choice, -1).astype(np.int64)


def received(idx_by_rank, num_physical: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """What each rank receives under a physical routing (NumPy).

    Arguments:
        idx_by_rank: per source rank, [T, k] int64 physical ids in [-1, P)
            (P / R experts per rank, in id order; -1 empty).
        num_physical: P; num_ranks: R.

    Returns:
        (pairs, rows): [R] int64, the (row, expert) pairs each rank's experts
        take; [R, R] int64, the rows source s sends rank d (a token with a
        slot on d is one row there).
    """
    per_rank = num_physical // num_ranks
    pairs = np.zeros(num_ranks, np.int64)
    rows = np.zeros((num_ranks, num_ranks), np.int64)
    for src, idx in enumerate(idx_by_rank):
        dest = np.where(idx >= 0, idx // per_rank, -1)
        pairs += np.bincount(dest[dest >= 0], minlength=num_ranks)
        for r in range(num_ranks):
            rows[src, r] = int((dest == r).any(axis=1).sum())
    return pairs, rows
