// abft.cu: the checksum and V-ABFT threshold of a product C = A·B computed
// by cuBLAS (A: M×K BF16, B: K×N BF16, C: M×N f32, all row-major), the
// device side of abft-gemm's VAbft::rows_with_checksums
// (crates/abft-gemm/src/threshold.rs):
//   expected_m = Σ_k A[m,k]·(Σ_n B[k,n]),   observed_m = Σ_n C[m,n]   (f64)
//   T_m = e_max·( N|μ_Am|·Σ|μ_Bk| + c·√(N·μ_Am²·Σσ_Bk² + N²·σ_Am²·Σμ_Bk²)
//                 + c·√N·σ_Am·√(Σσ_Bk²) )
// and row m is flagged unless |observed − expected| <= T_m (so NaN flags).

#define RKV_ABFT_THREADS 256

__device__ __forceinline__ float rkv_bf16(u16 h) { return rkv_bf2f(h); }

struct RkvRowStats {
    double sum, sumsq;
    float max, min;
};

__device__ __forceinline__ void rkv_stats_add(RkvRowStats& s, float x) {
    double d = (double)x;
    s.sum += d;
    s.sumsq += d * d;
    s.max = fmaxf(s.max, x);
    s.min = fminf(s.min, x);
}

// Block-wide reduction of the statistics (all threads get the result).
__device__ RkvRowStats rkv_stats_reduce(RkvRowStats s) {
    __shared__ double sh_sum[32], sh_sq[32];
    __shared__ float sh_max[32], sh_min[32];
    for (int off = 16; off > 0; off >>= 1) {
        s.sum += __shfl_xor_sync(0xffffffffu, s.sum, off);
        s.sumsq += __shfl_xor_sync(0xffffffffu, s.sumsq, off);
        s.max = fmaxf(s.max, __shfl_xor_sync(0xffffffffu, s.max, off));
        s.min = fminf(s.min, __shfl_xor_sync(0xffffffffu, s.min, off));
    }
    const u32 warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if ((threadIdx.x & 31u) == 0) {
        sh_sum[warp] = s.sum; sh_sq[warp] = s.sumsq; sh_max[warp] = s.max; sh_min[warp] = s.min;
    }
    __syncthreads();
    RkvRowStats r = {0.0, 0.0, __int_as_float(0xff800000u), __int_as_float(0x7f800000u)};
    for (u32 w = 0; w < warps; ++w) {
        r.sum += sh_sum[w]; r.sumsq += sh_sq[w];
        r.max = fmaxf(r.max, sh_max[w]); r.min = fminf(r.min, sh_min[w]);
    }
    __syncthreads();
    return r;
}

// abft-gemm's VarianceEstimator::sigma: 0 extreme value, 1 max/min bound, 2 exact.
__device__ __forceinline__ double rkv_sigma(const RkvRowStats& s, u32 n, u32 estimator) {
    const double mean = s.sum / (double)max(n, 1u);
    if (estimator == 0) return n < 2 ? 0.0 : ((double)s.max - mean) / sqrt(2.0 * log((double)n));
    if (estimator == 1) return sqrt(fmax(((double)s.max - mean) * (mean - (double)s.min), 0.0));
    return sqrt(fmax(s.sumsq / (double)max(n, 1u) - mean * mean, 0.0));
}

// One block per row k of B: its sum, and Σ|μ_Bk|, Σσ_Bk², Σμ_Bk² into bsums[0..3]
// (zeroed by the host).
extern "C" __global__ void abft_b_rows(const u16* __restrict__ b, u32 k_rows, u32 n,
                                       u32 estimator, double* __restrict__ row_sums,
                                       double* __restrict__ bsums) {
    const u32 k = blockIdx.x;
    if (k >= k_rows) return;
    RkvRowStats s = {0.0, 0.0, __int_as_float(0xff800000u), __int_as_float(0x7f800000u)};
    const u16* row = b + (u64)k * n;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) rkv_stats_add(s, rkv_bf16(row[j]));
    s = rkv_stats_reduce(s);
    if (threadIdx.x == 0) {
        const double mean = s.sum / (double)max(n, 1u), sigma = rkv_sigma(s, n, estimator);
        row_sums[k] = s.sum;
        atomicAdd(bsums + 0, fabs(mean));
        atomicAdd(bsums + 1, sigma * sigma);
        atomicAdd(bsums + 2, mean * mean);
    }
}

