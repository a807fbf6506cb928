// common.cuh: types and helpers every kernel module shares. The host
// prepends this file to each module's source before compiling it (NVRTC has
// no file system), so it includes no headers: halves are converted with
// inline PTX and the integer types are spelled out.
//
// Numeric contract with the CPU crates: dequantisation uses __fmul_rn /
// __fadd_rn so the compiler cannot contract `b + level*a` into a fused
// multiply-add; kv-quant rounds the product and then the sum, and these
// values must be bit-identical to the CPU's.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define RKV_F16 0u
#define RKV_INT4 1u
#define RKV_SECDED 2u

#define RKV_NIBBLE_CORRECTED 0x40u
#define RKV_NIBBLE_DETECTED 0x80u

// Decode counters, in this order, as the host reads them back.
#define RKV_STAT_WORDS 0
#define RKV_STAT_CLEAN 1
#define RKV_STAT_CORRECTED 2
#define RKV_STAT_DETECTED 3
#define RKV_STATS 4

// Negative infinity without math.h (NVRTC has no system headers).
#define RKV_NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float rkv_h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float rkv_bf2f(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// A little-endian scale or offset of `bytes` (2: f16, 4: f32) at `p`.
__device__ __forceinline__ u32 rkv_load_word(const u8* p, u32 bytes) {
    if (bytes == 2) return (u32)p[0] | ((u32)p[1] << 8);
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ float rkv_word_to_float(u32 w, u32 bytes) {
    return bytes == 2 ? rkv_h2f((u16)w) : __uint_as_float(w);
}

// kv-quant's metadata SECDED (crates/kv-quant/src/meta.rs): `columns[i]` is
// the check byte of data bit i alone. Returns the corrected word and sets
// *outcome to 0 clean, 1 corrected, 2 detected.
__device__ __forceinline__ u32 rkv_meta_decode(u32 data, u8 check, const u8* columns,
                                               u32 width, u32 check_bits, u32* outcome) {
    u32 recomputed = 0;
    for (u32 i = 0; i < width; ++i)
        if ((data >> i) & 1u) recomputed ^= columns[i];
    u32 mask = (1u << check_bits) - 1u;
    u32 syndrome = ((u32)check ^ recomputed) & mask;
    if (syndrome == 0) { *outcome = 0; return data; }
    for (u32 i = 0; i < width; ++i) {
        if ((u32)columns[i] == syndrome) { *outcome = 1; return data ^ (1u << i); }
    }
    *outcome = (syndrome & (syndrome - 1u)) == 0 ? 1u : 2u;
    return data;
}

// kv-quant's dequantisation of one level (Kind::dequant), bit for bit.
__device__ __forceinline__ float rkv_dequant(u32 level, float a, float b, bool symmetric) {
    if (symmetric) return __fmul_rn((float)level - 8.0f, a);
    return __fadd_rn(b, __fmul_rn((float)level, a));
}

// kv-quant's interpolate() for distances dl, dr (0 = no neighbour found).
__device__ __forceinline__ float rkv_interpolate(u32 dl, float l, u32 dr, float r) {
    if (dl == 1 && dr == 1) return __fmul_rn(0.5f, __fadd_rn(l, r));
    if (dl != 0 && dr != 0) {
        float fl = (float)dl, fr = (float)dr;
        return __fdiv_rn(__fadd_rn(__fmul_rn(fr, l), __fmul_rn(fl, r)), __fadd_rn(fl, fr));
    }
    if (dl != 0) return l;
    if (dr != 0) return r;
    return 0.0f;
}

// Adds a block's counters to the global ones: warp sums by shuffles, then
// one atomic per warp and counter (zero counts skip their atomic).
__device__ __forceinline__ void rkv_add_stats(u64* global, const u32* counts, u32 n) {
    #pragma unroll
    for (u32 s = 0; s < n; ++s) {
        u32 v = counts[s];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if ((threadIdx.x & 31u) == 0 && v != 0) atomicAdd(global + s, (u64)v);
    }
}
