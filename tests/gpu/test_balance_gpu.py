"""Moving experts to a new placement on the GPU (cupyep.balance.store and
MoELayer's migration), within a node and across (emulated) nodes: the
weights arrive bit-exact, the layer computes with the old weights until the
commit, and after it the layer is the logical layer under the new placement.

    python3 -m cupyep.launcher.gpu_tests --ranks 2 4 8 -k balance
    python3 -m cupyep.launcher.gpu_tests --ranks 8 --ranks-per-node 4 -k balance
"""
import numpy as np
import pytest

from cupyep import moe

from cupyep.testing import all_ranks, f32_to_bf16

pytestmark = pytest.mark.gpu
E, H, F, K, T = 32, 512, 256, 4, 128


def _tag(logical, shape):
    """The weights of logical expert e: every element e + 0.25 * its index mod 8 (exact in float32)."""
    n = int(np.prod(shape))
    return (logical + 0.25 * (np.arange(n) % 8)).astype(np.float32).reshape(shape)


def test_an_expert_store_moves_experts_bit_exact_while_compute_reads_the_old_ones(group):
    import cupy

    from cupyep.balance import align, plan_moves, rebalance_experts
    from cupyep.balance.store import ExpertStore
    R, me = group.world_size, group.rank  # placement GPUs: every rank (across nodes the store gets by NVSHMEM)
    P = E + 2 * R
    rng = np.random.default_rng(11)
    old = rebalance_experts(rng.zipf(1.6, (1, E)).astype(float), P, 1, group.num_nodes, R).layer(0)
    new = align(old, rebalance_experts(rng.zipf(1.6, (1, E)).astype(float), P, 1, group.num_nodes, R).layer(0))
    n = P // R
    shapes = {"a": ((4, 64), np.float32), "b": ((3, 5), np.float32)}
    with ExpertStore(group, n, shapes) as store:
        mine = old.phy2log[0, me * n:(me + 1) * n]
        store.load({name: cupy.asarray(np.stack([_tag(e, s) for e in mine])) for name, (s, _) in shapes.items()})
        moves = plan_moves(old, new)
        store.start_migration(moves)
        during = store.arrays["a"][:, 0, 0].get()  # the current weights until the commit
        got = store.finish_migration()
        want = new.phy2log[0, me * n:(me + 1) * n]
        checks = {"old weights until commit": np.array_equal(during, mine.astype(np.float32)),
                  "received": got == sum(m.dst_rank == me and (m.src_rank, m.src_slot) != (m.dst_rank, m.dst_slot)
                                         for m in moves)}
        for name, (s, _) in shapes.items():
            checks[name] = np.array_equal(store.arrays[name].get(), np.stack([_tag(e, s) for e in want]))
        with pytest.raises(ValueError, match="no migration"):
            store.finish_migration()
    assert all_ranks(group.comm, all(checks.values())), {k: v for k, v in checks.items() if not v}


@pytest.mark.parametrize("transport", ["queue", "direct"])
def test_a_layer_migrated_to_a_new_placement_is_the_logical_layer_under_it(group, transport):
    import cupy

    import cupyep
    from cupyep.balance import rebalance_experts
    R, me = group.world_size, group.rank  # placement GPUs: every rank (across nodes the store gets by NVSHMEM)
    w = moe.MoEWeights.random(5, H, F, E)
    weights = moe.MoEWeights(cupy.asarray(w.router), cupy.asarray(w.w1), cupy.asarray(w.w2))
    cold = np.ones((1, E))
    hot = np.ones((1, E))
    hot[0, :4] = [30.0, 20.0, 10.0, 5.0]
    first = rebalance_experts(cold, E + 2 * R, 1, group.num_nodes, R).layer(0)
    second = rebalance_experts(hot, E + 2 * R, 1, group.num_nodes, R).layer(0)
    xs = [f32_to_bf16(np.random.default_rng([3, r]).standard_normal((T, H), dtype=np.float32)) for r in range(R)]
    x_all = cupy.asarray(np.concatenate(xs))
    with cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=K) as buf:
        layer = moe.MoELayer(buf, weights, K, transport=transport, expert_alignment=8, placement=first)
        before = layer.forward(cupy.asarray(xs[me])).get()
        info = layer.start_migration(second)
        during = layer.forward(cupy.asarray(xs[me])).get()  # still the first placement's weights and routing
        layer.finish_migration()
        after = layer.forward(cupy.asarray(xs[me])).get()
        with pytest.raises(ValueError, match="no migration"):
            layer.finish_migration()
    checks = {"during == before": np.array_equal(during, before), "moved": len(info["moves"]) > 0}
    for name, got, pl in (("before", before, first), ("after", after, layer.placement)):
        want = moe.reference_forward(x_all, weights, K, num_ranks=R, placement=pl, tokens_per_rank=[T] * R)
        d, worst = moe.agreement(got, want[me * T:(me + 1) * T].get())
        checks[name] = d < moe.MOE_CALC_DIFF_BOUND and worst < moe.MOE_TOKEN_BOUND
    assert all_ranks(group.comm, all(checks.values())), {"rank": me, **checks}


@pytest.mark.parametrize("rule", ["round_robin", "nearest"])
def test_low_latency_mode_with_replicated_experts_is_the_logical_routing(group, rule):
    """Low-latency dispatch of physical ids over P experts: each rank's
    experts scale their rows by a factor of the logical expert they copy, so
    the combine is the logical routing's (sum over slots of weight x factor
    of the logical expert x row) whichever replica each slot took."""
    import cupy

    import cupyep
    from cupyep.balance import physical_topk, rebalance_experts
    from cupyep.testing import bf16_to_f32, global_routing, payload_bf16
    R, me = group.world_size, group.rank
    Hl, T = 1024, 64
    load = np.ones((1, E))
    load[0, :2] = [25.0, 10.0]
    placement = rebalance_experts(load, E + 2 * R, 1, group.num_nodes, R).layer(0)
    P, n = placement.num_physical, placement.experts_per_gpu
    idx, w = global_routing(4, [T] * R, E, K)
    phys = physical_topk(idx[me], placement, me, rule)
    factor = (1.0 + np.arange(E) / 16.0).astype(np.float32)  # exact in BF16 products with the tagged rows' values
    x = cupy.asarray(payload_bf16(me, np.arange(T), Hl))
    with cupyep.LowLatencyBuffer(group, num_max_dispatch_tokens_per_rank=T, hidden=Hl, num_experts=P) as ll:
        d = ll.dispatch(x, cupy.asarray(phys), use_fp8=False)
        mine = cupy.asarray(factor[placement.phy2log[0, me * n:(me + 1) * n]])  # [n]: each local expert's factor
        y = (bf16_to_f32(d.recv_x.get()) * mine.get()[:, None, None]).astype(np.float32)
        from cupyep.moe import f32_to_bf16_bits
        out = ll.combine(cupy.asarray(f32_to_bf16_bits(y)), cupy.asarray(phys), cupy.asarray(w[me]), d.handle)
        got = bf16_to_f32(out.combined_x.get())
    valid = idx[me] >= 0
    scale = (w[me] * np.where(valid, factor[np.where(valid, idx[me], 0)], 0)).sum(axis=1, dtype=np.float64)
    want = bf16_to_f32(payload_bf16(me, np.arange(T), Hl)) * scale[:, None].astype(np.float32)
    from cupyep.reference import calc_diff
    d_ = calc_diff(got, want)
    assert all_ranks(group.comm, d_ < 1e-5 and not np.isnan(got).any()), {"rank": me, "calc_diff": d_}
