"""Two-micro-batch overlap of the MoE layer's communication with its expert FFN
against the serial schedule of the same work.

    python -m cupyep.launcher -n 8 experiments/bench_moe_overlap.py --mode both --out results/moe_overlap/overlap.jsonl

Each rank's tokens are split into micro-batches A and B (halves). In normal
mode both share one ``cupyep.Buffer`` made with ``num_in_flight=2`` (a
direct-transport dispatch's outputs are views of one of its two pool slots,
so both micro-batches' results are valid at once); in low-latency mode each
has its own ``cupyep.LowLatencyBuffer``, which holds one receive hook at a
time. The expert FFN is cupyep.moe's (``expert_ffn`` over the per-expert
blocks of ``result_blocks``; weights from ``MoEWeights.random``, this rank's
E / R experts, seeded by the rank; routing from cupyep.testing.global_routing).

Schedules (:func:`schedule`; steps (op, micro-batch) in host order):

- serial: A dispatch -> FFN -> combine, then B likewise, all stream-ordered.
- overlapped, normal mode (an SM split: the communication kernels get
  ``num_sms`` blocks per rank, the GEMMs the rest of the GPU): dispatch A;
  FFN A on the compute stream while dispatch B runs on the buffer's
  communication stream; combine A (A's stream) while FFN B; combine B. The
  communication steps form one lane in list order (each waits for the one
  before it, through events), so two communication kernels of one rank never
  run at once; an FFN waits only for its own dispatch, a combine for its own
  FFN and the communication step before it (``previous_event`` and
  ``async_finish=True``; the compute stream waits on ``result.event``). FFN A
  is enqueued before dispatch B, whose notify pass waits on the host for the
  counts, so the GPU has it to run meanwhile.
- overlapped, low-latency mode (receive hooks, all on the compute stream, no
  SMs held while waiting): dispatch send half A, send half B, receive A,
  FFN A (B's rows in flight), receive B, combine send half A, FFN B (A's
  combine in flight), combine receive A, combine B (send, receive). Both
  dispatch and combine have hooks. BF16 dispatch (the FFN reads BF16); the
  FFN gathers each expert's received rows (their count per source is known
  on the host from the routing, checked against the dispatch's layout_count
  before timing) into padded expert blocks of the most rows an expert has,
  runs cupyep.moe.padded_expert_ffn on them (one batched matmul per
  projection; ``--ll-ffn per_expert``: expert-major blocks and expert_ffn,
  five launches per local expert), and scatters the outputs back into the
  [E_local, R * max_tokens, H] rows the combine reads:
  by default (``--ll-combines zero_copy``) straight into the buffer's
  ``get_next_combine_buffer``, which the owners read in place; with ``push``
  into an array of the caller's, which the combine copies to the owners.

Timing (cupyep/lab/bench/timing.timed_rounds, as the other benchmarks): every
call after an L2 flush, a GPU sleep (--sleep-us, so the host has queued the
call before the GPU reaches it) and a GPU barrier, CUDA events on the compute
stream around the barrier and the call; the slowest rank's (MPI MAX) median
over --iters. The serial and the overlapped schedule alternate in one round;
the parts (dispatch, FFN, combine of each micro-batch, each alone, in
decode order) are a round of their own. Record: "mode", "transport",
"comm_sms", "combine" ("zero_copy" or "push"; normal mode: MoELayer's
default is zero-copy on the direct transport within a node, --combines;
low-latency mode: --ll-combines), "ll_ffn" (low-latency mode: "batched" or
"per_expert", --ll-ffn), "tokens", "hidden", "ffn", "serial_us", "overlapped_us",
"speedup" (serial / overlapped), "parts" (medians, us), "comm_us" and
"compute_us" (their sums), "ideal_us" = max(comm_us, compute_us),
"exposed_us" = overlapped_us - compute_us (the communication the overlap did
not hide behind the FFN), "comm_blocks" (normal mode: the most blocks
per rank a communication call takes: num_sms, or with num_sms 0 the
route's default, measured (cupyep.sm_defaults) where it applies, else the
rank's share; low-latency mode: the buffers' num_blocks, --ll-blocks),
"ffn_sms" (the GPU's SMs less every rank's comm_blocks),
"sm_defaults" (CUPYEP_SM_DEFAULTS: "packaged", "off" or a table's path),
"pipeline_us" (normal mode: what this two-lane schedule takes at the parts'
times, dispatch A + max(FFN A, dispatch B) + max(combine A, FFN B) +
combine B; :func:`simulate`), "bitwise_equal", "env" (cupyep.lab.bench.report).
After the timed rounds the overlapped schedule's outputs are compared
bitwise with the serial schedule's for both micro-batches (same kernels,
same reduction order): a difference raises on every rank.

The --ffn default (:data:`DEFAULT_FFN` = 40), from FLOPs. Normal mode, 8
ranks on one H200 under MPS, T = 4096: a micro-batch is 2048 tokens per rank,
2048 x 8 = 16384 (token, expert) pairs per rank, 131072 on the GPU. Its
communication, half of the T = 4096 records (docs/measurements.md, strict):
expert-major dispatch with notify 2488 / 2 us (direct) to 4590 / 2 us
(queue), combine about 2450 / 2 us: 2.5 to 3.5 ms. Its FFN: two float32
matmuls (CuPy, no TF32) of 2 x pairs x H x F flops each, 3.76e9 x F on the
GPU, at about 50 TFLOP/s (H200 FP32 peak 67) 75 us x F: F = 40 gives 3 ms.
Low-latency mode, T = 128: 64 tokens per rank per micro-batch, 4096 pairs on
the GPU, 1.2e8 x F flops = 2.3 us x F against about 45 us (BF16 dispatch) +
50 us (combine): F = 40 again. But the matmuls do not bound this FFN:

- expert_ffn (cupyep.moe) converts BF16 <-> float32 and applies SiLU in one
  elementwise kernel each: about 22 bytes of HBM traffic per (pair,
  channel), about 4 ms of conversions plus 3 ms of matmuls per normal-mode
  micro-batch on the GPU at F = 40, of the order of its communication.
- in low-latency mode the per-expert loop (``--ll-ffn per_expert``) is
  launch-bound: 32 local experts x 5 CuPy kernels per micro-batch and rank,
  milliseconds against 0.1 ms of communication. The default batched FFN
  makes about a dozen launches a micro-batch (gather, convert, two batched
  matmuls, SiLU, convert, two scatters) at the cost of the padding rows.

So at the defaults the FFN is the longer lane in both modes and "ideal_us"
is its sum; --ffn (several values: a sweep) changes the balance.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from cupyep.lab.bench import require_gpu
from cupyep.sm_defaults import ENV_VAR as SM_DEFAULTS_VAR
from cupyep.lab.bench.timing import FLUSH_MODES
from cupyep.testing import all_ranks

MODES = ("normal", "low_latency")
TRANSPORTS = ("queue", "direct")
DEFAULT_TOKENS = {"normal": 4096, "low_latency": 128}
DEFAULT_FFN = 40
DEFAULT_COMM_SMS = ("default", "8", "4")
MICRO_BATCHES = ("a", "b")
LL_FFNS = ("batched", "per_expert")

# The ops of a schedule, per mode, in the order each micro-batch runs them.
OPS = {"normal": ("dispatch", "ffn", "combine"),
       "low_latency": ("dispatch_send", "dispatch_recv", "ffn", "combine_send", "combine_recv")}
# The parts timed alone: name -> the ops of one micro-batch it runs.
PARTS = {"normal": {"dispatch": ("dispatch",), "ffn": ("ffn",), "combine": ("combine",)},
         "low_latency": {"dispatch": ("dispatch_send", "dispatch_recv"), "ffn": ("ffn",),
                         "combine": ("combine_send", "combine_recv")}}


# ---------------------------------------------------------------- host logic

def parse_comm_sms(value: str):
    """One --comm-sms value: "default" -> None (the library's default), else blocks per rank (int >= 1)."""
    if value == "default":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--comm-sms takes 'default' or a block count, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--comm-sms block counts must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="two-micro-batch overlap of MoE dispatch/combine with the expert FFN")
    p.add_argument("--mode", choices=MODES + ("both",), default="both")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens per rank, split into two micro-batches (default: {DEFAULT_TOKENS['normal']} normal, "
                        f"{DEFAULT_TOKENS['low_latency']} low-latency)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, nargs="+", default=[DEFAULT_FFN],
                   help="expert FFN width F (several: one run each); the default's estimate is in the docstring")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--transport", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS),
                   help="normal mode's transports")
    p.add_argument("--comm-sms", nargs="+", type=parse_comm_sms, default=[parse_comm_sms(v) for v in DEFAULT_COMM_SMS],
                   help="normal mode: blocks per rank of dispatch and combine ('default': the library's)")
    p.add_argument("--alignment", type=int, default=128, help="normal mode's expert_alignment (as MoELayer)")
    p.add_argument("--combines", nargs="+", choices=("default", "push"), default=["default"],
                   help="normal mode's combine: MoELayer's default (zero-copy on the direct transport within a "
                        "node, the pushing combine elsewhere) and/or the pushing combine everywhere")
    p.add_argument("--ll-combines", nargs="+", choices=("zero_copy", "push"), default=["zero_copy"],
                   help="low-latency mode's combine: zero_copy (the default: the FFN writes its outputs into "
                        "get_next_combine_buffer, the owners read them there) and/or push (the outputs in an "
                        "array of the caller's, which the combine copies into the owners' buffers)")
    p.add_argument("--ll-ffn", nargs="+", choices=LL_FFNS, default=[LL_FFNS[0]],
                   help="low-latency mode's FFN: batched (the default: padded expert blocks, one batched matmul "
                        "per projection, cupyep.moe.padded_expert_ffn) and/or per_expert (cupyep.moe.expert_ffn, "
                        "five launches per local expert)")
    p.add_argument("--ll-blocks", nargs="+", type=parse_comm_sms, default=[None],
                   help="low-latency mode: blocks per rank of both buffers ('default': the library's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--flush", choices=FLUSH_MODES, default="write")
    p.add_argument("--sleep-us", type=float, default=400.0)
    p.add_argument("--seed", type=int, default=0, help="routing seed")
    p.add_argument("--out", default="results/moe_overlap/overlap.jsonl")
    return p


