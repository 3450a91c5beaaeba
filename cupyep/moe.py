"""An end-to-end MoE layer on cupyep: router -> dispatch -> per-expert FFN -> combine.

The layer every user of an EP library writes first, kept small:

1. route: softmax over the router logits, top-k, weights renormalised over
   the k chosen experts (:func:`route`);
2. ``Buffer.dispatch(..., expert_major=True)``: each rank receives the
   (token, local expert) pairs of its experts in per-expert blocks;
3. per local expert e, an FFN over the rows of its block (padding rows are
   left out of the math and stay zero): ``h = silu(x_e @ w1[e])`` in float32,
   ``y_e = BF16(h @ w2[e])`` (:func:`expert_ffn`). One up projection and
   SiLU, no gate/up split: enough to exercise the layout, not a model;
4. ``Buffer.combine(y, handle, pair_weights=recv_topk_weights,
   expert_major=True)``: each token gets the weighted sum of its experts'
   outputs (on the direct transport within a node with ``zero_copy=True``:
   the owners read the reduced rows where they were written).

:func:`reference_forward` computes the same layer in one process for the
tokens of all ranks (CuPy for CuPy input, NumPy for NumPy input), so a GPU
test compares every rank with it and a CPU test compares a NumPy emulation
of the distributed path with it.

Rounding points of the distributed path, which the reference mirrors:
the expert output ``y_e`` is rounded to BF16; each rank's reduce of a
token's local slots sums ``w_j * y_j`` in float32 in slot order and rounds to
BF16 (one partial per (token, rank)); combine sums the partials in float32 in
rank order and rounds to BF16. ``reference_forward(..., num_ranks=R)``
rounds at exactly these points; ``num_ranks=None`` is the plain layer (one
float32 sum over the k slots, one final BF16 rounding), which differs from
the distributed path by the per-rank partial rounding. Both stay within the
project's BF16 bound, calc_diff < 5e-6 (:data:`MOE_CALC_DIFF_BOUND`): the
NumPy emulation of the distributed path (tests/test_moe.py) at the GPU test's
shapes (8 x 256 tokens, H 2048, F 1024, E 64, top-8) gives 2e-7 against the
plain layer and 4e-12 against the mirrored one (what is left: matmul
summation order, float32 against float64 reduce). Since calc_diff averages
over all tokens, :func:`agreement` also reports the worst token's relative
error (bound :data:`MOE_TOKEN_BOUND` = 2e-2; measured 3e-3 plain, 1.4e-4
mirrored; dropping a token's smallest slot, weight >= 0.03 here, moves it by
about 0.1).

Arrays: BF16 travels as uint16 bit patterns (CuPy has no bfloat16); the
helpers here convert with integer arithmetic (round to nearest even), so the
same code runs on NumPy and CuPy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import sm_partition
from .arrays import to_host
from .arrays import xp_of as _xp

__all__ = ["MoEWeights", "MoELayer", "route", "expert_ffn", "padded_expert_ffn", "expert_blocks", "result_blocks",
           "reference_forward", "agreement", "bf16_bits_to_f32", "f32_to_bf16_bits", "MOE_CALC_DIFF_BOUND",
           "MOE_TOKEN_BOUND"]

#: calc_diff bound between MoELayer.forward and reference_forward (the project's BF16 bound).
MOE_CALC_DIFF_BOUND = 5e-6
#: bound on agreement()'s worst per-token relative error against reference_forward.
MOE_TOKEN_BOUND = 2e-2

# Seed streams of MoEWeights.random: np.random.default_rng([seed, stream, expert]).
_ROUTER_STREAM, _W1_STREAM, _W2_STREAM = 0, 1, 2



# ------------------------------------------------------------------ BF16 bits

_ELEMENTWISE: dict = {}  # name -> cupy.ElementwiseKernel, built on first use


def _elementwise(name: str):
    """The CuPy elementwise kernels of this module: each BF16 conversion and
    the SiLU in one pass over the array (the NumPy expressions below take
    several), with the same IEEE float32 operations, so the same bits."""
    if not _ELEMENTWISE:
        import cupy
        _ELEMENTWISE["to_f32"] = cupy.ElementwiseKernel(
            "uint16 b", "float32 f", "f = __uint_as_float(((unsigned int)b) << 16)", "cupyep_bf16_to_f32")
        _ELEMENTWISE["to_bf16"] = cupy.ElementwiseKernel(
            "float32 f", "uint16 b",
            """unsigned int u = __float_as_uint(f);
               unsigned int r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
               b = (unsigned short)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? ((u >> 16) | 0x0040u) : r);""",
            "cupyep_f32_to_bf16")
        _ELEMENTWISE["silu"] = cupy.ElementwiseKernel(
            "float32 z", "float32 y", "y = z / (1.0f + expf(-z))", "cupyep_silu")
    return _ELEMENTWISE[name]


def bf16_bits_to_f32(bits):
    """[...] uint16 BF16 bit patterns -> [...] float32 values (exact), NumPy or CuPy."""
    xp = _xp(bits)
    if xp is not np:
        return _elementwise("to_f32")(bits)
    return (bits.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def f32_to_bf16_bits(x, out=None):
    """[...] float32 -> [...] uint16 BF16 bit patterns, round to nearest even
    (as ml_dtypes and the CUDA kernels; NaN stays NaN), NumPy or CuPy.
    ``out``: a uint16 array of x's shape to write (CuPy only), or None."""
    xp = _xp(x)
    if xp is not np:
        return _elementwise("to_bf16")(x.astype(xp.float32, copy=False), out) if out is not None else \
            _elementwise("to_bf16")(x.astype(xp.float32, copy=False))
    if out is not None:
        raise ValueError("f32_to_bf16_bits writes into out only for CuPy arrays")
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1))) >> xp.uint32(16)
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    return xp.where(nan, (u >> xp.uint32(16)) | xp.uint32(0x0040), rounded).astype(xp.uint16)


