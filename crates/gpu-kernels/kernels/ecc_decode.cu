// ecc_decode.cu: batch decoders for INT4 values in gf2-codes' byte layouts
// (crates/gf2-codes/src/batch/mod.rs): Hamming(7,4) at eight codewords per
// 7 bytes, SECDED(8,4) at one byte per value, Golay(24,12) at three values
// per 3 bytes. Each writes one value per byte, sets bit i%32 of erasure
// word i/32 (the host zeroes the words; two little-endian u32 words are one
// u64 word of the CPU bitmap) for values in detected codewords, and adds
// per-codeword outcome counts to `stats` (words, clean, corrected,
// detected). Tables come from the host (src/tables.rs).

__device__ __forceinline__ void rkv_count(u32* c, u32 flags) {
    c[RKV_STAT_WORDS] += 1;
    if (flags & RKV_NIBBLE_DETECTED) c[RKV_STAT_DETECTED] += 1;
    else if (flags & RKV_NIBBLE_CORRECTED) c[RKV_STAT_CORRECTED] += 1;
    else c[RKV_STAT_CLEAN] += 1;
}

// One thread per 4 values (one 32-bit load), grid-stride.
extern "C" __global__ void secded84_decode(const u8* __restrict__ encoded, u32 n,
                                           const u8* __restrict__ table, u8* __restrict__ values,
                                           u32* __restrict__ erasures, u64* __restrict__ stats) {
    __shared__ u8 t[256];
    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) t[i] = table[i];
    __syncthreads();
    u32 c[RKV_STATS] = {0, 0, 0, 0};
    u32 quads = (n + 3) / 4;
    for (u32 q = blockIdx.x * blockDim.x + threadIdx.x; q < quads; q += gridDim.x * blockDim.x) {
        u32 base = 4 * q;
        u32 out = 0, erased = 0;
        if (base + 4 <= n) {
            u32 w = *(const u32*)(encoded + base);
            #pragma unroll
            for (u32 j = 0; j < 4; ++j) {
                u32 e = t[(w >> (8 * j)) & 0xffu];
                out |= (e & 15u) << (8 * j);
                if (e & RKV_NIBBLE_DETECTED) erased |= 1u << j;
                rkv_count(c, e);
            }
            *(u32*)(values + base) = out;
        } else {
            for (u32 j = 0; base + j < n; ++j) {
                u32 e = t[encoded[base + j]];
                values[base + j] = (u8)(e & 15u);
                if (e & RKV_NIBBLE_DETECTED) erased |= 1u << j;
                rkv_count(c, e);
            }
        }
        if (erased) atomicOr(erasures + base / 32, erased << (base % 32));
    }
    rkv_add_stats(stats, c, RKV_STATS);
}

// One thread per group of 8 codewords (7 bytes), grid-stride. A last partial
// group of m values uses ceil(7m/8) bytes.
extern "C" __global__ void hamming74_decode(const u8* __restrict__ encoded, u32 n,
                                            const u8* __restrict__ table, u8* __restrict__ values,
                                            u32* __restrict__ erasures, u64* __restrict__ stats) {
    __shared__ u8 t[128];
    for (u32 i = threadIdx.x; i < 128; i += blockDim.x) t[i] = table[i];
    __syncthreads();
    u32 c[RKV_STATS] = {0, 0, 0, 0};
    u32 groups = (n + 7) / 8;
    for (u32 g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += gridDim.x * blockDim.x) {
        u32 m = min(8u, n - 8 * g);
        u32 bytes = (7 * m + 7) / 8;
        u64 word = 0;
        for (u32 b = 0; b < bytes; ++b) word |= (u64)encoded[7 * g + b] << (8 * b);
        u32 erased = 0;
        for (u32 j = 0; j < m; ++j) {
            u32 e = t[(word >> (7 * j)) & 0x7fu];
            values[8 * g + j] = (u8)(e & 15u);
            if (e & RKV_NIBBLE_DETECTED) erased |= 1u << j;
            rkv_count(c, e);
        }
        // Hamming(7,4) is perfect and detects nothing, but keep the path exact.
        if (erased) atomicOr(erasures + (8 * g) / 32, erased << ((8 * g) % 32));
    }
    rkv_add_stats(stats, c, RKV_STATS);
}

// One thread per codeword (3 bytes, 3 values; a last partial triple was
// padded with zero values), grid-stride. `parity` and `leader` are the
// 4096-entry tables of src/tables.rs.
extern "C" __global__ void golay24_decode(const u8* __restrict__ encoded, u32 n,
                                          const u16* __restrict__ parity,
                                          const u32* __restrict__ leader, u8* __restrict__ values,
                                          u32* __restrict__ erasures, u64* __restrict__ stats) {
    u32 c[RKV_STATS] = {0, 0, 0, 0};
    u32 words = (n + 2) / 3;
    for (u32 w = blockIdx.x * blockDim.x + threadIdx.x; w < words; w += gridDim.x * blockDim.x) {
        const u8* p = encoded + 3 * w;
        u32 rx = (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16);
        u32 data = rx & 0xfffu;
        u32 syndrome = (u32)__ldg(parity + data) ^ (rx >> 12);
        u32 entry = __ldg(leader + syndrome);
        bool detected = (entry >> 25) & 1u;
        u32 fixed = detected ? data : (rx ^ entry) & 0xfffu;
        c[RKV_STAT_WORDS] += 1;
        if (detected) c[RKV_STAT_DETECTED] += 1;
        else if ((entry >> 24) & 1u) c[RKV_STAT_CORRECTED] += 1;
        else c[RKV_STAT_CLEAN] += 1;
        u32 m = min(3u, n - 3 * w);
        for (u32 j = 0; j < m; ++j) {
            u32 i = 3 * w + j;
            values[i] = (u8)((fixed >> (4 * j)) & 15u);
            if (detected) atomicOr(erasures + i / 32, 1u << (i % 32));
        }
    }
    rkv_add_stats(stats, c, RKV_STATS);
}