def check_args(args) -> None:
    """ValueError for arguments no run can use."""
    if args.tokens is not None and args.tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (two micro-batches), got {args.tokens}")
    if min(args.ffn) < 1:
        raise ValueError(f"--ffn must be >= 1, got {args.ffn}")
    if args.hidden < 128 or args.hidden % 128:
        raise ValueError(f"--hidden must be a positive multiple of 128, got {args.hidden}")
    if not 1 <= args.topk <= args.experts:
        raise ValueError(f"--topk must be in [1, --experts={args.experts}], got {args.topk}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")
    if args.alignment < 1:
        raise ValueError(f"--alignment must be >= 1, got {args.alignment}")


def modes_of(mode: str) -> tuple:
    return MODES if mode == "both" else (mode,)


def tokens_for(mode: str, tokens: int | None) -> int:
    """Tokens per rank of a run of ``mode``: --tokens, else the mode's default."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return DEFAULT_TOKENS[mode] if tokens is None else int(tokens)


def split_tokens(num_tokens: int) -> dict:
    """{"a": slice, "b": slice}: the two micro-batches of a rank's tokens (A gets the odd one)."""
    if num_tokens < 2:
        raise ValueError(f"two micro-batches need at least 2 tokens, got {num_tokens}")
    half = num_tokens - num_tokens // 2
    return {"a": slice(0, half), "b": slice(half, num_tokens)}


