"""Expert placement planner (NumPy only): replicate the hot experts and pack
the physical experts onto GPUs, per layer, from the loads seen so far.

Terms: E logical experts; P physical experts (``num_replicas``, P >= E: each
logical expert has ``logcnt`` >= 1 replicas); G GPUs (ranks) holding P / G
physical experts each, consecutively (GPU g holds physical experts
[g P / G, (g + 1) P / G), cupyep's expert ownership); N nodes of G / N GPUs.
A replica's load is its logical expert's load divided by the expert's
replica count (the dispatch spreads an expert's tokens evenly over its
replicas, cupyep.balance.placement.REPLICA_RULES).

Policies:

- ``"hierarchical"`` (needs the E experts in ``num_groups`` groups, nodes
  dividing groups): the groups are packed onto the nodes (a group's experts
  stay on one node, so a token limited to few groups crosses to few nodes),
  the experts of each node are replicated to its P / N slots, and the node's
  physical experts are packed onto its GPUs;
- ``"global"``: the experts are replicated to P over the world and packed
  onto all G GPUs, ignoring nodes and groups.

Packing is longest-processing-time greedy with equal cardinality: heaviest
item first, onto the lightest GPU (or node) that still has room. Replication
is tried two ways and the one whose heaviest GPU is lighter is kept: EPLB's
(the next replica to the expert whose replicas carry the most load), and a
packing-aware rule (:func:`replicate_spread`) that does not give a hot
expert more replicas than GPUs where the extra one would share a GPU with
another of its replicas. The first alone is DeepSeek's EPLB (on DeepSeek's
README example the plan is EPLB's, slot for slot). On small cases checked by
brute force (tests/test_balance.py: 3-7 experts, 6-10 slots, 3-5 GPUs) EPLB's
rule alone leaves the heaviest GPU up to 1.66x the best placement's, the two
together up to 1.37x; ``OPTIMUM_FACTOR`` states 1.40.
"""
from __future__ import annotations

import numpy as np

POLICIES = ("hierarchical", "global")
SPREAD_MARGIN = 0.02  # replicate_and_pack: how much lighter the packing-aware plan must be to be kept
OPTIMUM_FACTOR = 1.40  # the heaviest GPU against the best placement's, at worst, on the brute-force cases


def pack(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n items of each row onto ``num_packs`` packs of n / num_packs items,
    balancing the packs' total weight (LPT greedy, ties to the lower pack).

    Arguments:
        weight: [X, n] float64, n a multiple of num_packs.

    Returns:
        (pack_index [X, n] int64, rank_in_pack [X, n] int64): item i of row x
        goes to pack pack_index[x, i] at position rank_in_pack[x, i]
        (positions in the order the items were placed).
    """
    X, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not pack evenly onto {num_packs} packs")
    cap = n // num_packs
    pack_index = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    if cap == 1:  # one item per pack: the order decides nothing
        pack_index[:] = np.arange(n)
        rank_in_pack[:] = 0
        return pack_index, rank_in_pack
    order = np.argsort(-weight, axis=1, kind="stable")
    for x in range(X):
        load = np.zeros(num_packs)
        count = np.zeros(num_packs, dtype=np.int64)
        for i in order[x]:
            room = np.flatnonzero(count < cap)
            p = room[np.argmin(load[room])]
            pack_index[x, i], rank_in_pack[x, i] = p, count[p]
            load[p] += weight[x, i]
            count[p] += 1
    return pack_index, rank_in_pack


def replicate(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate each row's experts to ``num_physical`` physical experts: every
    expert once, then each further replica to the expert with the largest
    load per replica (ties to the lower id).

    Arguments:
        weight: [X, n] float64 loads.

    Returns:
        (phy2log [X, P] int64: the logical expert of each physical one, the
        first n in expert order, then the extra replicas in the order given;
        replica [X, P] int64: which replica of its expert it is; logcnt [X, n]
        int64: replicas per expert).
    """
    return _replicate(weight, num_physical, lambda logcnt: np.argmax(weight / logcnt, axis=1))


def _replicate(weight: np.ndarray, num_physical: int, choose):
    """:func:`replicate`'s outputs, each further replica going to the expert
    that ``choose(logcnt)`` picks per row (logcnt: [X, n] the replica counts
    so far; it returns [X] expert ids)."""
    X, n = weight.shape
    if num_physical < n:
        raise ValueError(f"{num_physical} physical experts cannot hold {n} logical ones")
    phy2log = np.empty((X, num_physical), dtype=np.int64)
    replica = np.zeros((X, num_physical), dtype=np.int64)
    phy2log[:, :n] = np.arange(n)
    logcnt = np.ones((X, n), dtype=np.int64)
    rows = np.arange(X)
    for i in range(n, num_physical):
        e = choose(logcnt)
        phy2log[:, i] = e
        replica[:, i] = logcnt[rows, e]
        logcnt[rows, e] += 1
    return phy2log, replica, logcnt


def replicate_spread(weight: np.ndarray, num_physical: int, num_packs: int):
    """:func:`replicate`'s outputs for a packing-aware rule: a pack holding
    an expert's replicas carries at least ceil(c / num_packs) of its c
    replicas, so the rule gives the next replica to the expert whose bound
    ceil(c / num_packs) * load / c is largest among those it lowers (else,
    as :func:`replicate`, to the largest load per replica). It keeps a hot
    expert at one replica per pack where :func:`replicate` would put a
    second replica on a pack and so raise that pack's load."""
    def choose(logcnt):
        bound = -(-logcnt // num_packs) * weight / logcnt
        after = -(-(logcnt + 1) // num_packs) * weight / (logcnt + 1)
        lowers = after < bound
        pick = np.argmax(np.where(lowers, bound, -np.inf), axis=1)
        return np.where(lowers.any(axis=1), pick, np.argmax(weight / logcnt, axis=1))
    return _replicate(weight, num_physical, choose)


def replicate_and_pack(weight: np.ndarray, num_physical: int, num_packs: int):
    """Replicate each row's experts to ``num_physical`` and pack them onto
    ``num_packs`` packs, by :func:`replicate` and by
    :func:`replicate_spread`, keeping per row :func:`replicate`'s (EPLB's)
    unless the other's heaviest pack is lighter by more than
    ``SPREAD_MARGIN``: the result is never worse than EPLB's, and a
    placement planned from one step's loads does not switch to a plan that
    fits those loads only marginally better (such plans, with a hot expert
    on exactly one replica per GPU, fit the next step's loads worse).

    Returns:
        (phy2log [X, P], logcnt [X, n], pack_index [X, P], rank_in_pack [X, P]),
        as :func:`replicate` and :func:`pack` give them.
    """
    out = []
    for rule in (replicate, lambda w, p: replicate_spread(w, p, num_packs)):
        phy2log, _, cnt = rule(weight, num_physical)
        phy_weight = np.take_along_axis(weight / cnt, phy2log, axis=1)
        gpu, pos = pack(phy_weight, num_packs)
        heaviest = np.stack([np.bincount(g, wt, minlength=num_packs) for g, wt in zip(gpu, phy_weight)]).max(axis=1)
        out.append((phy2log, cnt, gpu, pos, heaviest))
    (a, b) = out
    second = b[4] < a[4] * (1 - SPREAD_MARGIN)
    return tuple(np.where(second[:, None], y, x) for x, y in zip(a[:4], b[:4]))


def _check(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, policy: str | None) -> str:
    if weight.ndim != 2 or not np.issubdtype(weight.dtype, np.number):
        raise ValueError(f"weight must be a numeric [layers, experts] array, got shape {weight.shape} {weight.dtype}")
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("weight must be finite and non-negative (a load per expert)")
    E = weight.shape[1]
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                    ("num_gpus", num_gpus)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if num_replicas < E:
        raise ValueError(f"num_replicas={num_replicas} is fewer than the {E} logical experts")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} is not divisible by num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} is not divisible by num_nodes={num_nodes}")
    if E % num_groups:
        raise ValueError(f"{E} experts are not divisible into num_groups={num_groups} groups")
    hierarchical_ok = num_groups % num_nodes == 0
    if policy is None:
        return "hierarchical" if hierarchical_ok else "global"
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES} (or None: hierarchical when the nodes divide the "
                         f"groups), got {policy!r}")
    if policy == "hierarchical" and not hierarchical_ok:
        raise ValueError(f"the hierarchical policy needs num_nodes={num_nodes} to divide num_groups={num_groups}")
    return policy