def _bf16_values(x):
    """float32 array holding the BF16 roundings of x."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


# ------------------------------------------------------------------- weights

@dataclass
class MoEWeights:
    """The layer's weights, for the experts of all ranks.

    Attributes:
        router: [H, E] float32 router projection (logits = x @ router).
        w1: [E, H, F] float32 up projections, BF16-representable values.
        w2: [E, F, H] float32 down projections, BF16-representable values.

    :meth:`random` makes NumPy arrays; a copy holding CuPy arrays works too
    (MoELayer and a CuPy reference_forward then read them without uploads).

    Rank r of R uses experts [r * E / R, (r + 1) * E / R) (cupyep's expert
    ownership), i.e. ``w1[r * E_local:(r + 1) * E_local]``.
    """
    router: np.ndarray
    w1: np.ndarray
    w2: np.ndarray

    @property
    def hidden(self) -> int:
        return int(self.router.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.router.shape[1])

    @property
    def ffn(self) -> int:
        return int(self.w1.shape[2])

    @classmethod
    def random(cls, seed: int, hidden: int, ffn: int, num_experts: int) -> "MoEWeights":
        """Seeded weights, the same on every rank (NumPy RNG, no communication).

        Normal entries scaled by 1 / sqrt(fan-in) (so activations stay O(1)),
        rounded to BF16 values; router entries too. Each matrix comes from its
        own stream ``default_rng([seed, stream, expert])``, so it depends only
        on the seed, its expert and the sizes.
        """
        if min(hidden, ffn, num_experts) <= 0:
            raise ValueError(f"hidden, ffn and num_experts must be positive, got {hidden}, {ffn}, {num_experts}")

        def normal(stream, expert, shape, fan_in):
            z = np.random.default_rng([seed, stream, expert]).standard_normal(shape, dtype=np.float32)
            return _bf16_values(z * np.float32(1.0 / np.sqrt(fan_in)))

        router = normal(_ROUTER_STREAM, 0, (hidden, num_experts), hidden)
        w1 = np.empty((num_experts, hidden, ffn), dtype=np.float32)
        w2 = np.empty((num_experts, ffn, hidden), dtype=np.float32)
        for e in range(num_experts):
            w1[e] = normal(_W1_STREAM, e, (hidden, ffn), hidden)
            w2[e] = normal(_W2_STREAM, e, (ffn, hidden), ffn)
        return cls(router, w1, w2)

    def physical(self, placement, layer: int = 0) -> "MoEWeights":
        """The weights of a placement's physical experts (cupyep.balance.Placement):
        w1 [P, H, F] and w2 [P, F, H], physical expert p a copy of logical
        expert phy2log[layer, p]; the router stays logical ([H, E])."""
        if placement.num_logical != self.num_experts:
            raise ValueError(f"the placement is of {placement.num_logical} experts, the weights of {self.num_experts}")
        xp = _xp(self.w1)
        phy2log = xp.asarray(placement.phy2log[layer])
        return MoEWeights(self.router, self.w1[phy2log], self.w2[phy2log])

    def local(self, rank: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
        """(w1, w2) of rank ``rank``'s E / R experts: [E_local, H, F], [E_local, F, H]
        (E: the experts w1 holds, physical ones after :meth:`physical`)."""
        E = int(self.w1.shape[0])
        if E % num_ranks:
            raise ValueError(f"{E} experts are not divisible by {num_ranks} ranks")
        n = E // num_ranks
        return self.w1[rank * n:(rank + 1) * n], self.w2[rank * n:(rank + 1) * n]


# ------------------------------------------------------------------- routing

def route(x_f32, router, k: int):
    """Top-k routing: softmax over the logits, the k largest, renormalised.

    Arguments:
        x_f32: [T, H] float32 (NumPy or CuPy; MoELayer passes the BF16 values).
        router: [H, E] float32 (same array module, or NumPy: it is converted).
        k: 1 <= k <= E.

    Returns:
        (topk_idx [T, k] int64, topk_weights [T, k] float32), slots by
        decreasing logit. Weights: the softmax over all E logits, restricted
        to the k chosen experts and renormalised to sum to 1 over them (the
        same as a softmax over the k chosen logits; Mixtral-style). The
        logits are computed in float64 (a product of two float32 values is
        exact there), so the choice does not depend on how a matmul orders its
        sums: every rank and the single-process reference pick the same
        experts. Ties: the lower expert id first (deterministic, no reliance
        on a sort's stability).
    """
    xp = _xp(x_f32)
    if x_f32.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x_f32.shape)}")
    T, H = x_f32.shape
    router = xp.asarray(router)
    if router.ndim != 2 or router.shape[0] != H:
        raise ValueError(f"router must be [H={H}, E], got shape {tuple(router.shape)}")
    E = router.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"k must be in [1, E={E}], got {k}")
    if T == 0:
        return xp.zeros((0, k), dtype=xp.int64), xp.zeros((0, k), dtype=xp.float32)
    logits = x_f32.astype(xp.float64) @ router.astype(xp.float64)  # [T, E]
    # Rank of each expert in its token's order: larger logit first, then lower id.
    # Ranks are a permutation of 0..E-1 per token, so any argsort of them agrees.
    idx = xp.empty((T, k), dtype=xp.int64)
    ids = xp.arange(E)
    step = max(1, (1 << 24) // (E * E))  # tokens per chunk of the [t, E, E] comparison
    for b in range(0, T, step):
        l = logits[b:b + step]
        ahead, level = l[:, None, :] > l[:, :, None], l[:, None, :] == l[:, :, None]  # [t, e, e']: e' vs e
        beats = ahead | (level & (ids[None, :] < ids[:, None])[None])
        rank = beats.sum(axis=2)  # [t, E]: experts ahead of each expert
        idx[b:b + step] = xp.argsort(rank, axis=1)[:, :k]
    chosen = xp.take_along_axis(logits, idx, axis=1)
    p = xp.exp(chosen - chosen[:, :1])  # slot 0 holds the largest logit
    weights = (p / p.sum(axis=1, keepdims=True)).astype(xp.float32)
    return idx, weights


# --------------------------------------------------------------------- experts

def _silu(z):
    """[...] float32 -> z / (1 + exp(-z)), float32 (one kernel on CuPy)."""
    xp = _xp(z)
    if xp is not np:
        return _elementwise("silu")(z)
    return z / (xp.float32(1) + xp.exp(-z))


def expert_ffn(expert_x, blocks, w1, w2, out=None):
    """The per-expert FFN over expert-major rows (NumPy or CuPy).

    Arguments:
        expert_x: [M, H] uint16 BF16 bits in per-expert blocks.
        blocks: E_local (first row, pair count) host int pairs: expert e's rows
            are [first, first + count); the rows after them in its block
            (alignment padding) are skipped.
        w1: [E_local, H, F] float32; w2: [E_local, F, H] float32.
        out: [M, H] uint16 to write, or None (a zeroed array).

    Returns:
        [M, H] uint16: row m of expert e = BF16(silu(x_m @ w1[e]) @ w2[e]),
        both matmuls float32 on the BF16 values; rows outside every
        [first, first + count) left as they were (zero in a fresh array).
    """
    xp = _xp(expert_x)
    M, H = expert_x.shape
    y = xp.zeros((M, H), dtype=xp.uint16) if out is None else out
    if len(blocks) != w1.shape[0]:
        raise ValueError(f"{len(blocks)} expert blocks for {w1.shape[0]} local experts")
    for e, (first, count) in enumerate(blocks):
        if count:
            rows = slice(int(first), int(first) + int(count))
            h = _silu(bf16_bits_to_f32(expert_x[rows]) @ w1[e])
            if xp is np:
                y[rows] = f32_to_bf16_bits(h @ w2[e])
            else:  # written in place: no temporary [count, H] array
                f32_to_bf16_bits(h @ w2[e], y[rows])
    return y


def padded_expert_ffn(x, w1, w2):
    """The per-expert FFN over padded expert blocks, one batched matmul for all
    experts per projection (NumPy or CuPy): a few launches in all, where
    :func:`expert_ffn` makes five per expert.

    Arguments:
        x: [E_local, M, H] uint16 BF16 bits, expert e's rows in x[e] (rows past
            its count are padding: computed like the rest, for the caller to
            drop).
        w1: [E_local, H, F] float32; w2: [E_local, F, H] float32.

    Returns:
        [E_local, M, H] uint16: row m of expert e = BF16(silu(x[e, m] @ w1[e]) @
        w2[e]), both matmuls float32 on the BF16 values (expert_ffn's
        arithmetic; the matmuls may sum in another order).
    """
    xp = _xp(x)
    if x.ndim != 3 or w1.ndim != 3 or w2.ndim != 3 or not (x.shape[0] == w1.shape[0] == w2.shape[0]) or \
            w1.shape[1] != x.shape[2] or w2.shape[1] != w1.shape[2] or w2.shape[2] != x.shape[2]:
        raise ValueError(f"padded_expert_ffn needs x [E, M, H], w1 [E, H, F], w2 [E, F, H]; got {x.shape}, "
                         f"{w1.shape}, {w2.shape}")
    h = _silu(xp.matmul(bf16_bits_to_f32(x), w1))
    return f32_to_bf16_bits(xp.matmul(h, w2))


def expert_blocks(aligned_counts, counts) -> list[tuple[int, int]]:
    """(first row, pair count) of each local expert's expert-major block.

    Arguments:
        aligned_counts: E_local host ints, the block sizes
            (DispatchResult.num_recv_tokens_per_expert, aligned).
        counts: E_local host ints, the pairs in each block before alignment
            (DispatchHandle.recv_expert_counts).
    """
    aligned = [int(a) for a in aligned_counts]
    counts = [int(c) for c in counts]
    if len(aligned) != len(counts) or any(not 0 <= c <= a for c, a in zip(counts, aligned)):
        raise ValueError(f"pair counts {counts} do not fit the blocks {aligned}")
    firsts = np.concatenate([[0], np.cumsum(aligned)[:-1]]).astype(np.int64) if aligned else []
    return [(int(f), c) for f, c in zip(firsts, counts)]


def result_blocks(out) -> list[tuple[int, int]]:
    """Each local expert's (first row, pair count) in a DispatchResult's
    expert_x, on the host: from the dispatch's host counts
    (num_recv_tokens_per_expert and handle.recv_expert_counts: no sync), else
    read back from expert_offsets and expert_src_row (one sync; worst-token
    results, whose counts never reach the host)."""
    if out.num_recv_tokens_per_expert is not None and out.handle.recv_expert_counts is not None:
        return expert_blocks(out.num_recv_tokens_per_expert, out.handle.recv_expert_counts)
    offsets = to_host(out.expert_offsets)
    src = to_host(out.expert_src_row[:int(offsets[-1])])
    return [(int(offsets[e]), int((src[offsets[e]:offsets[e + 1]] >= 0).sum())) for e in range(offsets.size - 1)]


def _marker(events):
    """A function recording a CUDA event under a name into ``events`` (a
    dict), or doing nothing when ``events`` is None."""
    if events is None:
        return lambda name: None

    def mark(name):
        import cupy
        events[name] = ev = cupy.cuda.Event()
        ev.record()
    return mark


# ----------------------------------------------------------------------- layer

class MoELayer:
    """One expert-parallel MoE layer over a :class:`cupyep.Buffer`.

    Arguments:
        buffer: the cupyep.Buffer (normal mode) of this rank.
        weights: MoEWeights for all experts (the same on every rank); the
            layer copies its rank's E / R experts and the router to the GPU.
        num_topk: k.
        transport: "queue" or "direct" (Buffer.dispatch's transport).
        expert_alignment: rows of each expert block are a multiple of this
            (Buffer.dispatch's expert_alignment; 128 suits grouped GEMMs).
        placement: a cupyep.balance.Placement of one layer over the R ranks,
            or None (expert e on rank e // (E / R)): each rank holds its P / R
            physical experts' weights, and each token's slot goes to the
            replica ``rule`` picks (cupyep.balance.physical_topk).
        rule: "round_robin" or "nearest".
        compute_stream: a CuPy stream for the experts' FFN (e.g. the rank's
            own share of the SMs, cupyep.sm_partition.compute_stream, which
            needs, within a node, a buffer whose kernels run on the
            partition too: ``Buffer(on_partition=True)``), or None: the
            current stream. It waits for the dispatch, and the combine waits
            for it.
        zero_copy: combine without the push pass: the reduce of each
            received row's expert outputs goes straight into the dispatch
            slot's zero-copy buffer and the tokens' owners read it there
            (``Buffer.combine(..., zero_copy=True)``; the same result,
            bitwise). None (default): where the route has it, the direct
            transport within a node; True elsewhere is a ValueError.
        dispatch_config, combine_config: the route's configs of the layer's
            dispatch and combine (Buffer.dispatch / Buffer.combine ``config``),
            or None for the defaults. On the direct transport a
            ``DirectConfig(num_sms=4)`` for both leaves the FFN the rest of
            the GPU and moves the rows by bulk copies; with two micro-batches
            overlapped at 8 ranks it hid more of the communication than the
            default blocks (results/moe_overlap).

    Collective: every rank calls :meth:`forward` in the same order.
    """

    def __init__(self, buffer, weights: MoEWeights, num_topk: int, transport: str = "queue",
                 expert_alignment: int = 128, placement=None, rule: str = "round_robin", compute_stream=None,
                 zero_copy: bool | None = None, dispatch_config=None, combine_config=None):
        R, me = buffer.num_ranks, buffer.rank
        if transport not in ("queue", "direct"):
            raise ValueError(f"transport must be 'queue' or 'direct', got {transport!r}")
        has_zero_copy = buffer.routes[transport].zero_copy
        if zero_copy and not has_zero_copy:
            raise ValueError("zero_copy=True needs the direct transport within a node (the route with a zero-copy "
                             "combine)")
        self.zero_copy = has_zero_copy if zero_copy is None else bool(zero_copy)
        if not 1 <= num_topk <= weights.num_experts:
            raise ValueError(f"num_topk must be in [1, {weights.num_experts}], got {num_topk}")
        self.placement, self.rule = _check_placement(placement, rule, R), rule
        if placement is not None:
            weights = weights.physical(placement)
        if weights.w1.shape[0] % R:
            raise ValueError(f"{weights.w1.shape[0]} experts are not divisible by {R} ranks")
        self.buffer, self.num_topk = buffer, int(num_topk)
        self.dispatch_config, self.combine_config = dispatch_config, combine_config
        self.transport, self.expert_alignment = transport, int(expert_alignment)
        self.num_experts, self.hidden = int(weights.w1.shape[0]), weights.hidden  # physical experts
        self.num_local_experts = self.num_experts // R
        w1, w2 = weights.local(me, R)
        self._store = self._next = None  # the weights' registered copy and the placement a migration moves to
        if compute_stream is not None and buffer.group.ranks_per_gpu > 1 and not buffer.on_partition and \
                not buffer.internode and sm_partition.is_partition_stream(compute_stream):
            raise ValueError("compute_stream is an SM partition's, and the buffer's communication kernels run on the "
                             "full GPU: other ranks' kernels there can hold every SM of the partition while they wait "
                             "for this rank's experts. Make the buffer with cupyep.Buffer(..., on_partition=True)")
        self.compute_stream = compute_stream
        self.router = self._to_device(weights.router)  # [H, E] float32
        self.w1 = self._to_device(w1)                  # [E_local, H, F] float32
        self.w2 = self._to_device(w2)                  # [E_local, F, H] float32

    def forward(self, x, topk_idx=None, topk_weights=None, events=None):
        """The layer's output for this rank's tokens.

        Arguments:
            x: [T, H] uint16 BF16 bits (CuPy; T may be 0).
            topk_idx, topk_weights: a routing of these tokens to use instead
                of the router's: [T, k] int64 logical expert ids (-1: none)
                and [T, k] float32, both or neither. They are not checked
                (``Buffer.dispatch(validate=False)``): ids must lie in
                [-1, E_logical).
            events: a dict to receive a CUDA event (on the current stream) at
                each phase's start, for timing: "route", "dispatch", "ffn",
                "combine", "end"; or None.

        Returns:
            [T, H] uint16 BF16 bits (CuPy): for each token, the float32 sum over
            its k experts of weight * expert output, rounded to BF16 (with the
            per-rank partial rounding described in the module docstring).
        """
        x = self._input(x)
        if x.shape[1] != self.hidden:
            raise ValueError(f"x has hidden size {x.shape[1]}, the weights {self.hidden}")
        mark = _marker(events)
        mark("route")
        if topk_idx is None and topk_weights is None:
            topk_idx, topk_weights = route(bf16_bits_to_f32(x), self.router, self.num_topk)
        elif topk_idx is None or topk_weights is None:
            raise ValueError("topk_idx and topk_weights come together")
        elif tuple(topk_idx.shape) != (x.shape[0], self.num_topk) or topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_idx and topk_weights must be [{x.shape[0]}, {self.num_topk}], got "
                             f"{list(topk_idx.shape)} and {list(topk_weights.shape)}")
        if self.placement is not None:  # each slot to one replica of its expert
            from .balance import physical_topk
            topk_idx = physical_topk(topk_idx, self.placement, self.buffer.rank, self.rule)
        mark("dispatch")
        out = self.buffer.dispatch(x, topk_idx, topk_weights, num_experts=self.num_experts, expert_major=True,
                                   expert_alignment=self.expert_alignment, transport=self.transport,
                                   config=self.dispatch_config,
                                   validate=False)  # route gives ids in [0, E): skip the host check's sync
        mark("ffn")
        y = self._ffn(out)
        mark("combine")
        combined = self.buffer.combine(y, out.handle, pair_weights=out.recv_topk_weights, expert_major=True,
                                       config=self.combine_config,
                                       **({"zero_copy": True} if self.zero_copy else {})).combined_x
        mark("end")
        return combined

    __call__ = forward

    def _ffn(self, out):
        """The experts over a dispatch result's blocks, on the compute stream
        when there is one (ordered after the current stream, and it after)."""
        blocks = result_blocks(out)
        if self.compute_stream is None:
            return expert_ffn(out.expert_x, blocks, self.w1, self.w2)
        import cupy
        current = cupy.cuda.get_current_stream()
        self.compute_stream.wait_event(current.record())
        with self.compute_stream:
            y = expert_ffn(out.expert_x, blocks, self.w1, self.w2)
        current.wait_event(self.compute_stream.record())
        return y

    # ------------------------------------------------------------- migration
    def start_migration(self, placement) -> dict:
        """Collective: begin moving this layer's experts to ``placement`` (one
        layer, the same numbers of physical experts and ranks; the current one
        is the identity without a placement). The experts each rank gains are
        pulled from their holders (peer mappings within a node, NVSHMEM gets
        across nodes) on a side stream (cupyep.balance.store) while forward
        keeps using the current weights; :meth:`finish_migration` commits
        them. The first migration moves the layer's weights into registered
        memory (:meth:`prepare_migration`) unless that was done before.

        Returns {"moves": the Move list, "received": experts this rank pulls}."""
        from .balance import Placement, align, plan_moves
        R = self.buffer.num_ranks
        if self._next is not None:
            raise ValueError("a migration is in progress: finish_migration first")
        old = self.placement or Placement.identity(1, self.num_experts, R)
        new = align(old, _check_placement(placement, self.rule, R))
        self.prepare_migration()
        moves = plan_moves(old, new)
        self._store.start_migration(moves)
        self._next = new
        return {"moves": moves, "received": sum(m.dst_rank == self.buffer.rank for m in moves)}

    def prepare_migration(self) -> None:
        """Collective: move this layer's weights into registered memory that
        peers can pull from (cupyep.balance.store.ExpertStore), once; later
        calls do nothing. A migration's first step otherwise pays for it
        (registration and a copy of the weights)."""
        if self._store is not None:
            return
        from .balance.store import ExpertStore
        H, F = self.w1.shape[1], self.w1.shape[2]
        self._store = ExpertStore(self.buffer.group, self.num_local_experts,
                                  {"w1": ((H, F), np.float32), "w2": ((F, H), np.float32)})
        self._store.load({"w1": self.w1, "w2": self.w2})
        self.w1, self.w2 = self._store.arrays["w1"], self._store.arrays["w2"]

    def finish_migration(self) -> int:
        """Collective: commit a migration (bounded waits); later forwards route
        by the new placement. Returns the experts this rank received."""
        if self._next is None:
            raise ValueError("no migration to finish: start_migration first")
        got = self._store.finish_migration()
        self.placement, self._next = self._next, None
        return got

    def destroy(self) -> None:
        """Collective, once migrations were made: free the weights' registered
        memory (the layer cannot run afterwards). Nothing to do otherwise."""
        if self._store is not None:
            if self._next is not None:
                raise ValueError("a migration is in progress: finish_migration first")
            self._store.destroy()
            self._store = None
            self.w1 = self.w2 = None

    # Where arrays live: the GPU (a CPU test overrides these to run the layer
    # over a NumPy stand-in for the Buffer).
    @staticmethod
    def _to_device(a):
        import cupy
        return cupy.asarray(a, dtype=np.float32)

    @staticmethod
    def _input(x):
        from .arrays import BF16, as_cupy, check
        return check(as_cupy(x, "x"), "x", BF16, ndim=2)


# ------------------------------------------------------------------- reference

def _check_placement(placement, rule: str, num_ranks: int):
    """The placement of a layer on ``num_ranks`` ranks (or None), checked."""
    if placement is None:
        return None
    from .balance import REPLICA_RULES
    if rule not in REPLICA_RULES:
        raise ValueError(f"rule must be one of {REPLICA_RULES}, got {rule!r}")
    if placement.num_layers != 1:
        raise ValueError(f"a layer takes the placement of one layer (Placement.layer(i)), got {placement.num_layers}")
    if placement.num_gpus != num_ranks:
        raise ValueError(f"the placement is for {placement.num_gpus} GPUs, the buffer has {num_ranks} ranks")
    return placement


def reference_forward(x_all, weights: MoEWeights, num_topk: int, num_ranks: int | None = None, placement=None,
                      rule: str = "round_robin", tokens_per_rank=None, topk_idx=None, topk_weights=None):
    """The same MoE layer in one process, for the tokens of all ranks.

    Arguments:
        x_all: [T_all, H] uint16 BF16 bits, the ranks' tokens concatenated in
            rank order (CuPy input computes on the GPU, NumPy on the CPU).
        weights: MoEWeights (all experts).
        num_topk: k.
        num_ranks: None: the plain layer, out[t] = BF16(sum over slots j, in
            slot order, in float32, of w_j * y_j) with y_j =
            BF16(silu(x_t @ w1[e_j]) @ w2[e_j]). R: round where the
            distributed path on R ranks does: each rank's slots (experts
            [r E/R, (r+1) E/R)) summed in float32 in slot order and rounded to
            BF16, the partials summed in float32 in rank order, then BF16.
        placement, rule: a cupyep.balance.Placement of one layer and its replica
            rule, as MoELayer's (needs num_ranks and ``tokens_per_rank``, the
            ranks' token counts in order): each slot is summed on the rank of
            the replica it takes. The experts' outputs are the logical
            experts', so only the rounding of the per-rank partials moves.

    Returns:
        [T_all, H] uint16 BF16 bits (same array module as x_all).
    """
    xp = _xp(x_all)
    T, H = x_all.shape
    E, k = weights.num_experts, int(num_topk)
    if num_ranks is not None and placement is None and E % num_ranks:
        raise ValueError(f"{E} experts are not divisible by {num_ranks} ranks")
    x = bf16_bits_to_f32(x_all)
    if topk_idx is None:
        idx, w = route(x, xp.asarray(weights.router), k)
    else:
        idx, w = xp.asarray(topk_idx, dtype=xp.int64), xp.asarray(topk_weights, dtype=xp.float32)
    y = xp.zeros((T, k, H), dtype=xp.float32)  # expert output of each (token, slot), BF16 values
    idx_host = idx.get() if xp is not np else idx
    for e in range(E):
        t, j = np.nonzero(idx_host == e)
        if t.size:
            t, j = xp.asarray(t), xp.asarray(j)
            h = _silu(x[t] @ xp.asarray(weights.w1[e]))
            y[t, j] = _bf16_values(h @ xp.asarray(weights.w2[e]))
    contrib = w[:, :, None] * y  # [T, k, H] float32
    owner = idx // (E // num_ranks) if num_ranks is not None and placement is None else None
    if placement is not None:
        from .balance import physical_topk
        _check_placement(placement, rule, num_ranks)
        if tokens_per_rank is None or sum(tokens_per_rank) != T:
            raise ValueError(f"a placement needs tokens_per_rank, the ranks' token counts summing to {T}")
        starts = np.concatenate([[0], np.cumsum(tokens_per_rank)]).astype(int)
        phys = xp.concatenate([physical_topk(idx[starts[r]:starts[r + 1]], placement, r, rule)
                               for r in range(num_ranks)]) if T else idx
        owner = phys // placement.experts_per_gpu
    if num_ranks is None:
        acc = xp.zeros((T, H), dtype=xp.float32)
        for j in range(k):
            acc += contrib[:, j]
        return f32_to_bf16_bits(acc)
    acc = xp.zeros((T, H), dtype=xp.float32)
    for r in range(num_ranks):
        part = xp.zeros((T, H), dtype=xp.float32)
        for j in range(k):
            part += xp.where((owner[:, j] == r)[:, None], contrib[:, j], xp.float32(0))
        acc += _bf16_values(part)
    return f32_to_bf16_bits(acc)


def agreement(got, want) -> tuple[float, float]:
    """How close two layer outputs are: (calc_diff, worst token's relative error).

    Arguments:
        got, want: [T, H] uint16 BF16 bits (NumPy, or CuPy: copied to the host).

    Returns:
        (cupyep.reference.calc_diff of the values, the largest over tokens of
        ||got_t - want_t|| / ||want_t||; 0.0 for no tokens). calc_diff averages
        over all tokens, so one token with a wrong slot can stay under its
        bound; the per-token figure catches it (a rounding difference moves it
        by at most a few BF16 ulps, 2**-8 relative).
    """
    from .reference import calc_diff
    g, w = bf16_bits_to_f32(to_host(got)), bf16_bits_to_f32(to_host(want))
    if g.shape != w.shape:
        raise ValueError(f"outputs differ in shape: {g.shape} and {w.shape}")
    if not g.size:
        return 0.0, 0.0
    num = np.linalg.norm((g.astype(np.float64) - w), axis=1)
    den = np.linalg.norm(w.astype(np.float64), axis=1)
    rel = np.where(num == 0, 0.0, num / np.maximum(den, 1e-30))
    return float(calc_diff(g, w)), float(rel.max())