def comm_sms_problem(transport: str, sms) -> str | None:
    """Why ``sms`` blocks per rank cannot run on ``transport`` (None: they can; the
    library checks residency itself)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if sms is None:
        return None
    if sms < 1:
        return f"num_sms={sms} < 1"
    if transport == "queue" and (sms < 2 or sms % 2):
        return f"the queue transport needs an even num_sms >= 2 (half send, half receive), got {sms}"
    return None


def schedule(mode: str, overlapped: bool) -> list:
    """The steps (op, micro-batch) of a schedule, in host order."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not overlapped:
        return [(op, m) for m in MICRO_BATCHES for op in OPS[mode]]
    if mode == "normal":
        return [("dispatch", "a"), ("ffn", "a"), ("dispatch", "b"), ("combine", "a"), ("ffn", "b"),
                ("combine", "b")]
    return [("dispatch_send", "a"), ("dispatch_send", "b"), ("dispatch_recv", "a"), ("ffn", "a"),
            ("dispatch_recv", "b"), ("combine_send", "a"), ("ffn", "b"), ("combine_recv", "a"),
            ("combine_send", "b"), ("combine_recv", "b")]


def check_schedule(mode: str, steps) -> None:
    """ValueError unless every micro-batch runs each op of ``mode`` exactly once, in OPS order."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    seen = {m: [] for m in MICRO_BATCHES}
    for step in steps:
        op, m = step
        if op not in OPS[mode] or m not in seen:
            raise ValueError(f"step {step!r} is not an op of {mode} mode on a micro-batch {MICRO_BATCHES}")
        seen[m].append(op)
    for m, ops in seen.items():
        if tuple(ops) != OPS[mode]:
            raise ValueError(f"micro-batch {m} runs {ops}, not {list(OPS[mode])}")


def part_calls(mode: str) -> list:
    """The parts timed alone, in decode order: [(name, steps)], name "<part>_<micro-batch>"."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return [(f"{name}_{m}", [(op, m) for op in ops]) for m in MICRO_BATCHES for name, ops in PARTS[mode].items()]


def lane_sums(parts_us: dict) -> tuple[float, float]:
    """(communication, compute) us: the sums of the parts' medians ("ffn_*" is compute)."""
    comm = sum(v for k, v in parts_us.items() if not k.startswith("ffn_"))
    compute = sum(v for k, v in parts_us.items() if k.startswith("ffn_"))
    return float(comm), float(compute)


def ideal_us(parts_us: dict) -> float:
    """The overlapped time if one lane hid the other entirely: max(sum comm, sum compute)."""
    return max(lane_sums(parts_us))


