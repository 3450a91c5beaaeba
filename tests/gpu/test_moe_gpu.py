"""The end-to-end MoE layer (cupyep.moe.MoELayer) on the GPU, against the
single-process CuPy layer (cupyep.moe.reference_forward).

Every rank builds the same seeded weights (H 2048, F 1024, 64 experts, top-8)
and every rank's tokens (256 per rank, BF16 normal values; one case with a
rank holding none), runs MoELayer.forward on its own tokens over each
transport, and compares its rows of reference_forward on all ranks' tokens
(on this rank's GPU): calc_diff < 5e-6 against the plain layer (one final
BF16 rounding) and against the layer rounded where the distributed path
rounds (a BF16 partial per (token, rank)), the worst token's relative error
below cupyep.moe.MOE_TOKEN_BOUND, no NaN. Forward is bitwise deterministic
and gives bitwise the same on both transports (same expert-major layout,
same reduce order).

    python3 -m cupyep.launcher.gpu_tests --ranks 2 4 8 -k moe
"""
import numpy as np
import pytest

from cupyep import moe

from cupyep.testing import all_ranks, bf16_to_f32, f32_to_bf16

pytestmark = pytest.mark.gpu
HIDDEN, FFN, NUM_EXPERTS, NUM_TOPK, NUM_TOKENS = 2048, 1024, 64, 8, 256
TRANSPORTS = ["queue", "direct"]


@pytest.fixture(scope="module")
def buf(group):
    import cupyep
    b = cupyep.Buffer(group)
    yield b
    b.destroy()


@pytest.fixture(scope="module")
def part_buf(group, buf):
    """A buffer whose kernels run on the rank's SM partition (the one its
    experts' FFN gets) where ranks share the GPU; else ``buf``."""
    import cupyep
    if group.ranks_per_gpu < 2 or group.num_nodes > 1:
        yield buf
        return
    b = cupyep.Buffer(group, on_partition=True)
    yield b
    b.destroy()


@pytest.fixture(scope="module")
def weights(group):
    """The layer's weights, the same on every rank (about 1 GiB), held on the
    GPU: the layers take their experts' slices and the reference reads all."""
    import cupy
    w = moe.MoEWeights.random(2026, HIDDEN, FFN, NUM_EXPERTS)
    dev = moe.MoEWeights(cupy.asarray(w.router), cupy.asarray(w.w1), cupy.asarray(w.w2))
    del w
    group.comm.Barrier()  # ranks finish generating at different times: start the collectives together
    return dev


@pytest.fixture(scope="module")
def layers(group, buf, weights):
    """One layer per transport, over the same buffer and weights (the direct transport's default combines
    zero-copy within a node; "direct push" is its pushing combine)."""
    out = {t: moe.MoELayer(buf, weights, NUM_TOPK, transport=t) for t in TRANSPORTS}
    out["direct push"] = moe.MoELayer(buf, weights, NUM_TOPK, transport="direct", zero_copy=False)
    if group.num_nodes == 1:  # 4 blocks per rank: the rows move by bulk copies
        from cupyep.normal.direct_kernels import DirectConfig
        few = DirectConfig(num_sms=4)
        out["direct 4 blocks"] = moe.MoELayer(buf, weights, NUM_TOPK, transport="direct", dispatch_config=few,
                                              combine_config=few)
    group.comm.Barrier()
    return out


def _tokens(seed, tokens):
    """Every rank's [T_r, H] BF16 bits (every rank builds all of them)."""
    return [f32_to_bf16(np.random.default_rng([seed, r]).standard_normal((t, HIDDEN), dtype=np.float32))
            for r, t in enumerate(tokens)]


CASES = [
    # (seed, rank with zero tokens, expert alignment)
    (1, None, 128),
    (2, 1, 128),
    (3, None, 1),
]