def _hierarchical(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int):
    """phy2log [L, P] of the hierarchical policy (module docstring)."""
    L, E = weight.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phy_per_node = num_physical // num_nodes
    phy_per_gpu = num_physical // num_gpus
    # 1. groups onto nodes
    group_node, group_rank = pack(weight.reshape(L, num_groups, group_size).sum(-1), num_nodes)
    # node_log[l, n, j]: the j-th logical expert of node n (its groups in placement order)
    slot = group_node * groups_per_node + group_rank  # [L, num_groups]: the group's place among the nodes' groups
    group_at = np.empty_like(slot)
    np.put_along_axis(group_at, slot, np.arange(num_groups)[None].repeat(L, 0), axis=1)
    node_log = (group_at[:, :, None] * group_size + np.arange(group_size)).reshape(L * num_nodes, -1)
    # 2. replicas within each node
    node_weight = np.take_along_axis(weight.reshape(L, E), node_log.reshape(L, -1), axis=1).reshape(L * num_nodes, -1)
    # 3. the node's physical experts onto its GPUs (a replica carries its expert's load over its count)
    phy2node, node_cnt, gpu, pos = replicate_and_pack(node_weight, phy_per_node, gpus_per_node)
    where = gpu * phy_per_gpu + pos  # [L * N, phy_per_node]: position on the node of each physical expert
    node_phy = np.empty_like(phy2node)
    np.put_along_axis(node_phy, where, np.take_along_axis(node_log, phy2node, axis=1), axis=1)
    return node_phy.reshape(L, num_physical)


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      policy: str | None = None):
    """The placement of ``num_replicas`` physical experts on ``num_gpus`` GPUs
    for each layer's expert loads (module docstring).

    Arguments:
        weight: [L, E] loads (token counts, or a moving average of them).
        num_replicas: P, physical experts in all (a multiple of num_gpus).
        num_groups: expert groups (E a multiple of it; 1: no groups).
        num_nodes: nodes (num_gpus a multiple of it).
        num_gpus: G, GPUs (ranks) in all.
        policy: "hierarchical", "global", or None (hierarchical exactly when
            num_nodes divides num_groups).

    Returns:
        cupyep.balance.Placement (phy2log [L, P], log2phy [L, E, max
        replicas] with -1 padding, logcnt [L, E], all int64).
    """
    from .placement import Placement
    weight = np.asarray(weight)
    policy = _check(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    w = weight.astype(np.float64)
    if policy == "hierarchical":
        phy2log = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    return Placement.from_phy2log(phy2log, weight.shape[1], num_gpus, num_nodes, policy)