def simulate(steps, durations: dict) -> float:
    """The makespan of a normal-mode schedule at the given step durations
    (``durations[(op, micro-batch)]``), with the executor's dependencies:
    communication steps one after another in list order, FFNs one after
    another in list order, an FFN after its dispatch, a combine after its FFN."""
    end = {}
    comm_free = compute_free = 0.0
    for op, m in steps:
        d = float(durations[(op, m)])
        if op == "dispatch":
            start = comm_free
        elif op == "ffn":
            start = max(compute_free, end[("dispatch", m)])
        elif op == "combine":
            start = max(comm_free, end[("ffn", m)])
        else:
            raise ValueError(f"simulate models normal mode only, got op {op!r}")
        end[(op, m)] = start + d
        if op == "ffn":
            compute_free = end[(op, m)]
        else:
            comm_free = end[(op, m)]
    return max(end.values(), default=0.0)


def ffn_sms(device_sms: int, ranks_per_gpu: int, comm_blocks: int) -> int:
    """SMs the FFN has while the communication kernels run: the GPU's less
    every rank's ``comm_blocks`` on it (a block per SM), at least 0."""
    return max(0, int(device_sms) - int(ranks_per_gpu) * int(comm_blocks))


def summarize(mode: str, parts_us: dict, serial_us: float, overlapped_us: float) -> dict:
    """The record's figures from the measured medians (us)."""
    comm, compute = lane_sums(parts_us)
    out = {"serial_us": serial_us, "overlapped_us": overlapped_us, "speedup": serial_us / overlapped_us,
           "parts": dict(parts_us), "comm_us": comm, "compute_us": compute, "ideal_us": max(comm, compute),
           "exposed_us": overlapped_us - compute,
           "ideal_speedup": serial_us / max(comm, compute) if max(comm, compute) > 0 else None}
    if mode == "normal":
        dur = {(op, m): parts_us[f"{op}_{m}"] for op in OPS["normal"] for m in MICRO_BATCHES}
        out["pipeline_us"] = simulate(schedule("normal", True), dur)
    return out


def local_counts(topk_idx_per_rank, rank: int, num_experts: int) -> np.ndarray:
    """[E_local, R] int64: rows of (local expert e, source rank r) a low-latency
    dispatch delivers to ``rank`` (tokens of r with expert rank * E_local + e
    among their top-k; -1 slots count for none). ``topk_idx_per_rank``: list
    over source ranks of [T_r, k] int host arrays."""
    R = len(topk_idx_per_rank)
    if num_experts % R:
        raise ValueError(f"{num_experts} experts are not divisible by {R} ranks")
    El = num_experts // R
    out = np.zeros((El, R), dtype=np.int64)
    for r, idx in enumerate(topk_idx_per_rank):
        idx = np.asarray(idx)
        mine = idx[(idx >= rank * El) & (idx < (rank + 1) * El)] - rank * El
        out[:, r] = np.bincount(mine, minlength=El)
    return out


@dataclass(frozen=True)
class ExpertRows:
    """Where a low-latency dispatch put each local expert's rows.

    Attributes:
        flat: [N] int64 row numbers in the dispatch's [E_local * slots, H]
            rows (row e * slots + r * max_tokens + j), experts in order, then
            sources, then j.
        blocks: E_local (first, count) pairs of the expert-major blocks that
            gathering ``flat`` makes (cupyep.moe.expert_ffn's blocks).
        padded: [E_local, M] int64 row numbers of the same rows in padded
            expert blocks of M = the most rows of an expert (at least 1):
            expert e's rows first, then its first slot row again as padding
            (cupyep.moe.padded_expert_ffn's x).
        unpadded: [N] int64 positions in the [E_local * M] padded rows of the
            rows of ``flat``, in its order.
    """
    flat: np.ndarray
    blocks: list = field(default_factory=list)
    padded: np.ndarray = None
    unpadded: np.ndarray = None


def expert_rows(counts: np.ndarray, max_tokens: int) -> ExpertRows:
    """ExpertRows of [E_local, R] counts (local_counts) in slots of R * max_tokens rows."""
    from cupyep.moe import expert_blocks
    counts = np.asarray(counts, dtype=np.int64)
    El, R = counts.shape
    if counts.min(initial=0) < 0 or counts.max(initial=0) > max_tokens:
        raise ValueError(f"counts must lie in [0, max_tokens={max_tokens}]")
    slots = R * max_tokens
    per_expert = counts.sum(axis=1)
    M = max(1, int(per_expert.max(initial=0)))
    padded = np.repeat((np.arange(El, dtype=np.int64) * slots)[:, None], M, axis=1)
    for e in range(El):
        padded[e, :per_expert[e]] = np.concatenate(
            [e * slots + r * max_tokens + np.arange(counts[e, r], dtype=np.int64) for r in range(R)])
    # The padded rows that hold an expert's own rows, in expert order: flat is those rows.
    unpadded = np.flatnonzero(np.arange(M) < per_expert[:, None]).astype(np.int64)
    return ExpertRows(padded.reshape(-1)[unpadded], expert_blocks(per_expert, per_expert), padded, unpadded)


