"""Dispatch and combine of four ranks on the NumPy reference, on any machine.

    python examples/cpu_reference.py

The reference computes every rank at once; it is the oracle the GPU tests
compare each rank's results with.
"""
import numpy as np
from cupyep import reference as ref


R, E, k, T, H = 4, 16, 2, 8, 256                         # ranks, experts, top-k, tokens per rank, hidden
idx = ref.make_routing(0, [T] * R, E, k)                 # per rank: [T, k] int64 expert ids, -1 for none
w = ref.make_weights(0, idx)                             # per rank: [T, k] float32
x = [ref.make_tagged_x(r, T, H) for r in range(R)]       # per rank: [T, H], tagged by rank and token
res = ref.intranode_dispatch(x, idx, E, topk_weights=w)  # per rank: the rows it receives, by source rank
y = [2 * r.recv_x for r in res]                          # the experts (here: double every row)
out = ref.intranode_combine(y, res, [T] * R)             # per rank: [T, H], summed over the ranks visited
visits = [ref.get_dispatch_layout(i, E, R).is_token_in_rank.sum(1) for i in idx]
assert all(np.allclose(o, 2 * xi * v[:, None]) for o, xi, v in zip(out, x, visits))
print("reference dispatch and combine of", R, "ranks: ok")
