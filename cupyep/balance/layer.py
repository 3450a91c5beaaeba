"""One MoE layer's balancing around each of its steps.

:class:`LayerBalancer` drives a layer that holds a placement and moves its
experts (cupyep.moe.MoELayer: ``placement``, ``num_experts``,
``start_migration``, ``finish_migration``, ``buffer.group``) under one of
three modes, each paying its own cost inside the step:

- ``"eplb"``: every ``period`` steps, re-plan from an exponential moving
  average of the past steps' loads (``smoothing``: the newest step's
  weight; never the step about to run) and move the experts while that step
  computes (the move starts before its forward and commits after it);
- ``"online"``: cupyep.balance.OnlineBalancer on the same average: an
  imbalance alarm, then a move only when MigrationPolicy says it pays; the
  move overlaps the next step;
- ``"per_step"``: the per-micro-batch mode: before the step, count its
  loads (each rank's (token, expert) pairs per logical expert, exchanged:
  what the layout pass has); when the current placement spreads them
  unevenly (per-GPU max over mean above ``tolerance``), plan from them and
  finish the move before the dispatch, so the step runs balanced for its
  own routing. A placement that already holds the step's loads within
  ``tolerance`` stays, and so does one that the new plan would not beat by
  :data:`MIN_GAIN` (:func:`per_step_decision`): on steady skew the experts
  move once, not every step.

The balancer moves the layer's weights into registered memory when it is
made (``layer.prepare_migration()``, collective), so no step pays for that.

Call :meth:`LayerBalancer.before` with the step's logical ``topk_idx`` before
the layer's forward and :meth:`LayerBalancer.after` after it, on every rank
(both are collective). Each returns what it did.
"""
from __future__ import annotations

import numpy as np

from ..arrays import expert_counts, to_host
from .migration import MigrationPolicy, OnlineBalancer, align, plan_moves, replan

MODES = ("eplb", "online", "per_step")


def step_loads(group, topk_idx, num_experts: int) -> np.ndarray:
    """Collective: [E] int64, the (token, expert) pairs per logical expert
    over every rank's ``topk_idx`` ([T, k] int64, -1 for none; NumPy or
    CuPy), from each rank's counts (one host exchange)."""
    local = to_host(expert_counts(topk_idx, num_experts))
    return group.exchange(local, "balance: expert loads").sum(axis=0)


MIN_GAIN = 0.005


def per_step_decision(placement, loads, plan, tolerance: float, floor: float = 1.0):
    """The per-step rule, for one step's loads: (planned, the placement to
    move to or None, the new floor).

    Arguments:
        placement: the current one-layer Placement.
        loads: [E] the step's (token, expert) pairs per logical expert.
        plan: loads [E] -> a new one-layer Placement (e.g. :func:`replan`).
        tolerance: keep the placement while its per-GPU max over mean on
            ``loads`` is at most this (>= 1); 0 plans and moves every step.
        floor: the placement's max over mean when a plan last did not pay
            (plus :data:`MIN_GAIN`), 1.0 after one that moved: up to it a
            plan is not tried again.

    A plan is moved to only when it removes at least half of the
    placement's excess over a perfect 1.0 on these loads (and at least
    :data:`MIN_GAIN`): a plan fitted to one step's loads always beats the
    placement a little on them, and moving for that would chase the
    step-to-step noise. One that does not pay raises the floor to the
    placement's max over mean plus MIN_GAIN, so the next plan waits for the
    loads to move past it.
    """
    if tolerance == 0:
        return True, plan(loads), 1.0
    cur = placement.gpu_loads(np.asarray(loads, dtype=np.float64)[None])[0]
    if cur.mean() <= 0:
        return False, None, floor
    now = cur.max() / cur.mean()
    if now <= max(tolerance, floor):
        return False, None, floor
    new = plan(loads)
    got = new.gpu_loads(np.asarray(loads, dtype=np.float64)[None])[0]
    reached = got.max() / got.mean()
    if reached > now - max(MIN_GAIN, (now - 1.0) / 2):  # moving would not pay
        return True, None, now + MIN_GAIN
    return True, new, 1.0