def ll_expert_ffn(recv_x, rows: ExpertRows, w1, w2, out, ffn=None, batched: bool = False):
    """The expert FFN of a low-latency dispatch (NumPy or CuPy): gather each
    expert's rows of ``recv_x`` ([E_local, slots, H] uint16, rows contiguous,
    row stride s, expert stride slots * s: a BF16 dispatch's recv_x) into
    expert-major blocks, ``ffn(x, blocks, w1, w2)`` (default
    cupyep.moe.expert_ffn) on them, and scatter the outputs into ``out``
    ([E_local, slots, H] uint16, C-contiguous: the combine's x). With
    ``batched``, into padded blocks instead (``rows.padded``), and
    ``ffn(x, w1, w2)`` (default cupyep.moe.padded_expert_ffn) on them: a
    dozen launches a micro-batch instead of five per expert. Rows of ``out``
    outside ``rows`` are left as they are. Returns ``out``."""
    from cupyep.moe import _xp, expert_ffn, padded_expert_ffn
    xp = _xp(recv_x)
    El, slots, H = recv_x.shape
    st = recv_x.strides
    if st[2] != recv_x.itemsize or st[0] != slots * st[1]:
        raise ValueError(f"recv_x must have contiguous rows and no gaps between experts, strides {st}")
    if out.shape != recv_x.shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {recv_x.shape} array")
    flat = xp.asarray(rows.flat)
    x2 = xp.lib.stride_tricks.as_strided(recv_x, shape=(El * slots, H), strides=(st[1], st[2]))
    if batched:
        y = (ffn or padded_expert_ffn)(x2[xp.asarray(rows.padded)], w1, w2)
        y = y.reshape(-1, H)[xp.asarray(rows.unpadded)]
    else:
        y = (ffn or expert_ffn)(x2[flat], rows.blocks, w1, w2)
    out.reshape(El * slots, H)[flat] = y
    return out


# ------------------------------------------------------------- GPU executors

@dataclass
class MicroBatch:
    """One micro-batch of this rank: its tokens, routing and buffer."""
    x: object
    topk_idx: object
    topk_weights: object
    buf: object
    rows: ExpertRows | None = None  # low-latency mode: where its rows land
    y_full: object = None           # low-latency mode: the combine's input rows


class NormalRunner:
    """Runs normal-mode steps: dispatch / combine on the micro-batch's buffer's
    communication stream (async, ordered among themselves by events), the FFN
    on the current (compute) stream."""

    def __init__(self, mbs: dict, num_experts: int, transport: str, dcfg, ccfg, alignment: int, w1, w2, ffn,
                 zero_copy: bool = False):
        self.mbs, self.E, self.transport, self.zero_copy = mbs, num_experts, transport, zero_copy
        self.dcfg, self.ccfg, self.alignment = dcfg, ccfg, alignment
        self.w1, self.w2, self.ffn = w1, w2, ffn

    def run(self, steps, state: dict) -> dict:
        """Enqueue ``steps``; ``state`` keeps each micro-batch's results ("d", "y", "c")
        between calls. The compute stream ends waiting for every communication step."""
        import cupy
        from cupyep.moe import result_blocks
        compute = cupy.cuda.get_current_stream()
        last = cupy.cuda.Event(disable_timing=True)
        last.record(compute)  # the first communication step waits for the compute stream (the barrier)
        issued = []
        for op, m in steps:
            mb = self.mbs[m]
            if op == "dispatch":
                d = mb.buf.dispatch(mb.x, mb.topk_idx, mb.topk_weights, num_experts=self.E, expert_major=True,
                                    expert_alignment=self.alignment, transport=self.transport, config=self.dcfg,
                                    previous_event=last, async_finish=True, validate=False)
                state.setdefault("d", {})[m] = d
                last = d.event.event
                issued.append(last)
            elif op == "ffn":
                d = state["d"][m]
                compute.wait_event(d.event.event)
                state.setdefault("y", {})[m] = self.ffn(d.expert_x, result_blocks(d), self.w1, self.w2)
            elif op == "combine":
                d = state["d"][m]
                ready = cupy.cuda.Event(disable_timing=True)
                ready.record(compute)  # after this micro-batch's FFN
                mb.buf.comm_stream.wait_event(last)  # after the communication step before it
                c = mb.buf.combine(state["y"][m], d.handle, pair_weights=d.recv_topk_weights, expert_major=True,
                                   config=self.ccfg, previous_event=ready, async_finish=True,
                                   zero_copy=self.zero_copy)
                state.setdefault("c", {})[m] = c
                last = c.event.event
                issued.append(last)
            else:
                raise ValueError(f"unknown normal-mode op {op!r}")
        for ev in issued:
            compute.wait_event(ev)
        return state


