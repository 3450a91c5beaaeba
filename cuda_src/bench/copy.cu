// Plain device copy: the copy-bandwidth roofline every benchmark divides by.
#include "common/ptx.cuh"

namespace cupyep {

// Copies n int4 (16-byte) words with streaming loads and stores.
__global__ void copy_kernel(const int4* __restrict__ src, int4* __restrict__ dst, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        int4 a = ld_nc_na_v4(src + i), b = ld_nc_na_v4(src + i + stride);
        int4 c = ld_nc_na_v4(src + i + 2 * stride), d = ld_nc_na_v4(src + i + 3 * stride);
        st_na_v4(dst + i, a); st_na_v4(dst + i + stride, b);
        st_na_v4(dst + i + 2 * stride, c); st_na_v4(dst + i + 3 * stride, d);
    }
    for (; i < n; i += stride) st_na_v4(dst + i, ld_nc_na_v4(src + i));
}

}  // namespace cupyep