@pytest.mark.parametrize("seed,zero_rank,alignment", CASES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_moe_layer_matches_single_process_reference(group, buf, weights, layers, transport, seed, zero_rank,
                                                    alignment):
    import cupy
    R, me = group.local_size, group.local_rank
    tokens = [0 if r == zero_rank else NUM_TOKENS for r in range(R)]
    xs = _tokens(seed, tokens)
    layer = layers[transport] if alignment == 128 else \
        moe.MoELayer(buf, weights, NUM_TOPK, transport=transport, expert_alignment=alignment)
    group.comm.Barrier()
    got = layer.forward(cupy.asarray(xs[me]))
    shape_ok = got.shape == (tokens[me], HIDDEN) and got.dtype == np.uint16
    got = got.get()

    lo = sum(tokens[:me])
    x_all = cupy.asarray(np.concatenate(xs))
    plain = moe.reference_forward(x_all, weights, NUM_TOPK)[lo:lo + tokens[me]].get()
    mirrored = moe.reference_forward(x_all, weights, NUM_TOPK, num_ranks=R)[lo:lo + tokens[me]].get()
    d_plain, w_plain = moe.agreement(got, plain)
    d_mirror, w_mirror = moe.agreement(got, mirrored)
    ok = (shape_ok and not np.isnan(bf16_to_f32(got)).any() and (tokens[me] == 0 or bool(got.any()))
          and d_plain < moe.MOE_CALC_DIFF_BOUND and d_mirror < moe.MOE_CALC_DIFF_BOUND
          and w_plain < moe.MOE_TOKEN_BOUND and w_mirror < moe.MOE_TOKEN_BOUND)
    info = {"rank": me, "shape_ok": shape_ok, "calc_diff plain": d_plain, "calc_diff mirrored": d_mirror,
            "worst token plain": w_plain, "worst token mirrored": w_mirror}
    assert all_ranks(group.comm, ok), info
    buf.synchronize()
    group.comm.Barrier()


def test_moe_layer_is_deterministic_and_transport_independent(group, layers):
    import cupy
    me = group.local_rank
    x = cupy.asarray(_tokens(4, [NUM_TOKENS] * group.local_size)[me])
    group.comm.Barrier()
    runs = {t: [layers[t].forward(x).get() for _ in range(2)] for t in layers}
    same = {t: np.array_equal(a, b) for t, (a, b) in runs.items()}
    same["queue == direct"] = np.array_equal(runs["queue"][0], runs["direct"][0])
    same["direct == direct push"] = np.array_equal(runs["direct"][0], runs["direct push"][0])
    if "direct 4 blocks" in runs:
        same["direct == direct 4 blocks"] = np.array_equal(runs["direct"][0], runs["direct 4 blocks"][0])
    same["zero-copy where the route has it"] = layers["direct"].zero_copy == (group.num_nodes == 1)
    assert all_ranks(group.comm, all(same.values())), {k: v for k, v in same.items() if not v}
    group.comm.Barrier()


@pytest.mark.parametrize("rule", ["round_robin", "nearest"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_moe_layer_with_replicated_experts_is_the_logical_layer(group, buf, weights, transport, rule):
    """A placement planned from skewed loads (three hot experts, two extra
    replicas per rank): the layer dispatches physical ids over P experts and
    still returns the logical layer, against the reference with the same
    placement (the per-rank partials' rounding) and the plain one."""
    import cupy

    from cupyep.balance import rebalance_experts
    R, me = group.local_size, group.local_rank
    load = np.ones((1, NUM_EXPERTS))
    load[0, :3] = [40.0, 20.0, 10.0]
    placement = rebalance_experts(load, NUM_EXPERTS + 2 * R, 1, 1, R).layer(0)
    layer = moe.MoELayer(buf, weights, NUM_TOPK, transport=transport, placement=placement, rule=rule)
    tokens = [NUM_TOKENS] * R
    xs = _tokens(9, tokens)
    group.comm.Barrier()
    got = layer.forward(cupy.asarray(xs[me])).get()
    lo = me * NUM_TOKENS
    x_all = cupy.asarray(np.concatenate(xs))
    mirrored = moe.reference_forward(x_all, weights, NUM_TOPK, num_ranks=R, placement=placement, rule=rule,
                                     tokens_per_rank=tokens)[lo:lo + NUM_TOKENS].get()
    plain = moe.reference_forward(x_all, weights, NUM_TOPK)[lo:lo + NUM_TOKENS].get()
    d_mirror, w_mirror = moe.agreement(got, mirrored)
    d_plain, w_plain = moe.agreement(got, plain)
    ok = (layer.num_experts == placement.num_physical and not np.isnan(bf16_to_f32(got)).any()
          and d_mirror < moe.MOE_CALC_DIFF_BOUND and d_plain < moe.MOE_CALC_DIFF_BOUND
          and w_mirror < moe.MOE_TOKEN_BOUND and w_plain < moe.MOE_TOKEN_BOUND)
    assert all_ranks(group.comm, ok), {"rank": me, "calc_diff mirrored": d_mirror, "calc_diff plain": d_plain,
                                       "worst mirrored": w_mirror, "worst plain": w_plain}
    buf.synchronize()
    group.comm.Barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_layer_given_a_routing_runs_its_experts_on_the_rank_s_own_sms(group, part_buf, weights, transport):
    """forward(x, topk_idx, topk_weights) with a skewed seeded routing (half
    the tokens on one hot expert, 5 % empty slots) instead of the router's,
    its FFN on the rank's own share of the SMs (cupyep.sm_partition) where
    ranks share the GPU, beside a buffer on the same partition: the
    reference under that routing, every rank."""
    import cupy

    from cupyep import routing, sm_partition
    R, me = group.local_size, group.local_rank
    tokens = [NUM_TOKENS] * R
    idx, w = routing.make("hot_expert", 5, tokens, NUM_EXPERTS, NUM_TOPK, drop_fraction=0.05, hot_fraction=0.5)
    stream = sm_partition.partition_stream(group)[0] if part_buf.on_partition else None
    layer = moe.MoELayer(part_buf, weights, NUM_TOPK, transport=transport, compute_stream=stream)
    xs = _tokens(12, tokens)
    group.comm.Barrier()
    got = layer.forward(cupy.asarray(xs[me]), cupy.asarray(idx[me]), cupy.asarray(w[me])).get()
    group.check_errors()  # a kernel's timeout is raised here, not mistaken for a wrong row
    lo = me * NUM_TOKENS
    want = moe.reference_forward(cupy.asarray(np.concatenate(xs)), weights, NUM_TOPK, num_ranks=R,
                                 topk_idx=np.concatenate(idx), topk_weights=np.concatenate(w))[lo:lo + NUM_TOKENS]
    diff, worst = moe.agreement(got, want.get())
    ok = diff < moe.MOE_CALC_DIFF_BOUND and worst < moe.MOE_TOKEN_BOUND and not np.isnan(bf16_to_f32(got)).any()
    assert all_ranks(group.comm, ok), (diff, worst)
    group.comm.Barrier()


@pytest.mark.parametrize("partition", [False, True], ids=["one stream", "SM partition"])
def test_pool_memory_poisoned_with_nan_never_reaches_the_output(group, buf, part_buf, weights, partition):
    """The direct route's pools (dispatch slots, pushed partial rows,
    zero-copy rows) filled with 0xFF bytes before each forward: NaN as BF16
    and FP32, -1 as int32. Whatever the layer reads that no kernel of its
    own call wrote then shows in the output as NaN or as a wrong row.
    Three forwards, each after poisoning, with the skewed routing of the
    test above (half the tokens on one hot expert, 5 % empty slots), with
    the FFN on the rank's own SMs or on the full GPU: the reference, every
    rank."""
    import cupy

    from cupyep import routing, sm_partition
    if group.num_nodes > 1:
        pytest.skip("the direct route's pools are the route within a node")
    if partition and group.ranks_per_gpu < 2:
        pytest.skip("an SM partition needs ranks sharing a GPU")
    buf = part_buf if partition else buf
    R, me = group.local_size, group.local_rank
    tokens = [NUM_TOKENS] * R
    idx, w = routing.make("hot_expert", 5, tokens, NUM_EXPERTS, NUM_TOPK, drop_fraction=0.05, hot_fraction=0.5)
    stream = sm_partition.partition_stream(group)[0] if partition else None
    layer = moe.MoELayer(buf, weights, NUM_TOPK, transport="direct", compute_stream=stream)
    xs = _tokens(12, tokens)
    x, ids, ws = cupy.asarray(xs[me]), cupy.asarray(idx[me]), cupy.asarray(w[me])
    lo = me * NUM_TOKENS
    want = moe.reference_forward(cupy.asarray(np.concatenate(xs)), weights, NUM_TOPK, num_ranks=R,
                                 topk_idx=np.concatenate(idx), topk_weights=np.concatenate(w))[lo:lo + NUM_TOKENS]
    want = want.get()
    group.comm.Barrier()
    layer.forward(x, ids, ws)  # the pools are allocated by their first use
    pools = [p for p in buf.routes["direct"].pools.pools.values() if p is not None]
    for step in range(3):
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()  # no rank's kernel reads or writes a pool while it is poisoned
        for pool in pools:
            pool.view(0, (pool.nbytes,), np.uint8).fill(255)
        cupy.cuda.runtime.deviceSynchronize()
        group.comm.Barrier()
        got = layer.forward(x, ids, ws).get()
        group.check_errors()
        diff, worst = moe.agreement(got, want)
        nan = bool(np.isnan(bf16_to_f32(got)).any())
        ok = not nan and diff < moe.MOE_CALC_DIFF_BOUND and worst < moe.MOE_TOKEN_BOUND
        assert all_ranks(group.comm, ok), {"rank": me, "step": step, "nan": nan, "calc_diff": diff, "worst": worst}
    buf.synchronize()
    group.comm.Barrier()


def test_a_partition_stream_beside_a_buffer_on_the_full_gpu_is_refused(group, buf, weights):
    """An FFN on an SM partition beside communication kernels on the whole
    GPU can starve (the other ranks' waiting blocks hold the partition's
    SMs): MoELayer refuses the pair, naming the buffer's argument."""
    from cupyep import sm_partition
    if group.ranks_per_gpu < 2 or group.num_nodes > 1:
        pytest.skip("SM partitions are for ranks sharing a GPU")
    if buf.on_partition:
        pytest.skip("the launcher put this run's buffers on partitions (--sm-share)")
    stream = sm_partition.partition_stream(group)[0]
    with pytest.raises(ValueError, match="on_partition=True"):
        moe.MoELayer(buf, weights, NUM_TOPK, transport="direct", compute_stream=stream)
    group.comm.Barrier()