// One block per row m: expected and observed checksums, the V-ABFT bound,
// and the verdict; flagged rows are counted in *flagged.
extern "C" __global__ void abft_check_rows(const u16* __restrict__ a, const float* __restrict__ c,
                                           u32 m_rows, u32 k, u32 n,
                                           const double* __restrict__ row_sums,
                                           const double* __restrict__ bsums, double e_max,
                                           double coefficient, u32 estimator,
                                           double* __restrict__ residual,
                                           double* __restrict__ bound, u32* __restrict__ flags,
                                           u32* __restrict__ flagged) {
    const u32 m = blockIdx.x;
    if (m >= m_rows) return;
    RkvRowStats s = {0.0, 0.0, __int_as_float(0xff800000u), __int_as_float(0x7f800000u)};
    double expected = 0.0;
    const u16* arow = a + (u64)m * k;
    RkvRowStats obs = {0.0, 0.0, 0.0f, 0.0f};
    const float* crow = c + (u64)m * n;
    // A[m, j] = x: its statistics and its term of the expected checksum.
    auto take = [&](float x, u32 j) {
        rkv_stats_add(s, x);
        expected += (double)x * row_sums[j];
    };
    if ((k & 7u) == 0 && (n & 3u) == 0) {
        // 16-byte loads: eight BF16 values of A, four f32 values of C.
        for (u32 j = threadIdx.x; j < k / 8; j += blockDim.x) {
            const uint4 w = __ldg((const uint4*)arow + j);
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
            #pragma unroll
            for (u32 i = 0; i < 8; ++i)
                take(rkv_bf16((u16)(ws[i / 2] >> (16 * (i % 2)))), 8 * j + i);
        }
        for (u32 j = threadIdx.x; j < n / 4; j += blockDim.x) {
            const float4 x = __ldg((const float4*)crow + j);
            obs.sum += ((double)x.x + (double)x.y) + ((double)x.z + (double)x.w);
        }
    } else {
        for (u32 j = threadIdx.x; j < k; j += blockDim.x) take(rkv_bf16(arow[j]), j);
        for (u32 j = threadIdx.x; j < n; j += blockDim.x) obs.sum += (double)crow[j];
    }
    for (int off = 16; off > 0; off >>= 1) expected += __shfl_xor_sync(0xffffffffu, expected, off);
    __shared__ double sh_e[32];
    if ((threadIdx.x & 31u) == 0) sh_e[threadIdx.x / 32] = expected;
    s = rkv_stats_reduce(s);
    obs = rkv_stats_reduce(obs);
    if (threadIdx.x == 0) {
        double e = 0.0;
        for (u32 w = 0; w < blockDim.x / 32; ++w) e += sh_e[w];
        const double nn = (double)n, mu = s.sum / (double)max(k, 1u);
        const double sigma = rkv_sigma(s, k, estimator);
        const double t = e_max * (nn * fabs(mu) * bsums[0] +
                                  coefficient * sqrt(nn * mu * mu * bsums[1] +
                                                     nn * nn * sigma * sigma * bsums[2]) +
                                  coefficient * sqrt(nn) * sigma * sqrt(bsums[1]));
        const double r = fabs(obs.sum - e);
        residual[m] = r;
        bound[m] = t;
        const u32 bad = r <= t ? 0u : 1u;
        flags[m] = bad;
        if (bad) atomicAdd(flagged, 1u);
    }
}