class LowLatencyRunner:
    """Runs low-latency steps, all on the current stream, the halves through receive hooks."""

    def __init__(self, mbs: dict, w1, w2, ffn, zero_copy: bool = False, batched: bool = False):
        self.mbs, self.w1, self.w2, self.ffn, self.zero_copy, self.batched = mbs, w1, w2, ffn, zero_copy, batched

    def run(self, steps, state: dict) -> dict:
        for op, m in steps:
            mb = self.mbs[m]
            if op == "dispatch_send":
                state.setdefault("d", {})[m] = mb.buf.dispatch(mb.x, mb.topk_idx, use_fp8=False, validate=False,
                                                               return_recv_hook=True)
            elif op == "dispatch_recv":
                state["d"][m].hook()
            elif op == "ffn":
                # zero-copy: the outputs go straight into the buffer the combine reads
                y = mb.buf.get_next_combine_buffer(state["d"][m].handle) if self.zero_copy else mb.y_full
                state.setdefault("y", {})[m] = ll_expert_ffn(state["d"][m].recv_x, mb.rows, self.w1, self.w2, y,
                                                             self.ffn, self.batched)
            elif op == "combine_send":
                state.setdefault("c", {})[m] = mb.buf.combine(None if self.zero_copy else state["y"][m], mb.topk_idx,
                                                              mb.topk_weights, state["d"][m].handle,
                                                              zero_copy=self.zero_copy, return_recv_hook=True)
            elif op == "combine_recv":
                state["c"][m].hook()
            else:
                raise ValueError(f"unknown low-latency op {op!r}")
        return state


# -------------------------------------------------------------------- timing

def _slowest(comm, seconds: float) -> float:
    from mpi4py import MPI
    return comm.allreduce(float(seconds), op=MPI.MAX) * 1e6


def measure(group, runner, mode: str, barrier, args) -> dict:
    """Time the parts, then serial against overlapped; check the outputs bitwise
    (collective). Returns summarize()'s figures plus spreads and "bitwise_equal"."""
    import cupy
    from cupyep.lab.bench.timing import timed_rounds
    comm = group.comm
    serial, overlapped = schedule(mode, False), schedule(mode, True)
    check_schedule(mode, serial)
    check_schedule(mode, overlapped)
    rounds = dict(iters=args.iters, warmup=args.warmup, flush=args.flush, sleep_us=args.sleep_us, before=barrier)

    parts_state = {}
    calls = part_calls(mode)
    timed = timed_rounds([lambda i, st, s=steps: runner.run(s, parts_state) for _, steps in calls], **rounds)
    parts_us = {name: _slowest(comm, t.median_s) for (name, _), (t, _) in zip(calls, timed)}
    parts_state.clear()

    kept = {}  # each schedule's results, kept until the round that replaces them has synchronized

    def call(name, steps):
        def run(i, st):
            kept[name] = runner.run(steps, {})
        return run

    (ts, _), (to, _) = timed_rounds([call("serial", serial), call("overlapped", overlapped)], **rounds)
    cupy.cuda.get_current_stream().synchronize()
    same = all(bool(cupy.array_equal(kept["serial"]["c"][m].combined_x, kept["overlapped"]["c"][m].combined_x))
               for m in MICRO_BATCHES)
    if not all_ranks(comm, same):
        raise RuntimeError(f"{mode} mode: the overlapped schedule's combined outputs differ from the serial "
                           f"schedule's (rank {group.rank}: {'same' if same else 'DIFFERENT'}); they must be "
                           "bitwise identical")
    kept.clear()
    out = summarize(mode, parts_us, _slowest(comm, ts.median_s), _slowest(comm, to.median_s))
    out.update(serial_p90_us=_slowest(comm, ts.p90_s), overlapped_p90_us=_slowest(comm, to.p90_s),
               iters=args.iters, bitwise_equal=True)
    return out


