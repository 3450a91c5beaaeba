"""Normal mode, the MoE layer, replicated experts and low-latency mode on GPUs.

    python -m cupyep.launcher -n 8 examples/gpu_dispatch.py

One H200 holds 8 ranks under CUDA MPS (the launcher starts it); with several
GPUs the ranks spread over them. Without a GPU it exits with status 2 and
one line (examples/cpu_reference.py runs the same flow on the CPU).
"""
import sys
import cupy, numpy as np, cupyep
from cupyep.launcher.calls import env_rank
from cupyep.testing import global_routing, payload_bf16

if cupyep.runtime.gpu_count() == 0:        # before MPI starts, so every rank just exits
    if env_rank() in (0, -1):
        print("examples/gpu_dispatch.py needs a CUDA GPU; none found (examples/cpu_reference.py runs on the CPU)",
              file=sys.stderr)
    sys.exit(2)

group = cupyep.init()                      # mpi4py COMM_WORLD; device = local rank % GPUs
T, H, E = 4096, 7168, 256
idx, w = global_routing(0, [T] * group.world_size, E, 8)           # every rank's routing, seeded
x = cupy.asarray(payload_bf16(group.rank, np.arange(T), H))        # [T, H] BF16 bits (uint16)
topk_idx, topk_weights = cupy.asarray(idx[group.rank]), cupy.asarray(w[group.rank])

with cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=8) as buf:   # normal mode, any node count
    lay = buf.get_dispatch_layout(topk_idx, num_experts=E)
    out = buf.dispatch(x, topk_idx, topk_weights, num_experts=E,
                       num_tokens_per_rank=lay.num_tokens_per_rank,
                       num_tokens_per_expert=lay.num_tokens_per_expert,
                       is_token_in_rank=lay.is_token_in_rank)
    y = out.recv_x                          # the experts' outputs, one BF16 row per received row
    combined = buf.combine(y, out.handle).combined_x                  # [T, H]: summed over the ranks visited

    # The direct (one-copy) transport: senders write into the receivers' output, one of
    # num_in_flight (default 2) pool slots; a result read after its slot is reused raises
    # StaleResultError (fresh=True copies the rows out instead). Handles stay valid.
    out = buf.dispatch(x, topk_idx, topk_weights, num_experts=E, transport="direct")
    y = buf.get_combine_buffer(out.handle)  # the experts write their outputs here
    y[...] = out.recv_x
    combined = buf.combine(y, out.handle, zero_copy=True).combined_x

    # Grouped-GEMM layout: rows in per-expert blocks (aligned), and back.
    out = buf.dispatch(x, topk_idx, topk_weights, num_experts=E, expert_alignment=128, expert_major=True)
    y = out.expert_x                        # [M, H] BF16: a grouped GEMM over out.expert_offsets goes here
    combined = buf.combine(y, out.handle, pair_weights=out.recv_topk_weights).combined_x

# Low-latency (decode) mode: fixed slots, no notify pass, graph-capturable.
with cupyep.LowLatencyBuffer(group, num_max_dispatch_tokens_per_rank=128, hidden=H, num_experts=E) as ll:
    d = ll.dispatch(x[:128], topk_idx[:128], use_fp8=False)  # recv_x [E_local, R * 128, H] BF16
    combined = ll.combine(d.recv_x, topk_idx[:128], topk_weights[:128], d.handle).combined_x

# An MoE layer on the buffer (cupyep.moe).
weights = cupyep.MoEWeights.random(0, hidden=H, ffn=256, num_experts=E)    # the same on every rank
with cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=8) as buf:
    layer = cupyep.moe.MoELayer(buf, weights, num_topk=8, transport="direct")
    y = layer.forward(x)                    # [T, H] BF16: route, dispatch, experts, combine

# Load balance (cupyep.balance): replicas planned from the routing's loads.
from cupyep.balance import rebalance_experts, report
loads = np.bincount(np.concatenate(idx).ravel() + 1, minlength=E + 1)[None, 1:]   # [L = 1, E] tokens per expert
plan = rebalance_experts(loads, num_replicas=E + 4 * group.world_size, num_groups=8, num_nodes=group.num_nodes,
                         num_gpus=group.world_size)
print(report(loads, plan)["after"]["time_ratio"])   # the straggler's load over the mean, 1.0 is even
with cupyep.Buffer(group, max_tokens=T, hidden=H, num_topk=8) as buf:
    layer = cupyep.moe.MoELayer(buf, weights, num_topk=8, placement=plan.layer(0), rule="round_robin")
    y = layer.forward(x)                    # the logical layer's output; each slot went to one replica
if group.rank == 0:
    print("dispatch, combine, the MoE layer and low-latency mode ran on", group.world_size, "ranks")
