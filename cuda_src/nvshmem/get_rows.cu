// Pulls of whole byte ranges from other PEs' symmetric buffers: what moves an
// expert's weights to a rank of another node (cupyep.balance.store).
//
// get_rows (grid: any number of blocks): block b takes items b, b + G, ...;
// item i copies items[i].bytes bytes from the symmetric address items[i].src
// on PE items[i].pe into items[i].dst here (any device memory), a blocking
// block-wide get: when the kernel ends every item has arrived.
#include <nvshmem.h>
#include <nvshmemx.h>

namespace cupyep {
namespace shmem {

struct GetItem {
    uint64_t dst;    // where the bytes land here
    uint64_t src;    // symmetric address on the holder
    int64_t bytes;
    int32_t pe;      // the holder
    int32_t pad;
};

struct GetRowsArgs {
    const GetItem* items;  // [num_items]
    int num_items;
};

__global__ void get_rows(GetRowsArgs a) {
    for (int i = blockIdx.x; i < a.num_items; i += gridDim.x) {
        const GetItem it = a.items[i];
        nvshmemx_getmem_block(reinterpret_cast<void*>(it.dst), reinterpret_cast<const void*>(it.src),
                              (size_t)it.bytes, it.pe);
    }
}

}  // namespace shmem
}  // namespace cupyep