def local_weights(rank: int, num_ranks: int, hidden: int, ffn: int, num_experts: int):
    """(w1, w2) on the GPU, float32: MoEWeights.random of this rank's E / R experts, seeded by the rank."""
    import cupy
    from cupyep.moe import MoEWeights
    w = MoEWeights.random(rank, hidden=hidden, ffn=ffn, num_experts=num_experts // num_ranks)
    return cupy.asarray(w.w1), cupy.asarray(w.w2)


def routing_of(group, args, num_tokens: int):
    """(x, topk_idx, topk_weights) of this rank on the GPU and every rank's host topk_idx."""
    import cupy
    from cupyep.testing import global_routing, payload_bf16
    R, me = group.local_size, group.local_rank
    idx, w = global_routing(args.seed, [num_tokens] * R, args.experts, args.topk)
    x = cupy.asarray(payload_bf16(me, np.arange(num_tokens), args.hidden))
    return x, cupy.asarray(idx[me]), cupy.asarray(w[me]), idx


def micro_batches(x, topk_idx, topk_weights, bufs: dict, num_tokens: int) -> dict:
    import cupy
    parts = split_tokens(num_tokens)
    return {m: MicroBatch(cupy.ascontiguousarray(x[s]), cupy.ascontiguousarray(topk_idx[s]),
                          cupy.ascontiguousarray(topk_weights[s]), bufs[m]) for m, s in parts.items()}


def base_record(group, args, mode: str, num_tokens: int, ffn: int) -> dict:
    parts = split_tokens(num_tokens)
    return {"bench": "moe_overlap", "mode": mode, "ranks": group.local_size, "tokens": num_tokens,
            "micro_batch_tokens": [s.stop - s.start for s in parts.values()], "hidden": args.hidden, "ffn": ffn,
            "experts": args.experts, "topk": args.topk, "flush": args.flush,
            "sleep_us": args.sleep_us, "warmup": args.warmup,
            "sm_defaults": os.environ.get(SM_DEFAULTS_VAR) or "packaged"}


def normal_configs(buf, transport: str, sms):
    """(dispatch config, combine config) of ``sms`` blocks per rank (None: the library's defaults)."""
    from cupyep.normal.direct_kernels import DirectConfig
    if transport == "direct":
        cfg = DirectConfig(num_sms=sms or 0)  # 0: blocks from the call's shape, at most the SM budget
        return cfg, cfg
    dcfg, ccfg = buf.default_dispatch_config(), buf.default_combine_config()
    if sms is not None:  # a combine runs on its dispatch's channels: the same num_sms
        dcfg, ccfg = replace(dcfg, num_sms=sms), replace(ccfg, num_sms=sms)
    return dcfg, ccfg


def default_blocks(buf, transport: str, budget: int) -> int:
    """The most blocks per rank a default-config call of ``transport`` takes:
    on the direct route the larger of its dispatch's and combine's budgets
    (measured defaults, cupyep.sm_defaults, where they apply), else ``budget``."""
    if transport != "direct":
        return budget
    route = buf.routes["direct"]
    return max(route.budget("dispatch_bf16"), route.budget("combine_bf16"))


def normal_buffers(group, args, num_tokens: int) -> dict:
    """Micro-batch -> cupyep.Buffer: one buffer for both micro-batches (as one
    buffer serves every layer and micro-batch in a model), made for their
    tokens with two dispatches in flight and sized for the queue rings of
    every --comm-sms (collective)."""
    import cupyep
    R = group.local_size
    sizes = dict(max_tokens=max(s.stop - s.start for s in split_tokens(num_tokens).values()), hidden=args.hidden,
                 num_topk=max(args.topk, 8), num_in_flight=len(MICRO_BATCHES))
    buf = cupyep.Buffer(group, **sizes)
    need = max([cupyep.Buffer.size_hint(R, args.hidden, args.topk, *normal_configs(buf, "queue", s))
                for s in args.comm_sms if comm_sms_problem("queue", s) is None and (s or 0) <= buf.sm_budget],
               default=0)
    if need > buf.routes["queue"].node.buffer.nbytes:
        buf.destroy()
        buf = cupyep.Buffer(group, need, **sizes)
    return dict.fromkeys(MICRO_BATCHES, buf)


def agreed_refusal(comm, problem: str | None) -> str | None:
    """The refusal every rank agrees on (collective): None when no rank was
    refused, ``problem`` when every rank was. A refusal on some ranks only
    leaves the others' kernels waiting for them, so it ends the run on every
    rank, naming the refused ranks and their reasons."""
    problems = comm.allgather(problem)
    refused = [r for r, p in enumerate(problems) if p is not None]
    if not refused:
        return None
    if len(refused) == len(problems):
        return problems[0]
    detail = "; ".join(f"rank {r}: {problems[r]}" for r in refused)
    raise RuntimeError(f"a configuration was refused on ranks {refused} only, and ran on the others: {detail}")


def transport_has_zero_copy(buf) -> dict:
    """{transport: whether its combine can be zero-copy} for this buffer (the direct transport within a node)."""
    return {t: buf.routes[t].zero_copy for t in TRANSPORTS}


def normal_arms(args, has_zero_copy: dict) -> list:
    """(transport, comm_sms, zero_copy) of each normal-mode arm: per transport and SM count, one arm per
    --combines entry, "default" being MoELayer's default and "push" the pushing combine (the same arm
    once where they coincide)."""
    arms = []
    for transport in args.transport:
        for sms in args.comm_sms:
            kinds = {has_zero_copy[transport] if c == "default" else False for c in args.combines}
            arms += [(transport, sms, zc) for zc in sorted(kinds, reverse=True)]
    return arms


def run_normal(group, args, out, barrier) -> None:
    import cupy
    from cupyep.moe import expert_ffn
    R = group.local_size
    T = tokens_for("normal", args.tokens)
    x, topk_idx, topk_w, _ = routing_of(group, args, T)
    bufs = normal_buffers(group, args, T)
    try:
        mbs = micro_batches(x, topk_idx, topk_w, bufs, T)
        budget = bufs["a"].sm_budget
        device_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        for F in args.ffn:
            w1, w2 = local_weights(group.local_rank, R, args.hidden, F, args.experts)
            for transport, sms, zero_copy in normal_arms(args, transport_has_zero_copy(bufs["a"])):
                dcfg, ccfg = normal_configs(bufs["a"], transport, sms)
                blocks = dcfg.num_sms or default_blocks(bufs["a"], transport, budget)
                rec = {**base_record(group, args, "normal", T, F), "transport": transport, "comm_sms": sms,
                       "num_sms": dcfg.num_sms, "comm_blocks": blocks, "expert_alignment": args.alignment,
                       "ffn_sms": ffn_sms(device_sms, group.ranks_per_gpu, blocks),
                       "combine": "zero_copy" if zero_copy else "push",
                       "dispatch_config": asdict(dcfg), "combine_config": asdict(ccfg)}
                problem = comm_sms_problem(transport, sms)
                if problem is None and sms is not None and sms > budget:
                    problem = f"num_sms={sms} exceeds this rank's SM budget ({budget})"
                runner = NormalRunner(mbs, args.experts, transport, dcfg, ccfg, args.alignment, w1, w2,
                                      expert_ffn, zero_copy)
                if problem is None:
                    try:  # the first run allocates the direct pools and compiles; a refused config raises
                        warm = runner.run(schedule("normal", False), {})  # before any launch, on every rank
                    except ValueError as e:
                        problem = str(e)
                    problem = agreed_refusal(group.comm, problem)
                if problem:
                    out.write({**rec, "skipped": problem})
                    continue
                cupy.cuda.get_current_stream().synchronize()
                del warm
                out.write({**rec, **measure(group, runner, "normal", barrier, args)})
            del w1, w2
    finally:
        bufs["a"].destroy()  # the one buffer of both micro-batches


def run_low_latency(group, args, out, barrier) -> None:
    import cupy
    import cupyep
    R, me = group.local_size, group.local_rank
    T = tokens_for("low_latency", args.tokens)
    x, topk_idx, topk_w, idx_all = routing_of(group, args, T)
    parts = split_tokens(T)
    most = max(s.stop - s.start for s in parts.values())
    device_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for blocks in args.ll_blocks:
        bufs = {m: None for m in MICRO_BATCHES}
        try:
            for m in MICRO_BATCHES:
                bufs[m] = cupyep.LowLatencyBuffer(group, most, args.hidden, args.experts, max_topk=args.topk,
                                                  num_blocks=blocks)
            mbs = micro_batches(x, topk_idx, topk_w, bufs, T)
            counts = {}
            for m, s in parts.items():
                counts[m] = local_counts([i[s] for i in idx_all], me, args.experts)
                rows = expert_rows(counts[m], most)
                mbs[m].rows = replace(rows, flat=cupy.asarray(rows.flat), padded=cupy.asarray(rows.padded),
                                      unpadded=cupy.asarray(rows.unpadded))  # on the GPU once: no upload per call
                mbs[m].y_full = cupy.zeros((args.experts // R, R * most, args.hidden), dtype=cupy.uint16)
            num_blocks = bufs["a"].num_blocks
            for F in args.ffn:
                w1, w2 = local_weights(me, R, args.hidden, F, args.experts)
                for ffn, combine in ((f, c) for f in args.ll_ffn for c in args.ll_combines):
                    runner = LowLatencyRunner(mbs, w1, w2, None, zero_copy=combine == "zero_copy",
                                              batched=ffn == "batched")
                    rec = {**base_record(group, args, "low_latency", T, F), "transport": None, "comm_sms": blocks,
                           "num_blocks": num_blocks, "comm_blocks": num_blocks,
                           "ffn_sms": ffn_sms(device_sms, group.ranks_per_gpu, num_blocks),
                           "num_waiters": bufs["a"].num_waiters, "max_tokens": most, "dispatch": "bf16",
                           "combine": combine, "ll_ffn": ffn}
                    warm = runner.run(schedule("low_latency", False), {})
                    cupy.cuda.get_current_stream().synchronize()
                    ok = all(np.array_equal(warm["d"][m].handle.layout_count.get(), counts[m]) for m in MICRO_BATCHES)
                    if not all_ranks(group.comm, ok):
                        raise RuntimeError("the low-latency dispatch's layout_count differs from the counts of the "
                                           "host routing the FFN gathers by")
                    del warm
                    out.write({**rec, **measure(group, runner, "low_latency", barrier, args)})
                del w1, w2
        finally:
            for b in bufs.values():
                if b is not None:
                    b.destroy()


def main():
    parser = build_parser()
    args = parser.parse_args()
    require_gpu(__file__)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    import cupyep
    from cupyep.barrier import GpuBarrier
    from cupyep.lab.bench.report import JsonlWriter
    group = cupyep.init()
    out = JsonlWriter(args.out, group)
    bar = GpuBarrier(group)
    try:
        for mode in modes_of(args.mode):
            (run_normal if mode == "normal" else run_low_latency)(group, args, out, bar)
    finally:
        bar.destroy()
        group.destroy()


if __name__ == "__main__":
    main()