class LayerBalancer:
    """Balancing of one layer (module docstring).

    per_step follows :func:`per_step_decision`.

    Arguments:
        layer: the layer (a placement of one layer over its ranks; moves
            its experts with start_migration / finish_migration).
        mode: one of :data:`MODES`.
        period: "eplb": steps between plans (>= 1).
        smoothing: weight of the newest step in the load average, in (0, 1].
        policy: "online": the MigrationPolicy that decides whether a move
            pays (required for that mode).
        alarm: "online": re-plan only above this per-GPU max over mean.
        num_groups: expert groups for the planner (1: none).
        tolerance: "per_step": keep the current placement while it holds the
            step's per-GPU loads within this max over mean (>= 1.0), see
            :func:`per_step_decision`; 0 plans and moves every step.
    """

    def __init__(self, layer, mode: str, *, period: int = 4, smoothing: float = 0.5,
                 policy: MigrationPolicy | None = None, alarm: float = 1.1, num_groups: int = 1,
                 tolerance: float = 1.05):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if layer.placement is None:
            raise ValueError("the layer holds no placement: give it one (e.g. rebalance_experts of uniform loads)")
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be an int >= 1, got {period!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if mode == "online" and policy is None:
            raise ValueError('mode "online" needs policy= (a MigrationPolicy)')
        if not (tolerance == 0 or tolerance >= 1.0):
            raise ValueError(f"tolerance must be >= 1.0 (a max over mean) or 0 (every step), got {tolerance}")
        self.layer, self.mode, self.period, self.smoothing = layer, mode, period, float(smoothing)
        self.num_groups, self.tolerance = num_groups, float(tolerance)
        self.group = layer.buffer.group
        self.num_logical = layer.placement.num_logical
        self.average = None  # [E] float64, the moving average of past loads
        self.steps = 0
        self.balancer = OnlineBalancer(layer.placement, policy, num_groups, alarm, smoothing) \
            if mode == "online" else None
        self._moving = False
        self._applied = self.balancer.placement if self.balancer is not None else None
        self._floor = 1.0  # per_step: the max over mean the last plan that did not pay reached
        layer.prepare_migration()

    def _plan(self, loads) -> object:
        return replan(self.layer.placement, loads, self.num_groups)

    def _start(self, placement) -> dict:
        old = self.layer.placement
        moves = [m for m in plan_moves(old, align(old, placement))
                 if m.src_rank != m.dst_rank or m.src_slot != m.dst_slot]
        if moves:
            self.layer.start_migration(placement)
            self._moving = True
        return {"planned": True, "moved_experts": len(moves),
                "pulled": np.bincount([m.dst_rank for m in moves], minlength=old.num_gpus).tolist()}

    def _finish(self) -> None:
        if self._moving:
            self.layer.finish_migration()
            self._moving = False

    def before(self, topk_idx) -> dict:
        """Collective, before the step's forward. Returns {"planned": bool,
        "moved_experts": moves over all ranks, "pulled": experts each rank
        pulls}."""
        none = {"planned": False, "moved_experts": 0, "pulled": [0] * self.layer.placement.num_gpus}
        if self.mode == "per_step":
            loads = step_loads(self.group, topk_idx, self.num_logical)
            planned, plan, self._floor = per_step_decision(self.layer.placement, loads, self._plan, self.tolerance,
                                                           self._floor)
            if plan is None:
                return dict(none, planned=planned)
            did = self._start(plan)
            self._finish()
            return did
        if self.mode == "eplb" and self.steps > 0 and self.steps % self.period == 0 and self.average is not None:
            return self._start(self._plan(self.average))
        if self.mode == "online" and self.balancer.placement is not self._applied:
            self._applied = self.balancer.placement
            return self._start(self._applied)
        return none

    def after(self, topk_idx) -> dict:
        """Collective, after the step's forward: commit a move in flight, and
        (eplb, online) add the step's loads to the average. Returns
        {"alarm": whether the online balancer re-planned}."""
        self._finish()
        self.steps += 1
        alarm = False
        if self.mode in ("eplb", "online"):
            loads = step_loads(self.group, topk_idx, self.num_logical).astype(np.float64)
            s = self.smoothing
            self.average = loads if self.average is None else s * loads + (1 - s) * self.average
            if self.balancer is not None:
                alarm = self.balancer.step(loads) is not None
        return {"alarm": alarm}
