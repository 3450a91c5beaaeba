"""Moving experts to a new placement, and deciding when the move pays
(NumPy only; the copies themselves are cupyep.balance.store's).

A placement change keeps every expert that stays on its GPU where it is
(:func:`align` reorders the new placement's slots inside each GPU, which
renames nothing a dispatch sees beyond that GPU's physical ids) and moves
the rest: each slot whose expert changes is pulled from a rank that holds
that expert now, the nearest one first (the same rank, then the same node),
spreading the pulls over the holders (:func:`plan_moves`).

:class:`MigrationPolicy` weighs the move against what it saves. The time
of a layer's experts is its most loaded GPU's: (row, expert) pairs times
the measured time per pair. Over ``horizon_steps`` steps the new placement
saves the difference of the stragglers; the move costs the bytes the
busiest rank pulls (or serves) over the measured copy bandwidth, less the
part hidden behind compute. :class:`OnlineBalancer` runs it per step or
micro-batch from the loads the layout pass counted, behind an imbalance
alarm.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .placement import Placement, balancedness
from .planner import rebalance_experts


@dataclass(frozen=True)
class Move:
    """Copy the weights of ``logical`` from (src_rank, src_slot) of the old
    placement into (dst_rank, dst_slot) of the new one (slots: the rank's
    local physical expert index)."""
    dst_rank: int
    dst_slot: int
    src_rank: int
    src_slot: int
    logical: int


def _same_shape(old: Placement, new: Placement) -> None:
    if old.num_layers != 1 or new.num_layers != 1:
        raise ValueError("a migration moves the experts of one layer: pass Placement.layer(i)")
    if (old.num_physical, old.num_gpus, old.num_logical) != (new.num_physical, new.num_gpus, new.num_logical):
        raise ValueError(f"the placements differ in shape (physical, GPUs, logical): "
                         f"{(old.num_physical, old.num_gpus, old.num_logical)} and "
                         f"{(new.num_physical, new.num_gpus, new.num_logical)}")


def align(old: Placement, new: Placement) -> Placement:
    """``new`` with its slots reordered inside each GPU so that as many slots
    as possible keep the expert they hold in ``old`` (one layer each, the
    same numbers of physical experts, GPUs and logical experts)."""
    _same_shape(old, new)
    n = old.experts_per_gpu
    out = new.phy2log[0].copy()
    for g in range(old.num_gpus):
        was = old.phy2log[0, g * n:(g + 1) * n]
        want = list(new.phy2log[0, g * n:(g + 1) * n])
        row = np.full(n, -1, dtype=np.int64)
        for s, e in enumerate(was):  # an expert that stays keeps its slot
            if e in want:
                row[s] = e
                want.remove(e)
        row[row < 0] = want
        out[g * n:(g + 1) * n] = row
    return Placement.from_phy2log(out, new.num_logical, new.num_gpus, new.num_nodes, new.policy)


def plan_moves(old: Placement, new: Placement) -> list[Move]:
    """The copies that turn ``old`` into ``new`` (align it first to keep the
    most experts in place): one Move per slot whose expert changes, from the
    nearest holder (own rank, then own node, then any), ties to the holder
    with the fewest pulls so far, then the lower rank."""
    _same_shape(old, new)
    n, G = old.experts_per_gpu, old.num_gpus
    per_node = G // old.num_nodes
    holders: dict[int, list[tuple[int, int]]] = {}
    for p, e in enumerate(old.phy2log[0]):
        holders.setdefault(int(e), []).append((p // n, p % n))
    served = np.zeros(G, dtype=np.int64)
    moves = []
    for p, (e, before) in enumerate(zip(new.phy2log[0], old.phy2log[0])):
        if e == before:
            continue
        dst = p // n

        def cost(h):
            rank = h[0]
            return (0 if rank == dst else 1 if rank // per_node == dst // per_node else 2, served[rank], rank)
        src_rank, src_slot = min(holders[int(e)], key=cost)
        served[src_rank] += 1
        moves.append(Move(dst, p % n, src_rank, src_slot, int(e)))
    return moves


def replan(placement: Placement, loads, num_groups: int = 1) -> Placement:
    """A new placement of one layer for ``loads`` [E] (pairs per logical
    expert) on ``placement``'s slots, GPUs and nodes: rebalance_experts with
    ``num_groups`` expert groups where the nodes divide them, else none."""
    p = placement
    groups = num_groups if num_groups % p.num_nodes == 0 else 1
    return rebalance_experts(np.asarray(loads, dtype=np.float64).reshape(1, -1), p.num_physical, groups, p.num_nodes,
                             p.num_gpus).layer(0)


@dataclass(frozen=True)
class MigrationPolicy:
    """When a move pays (module docstring).

    Attributes:
        bytes_per_expert: the weights of one expert (all its matrices).
        copy_GBps: the one-copy path's measured bandwidth per rank, GB/s.
        us_per_pair: the experts' measured time per (row, expert) pair, us.
        horizon_steps: steps the new placement is expected to serve.
        overlap: the fraction of the move hidden behind compute, in [0, 1].
    """
    bytes_per_expert: int
    copy_GBps: float
    us_per_pair: float
    horizon_steps: int = 100
    overlap: float = 0.0

    def __post_init__(self):
        if self.bytes_per_expert < 0 or self.copy_GBps <= 0 or self.us_per_pair < 0 or self.horizon_steps < 1:
            raise ValueError("MigrationPolicy needs bytes_per_expert >= 0, copy_GBps > 0, us_per_pair >= 0 and "
                             "horizon_steps >= 1")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")

    def decide(self, old: Placement, new: Placement, loads) -> dict:
        """Whether moving from ``old`` to ``new`` (one layer, aligned or not)
        pays for ``loads`` [E] (pairs per logical expert per step, e.g. the
        layout's num_tokens_per_expert summed over the ranks).

        Returns a dict: "pays", "moves" (the Move list of the aligned plan),
        "moved_experts", "moved_bytes", "move_us", "saved_us_per_step",
        "saved_us" (over the horizon), "straggler_pairs_before" / "_after",
        and the balancedness before and after."""
        new = align(old, new)
        moves = plan_moves(old, new)
        loads = np.asarray(loads, dtype=np.float64).reshape(1, -1)
        before, after = old.gpu_loads(loads), new.gpu_loads(loads)
        saved = (before.max() - after.max()) * self.us_per_pair
        pulled = np.bincount([m.dst_rank for m in moves if m.src_rank != m.dst_rank], minlength=old.num_gpus)
        served = np.bincount([m.src_rank for m in moves if m.src_rank != m.dst_rank], minlength=old.num_gpus)
        busiest = int(max(pulled.max(initial=0), served.max(initial=0)))
        move_us = busiest * self.bytes_per_expert / (self.copy_GBps * 1e3) * (1.0 - self.overlap)
        return {"pays": bool(saved * self.horizon_steps > move_us and moves), "placement": new, "moves": moves,
                "moved_experts": len(moves), "moved_bytes": len(moves) * self.bytes_per_expert,
                "move_us": round(move_us, 3), "saved_us_per_step": round(float(saved), 3),
                "saved_us": round(float(saved) * self.horizon_steps, 3),
                "straggler_pairs_before": float(before.max()), "straggler_pairs_after": float(after.max()),
                "before": balancedness(before), "after": balancedness(after)}


class OnlineBalancer:
    """Re-plans one layer's placement from each step's loads and moves only
    when it pays.

    Arguments:
        placement: the current placement (one layer).
        policy: a MigrationPolicy.
        num_groups: expert groups for the planner (1: none).
        alarm: re-plan only when the current placement's per-GPU max over
            mean load exceeds this (1.0: every step).
        smoothing: None to plan from each step's loads alone (per-micro-batch
            mode), or a factor in (0, 1] of an exponential moving average of
            the loads (the periodic mode on history).
    """

    def __init__(self, placement: Placement, policy: MigrationPolicy, num_groups: int = 1, alarm: float = 1.1,
                 smoothing: float | None = None):
        if placement.num_layers != 1:
            raise ValueError("OnlineBalancer balances one layer: pass Placement.layer(i)")
        if smoothing is not None and not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1] or None, got {smoothing}")
        self.placement, self.policy, self.num_groups = placement, policy, num_groups
        self.alarm, self.smoothing = float(alarm), smoothing
        self._average = None

    def step(self, loads) -> dict | None:
        """The decision for this step's ``loads`` [E] (pairs per logical
        expert): None when the alarm stays quiet, else MigrationPolicy.decide's
        dict; when it pays, ``self.placement`` becomes the new placement (the
        caller moves the weights by its "moves" before the next step)."""
        loads = np.asarray(loads, dtype=np.float64).reshape(-1)
        if loads.shape[0] != self.placement.num_logical:
            raise ValueError(f"loads has {loads.shape[0]} experts, the placement {self.placement.num_logical}")
        if self.smoothing is not None:
            self._average = loads if self._average is None else \
                self.smoothing * loads + (1.0 - self.smoothing) * self._average
            loads = self._average
        now = balancedness(self.placement.gpu_loads(loads[None]))["worst_max_over_mean"]
        if now <= self.alarm:
            return None
        p = self.placement
        decision = self.policy.decide(p, replan(p, loads, self.num_groups), loads)
        if decision["pays"]:
            self.placement = decision["placement"]
        return decision
