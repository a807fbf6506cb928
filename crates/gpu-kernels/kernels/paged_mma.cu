// paged_mma.cu: the tensor-core kernels of fused paged decoding, part of
// the paged_decode module (compiled after paged_decode.cu, whose parameter
// block, metadata decoders, exact per-value decode and shape list they use).
//
// Tensor-core path (paged_mma_*): INT4 and SECDED INT4 whose groups cover
// whole heads (channels_per_group a multiple of HD), so one scale a_t and
// offset b_t hold for a token row of the head. Then
//   score[t][g] = a_t·dot(q'_g, L_t) + b_t·Σq'_g          (affine)
//   out[g]      = Σ_t (p_tg·a_t)·L_t + Σ_t p_tg·b_t        (before 1/l)
// and both sums over levels L (0..15, exact in f16) run on mma.sync
// m16n8k16 with f32 accumulation. The f32 side (q' or p·a) is scaled by a
// power of two and split into two f16 halves, hi + lo, so a product keeps
// about 22 bits: the result is the f32 path's to a few units in 1e-7.
//
// Each warp owns 16-token tiles (w, w+4, ... of its CTA's split) with its
// own online softmax; the CTA merges its four warps at the end into the
// same per-split partials paged_merge reads. Fragment layouts (PTX ISA,
// m16n8k16 f16): lane = 4·gid + tig; A holds rows gid and gid+8 at k
// positions 2tig, 2tig+1, 2tig+8, 2tig+9; B holds those k at column gid;
// C holds rows gid, gid+8 at columns 2tig, 2tig+1. A dot product is free
// to order its channels, so each lane's k positions map to channels it
// loads with one vector load (rkv_mma_key_channel), and B's q' follows
// the same map.
//   keys:   A = levels [16 tokens × 16 channels], B = q' [16 channels × 8 heads]
//   values: A = levels [16 channels × 16 tokens], B = p·a [16 tokens × 8 heads]
// A tile whose bytes are not all valid codewords, or with a metadata word
// detected as uncorrectable or outside its bound (for unprotected metadata,
// the largest value stored, 0 if one is infinite), takes the exact route
// (rkv_decode_tile: kv-quant's decode with the erasure policy, counted),
// for keys and values separately.
//
// Loads are pipelined: each lane copies its own key and value bytes of the
// tile RKV_MMA_STAGES-1 ahead into its own slots of dynamic shared memory
// with cp.async (no warp barrier: a lane reads back only what it copied,
// after cp.async.wait_group), and the tile's metadata words one tile ahead
// into registers, so a warp computes on one tile while the next ones load.
// A slot is refilled by cp.async only after the lane has used the words it
// read from it (their registers feed the previous tile's MMAs), which is
// what orders the refill after the read. The host sizes the dynamic shared
// memory: RkvMmaShape::STAGE_WORDS · 4 bytes per warp and stage
// (gpu-kernels' paged_mma_shared_bytes).

#define RKV_MMA_WARPS 4
#define RKV_MMA_STAGES 3
#define RKV_HALF2_1024 0x64006400u

__device__ __forceinline__ void rkv_mma16816(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two nibbles at bits 0-3 and 16-19 of x as an exact f16 pair.
__device__ __forceinline__ u32 rkv_nib_lo(u32 x) {
    u32 h = (x & 0x000f000fu) | RKV_HALF2_1024, r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(RKV_HALF2_1024));
    return r;
}

// Two nibbles at bits 4-7 and 20-23 of x as an exact f16 pair:
// (1024 + 16n)/16 - 64 = n.
__device__ __forceinline__ u32 rkv_nib_hi(u32 x) {
    u32 h = (x & 0x00f000f0u) | RKV_HALF2_1024, r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(0x2c002c00u), "r"(0xd400d400u));
    return r;
}

// x0 (low half) and x1 (high half) as f16 pairs hi and lo, x ≈ hi + lo.
__device__ __forceinline__ void rkv_split2(float x0, float x1, u32* hi, u32* lo) {
    u32 h, l;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(x1), "f"(x0));
    const float r0 = x0 - rkv_h2f((u16)(h & 0xffffu)), r1 = x1 - rkv_h2f((u16)(h >> 16));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(l) : "f"(r1), "f"(r0));
    *hi = h;
    *lo = l;
}

// 2^(14 - ceil(log2 m)): brings a largest magnitude m near 2^14 (1 for 0,
// NaN or infinity). The exponent is capped at 100, so the scale of a tiny
// m stays finite (its products then keep fewer bits, none turn infinite).
__device__ __forceinline__ float rkv_pow2_scale(float m) {
    if (!(m > 0.0f) || !(m <= 3.4028235e38f)) return 1.0f;
    return exp2f(fminf(14.0f - ceilf(log2f(m)), 100.0f));
}

// Bytes of a head row one lane reads: keys HD/4 channels, values HD/8.
template <u32 CODING, u32 HD>
struct RkvMmaShape {
    static constexpr u32 KCH = HD / 4;
    static constexpr u32 VCH = HD / 8;
    static constexpr u32 KWORDS = (CODING == RKV_SECDED ? KCH : KCH / 2) / 4;
    static constexpr u32 VWORDS = (CODING == RKV_SECDED ? VCH : VCH / 2) / 4;
    static constexpr u32 CHUNKS = HD / 16;
    // Staged words of one warp and stage: 2 key rows and 4 value rows per lane.
    static constexpr u32 STAGE_WORDS = 32 * (2 * KWORDS + 4 * VWORDS);
};

// The channel (within the lane's HD/4 key channels) at k slot `slot` (0:
// 2tig, 1: 2tig+1, 2: 2tig+8, 3: 2tig+9) of key chunk `c`: INT4 words give
// the pairs (0,4), (1,5), (2,6), (3,7) of 8 channels; SECDED words (0,2),
// (1,3) of 4.
template <u32 CODING>
__device__ __forceinline__ u32 rkv_mma_key_channel(u32 c, u32 slot) {
    const u32 d = (slot & 1u) ? 2u : 0u, e = slot >> 1;
    if (CODING == RKV_SECDED) return 4 * c + d + e;
    return 8 * (c / 2) + 2 * (c % 2) + 2 * d + e;
}

// A row of N words one lane stages: pieces of W words (one cp.async
// each), lane-interleaved in shared memory ([piece][lane][W]), so a warp's
// vector reads of one piece touch consecutive addresses.
template <u32 N>
struct RkvPiece {
    static_assert(N == 1 || N == 2 || N % 4 == 0, "a row is 1, 2 or a multiple of 4 words");
    static constexpr u32 W = N < 4 ? N : 4;
    static constexpr u32 COUNT = N / W;
};

template <u32 BYTES>
__device__ __forceinline__ void rkv_cp_async(u32 dst, const u8* src) {
    if (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    else if (BYTES == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void rkv_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <u32 PENDING>
__device__ __forceinline__ void rkv_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// Copies row `slot`'s N words at global p into the lane's staging slots
// of the warp's stage at shared address `stage_addr`.
template <u32 N>
__device__ __forceinline__ void rkv_stage_row(u32 stage_addr, u32 slot, u32 lane, const u8* p) {
    typedef RkvPiece<N> R;
    #pragma unroll
    for (u32 i = 0; i < R::COUNT; ++i)
        rkv_cp_async<4 * R::W>(stage_addr + 4 * ((slot * R::COUNT + i) * 32 + lane) * R::W,
                               p + 4 * R::W * i);
}

// Reads back what rkv_stage_row copied.
template <u32 N>
__device__ __forceinline__ void rkv_staged_row(const u32* stage, u32 slot, u32 lane, u32* w) {
    typedef RkvPiece<N> R;
    #pragma unroll
    for (u32 i = 0; i < R::COUNT; ++i) {
        const u32* x = stage + ((slot * R::COUNT + i) * 32 + lane) * R::W;
        if (R::W == 4) {
            const uint4 v = *(const uint4*)x;
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        } else if (R::W == 2) {
            const uint2 v = *(const uint2*)x;
            w[2 * i] = v.x; w[2 * i + 1] = v.y;
        } else {
            w[i] = x[0];
        }
    }
}

// Nonzero where a byte of the four SECDED bytes of x is not the codeword of
// its data nibble: cw[0..4] hold the 16 codewords, four per word.
__device__ __forceinline__ u32 rkv_secded_invalid(u32 x, const u32* cw) {
    const u32 d = x & 0x0f0f0f0fu;
    const u32 s = d | (d >> 4);                    // bytes 0, 2: two nibbles each
    const u32 sel = __byte_perm(s, 0u, 0x0020u) & 0x7777u;
    const u32 lo = __byte_perm(cw[0], cw[1], sel), hi = __byte_perm(cw[2], cw[3], sel);
    const u32 m = ((d >> 3) & 0x01010101u) * 0xffu;  // data >= 8
    return x ^ ((hi & m) | (lo & ~m));
}

// Page and row of token t; tokens of one 16-token tile share a page when
// the block size is a multiple of 16.
__device__ __forceinline__ u32 rkv_token_page(const RkvPagedParams& P, u32 first_page, u32 t,
                                              u32* row) {
    const u32 b = t / P.block_size;
    *row = t - b * P.block_size;
    return P.indices[first_page + b];
}

// The exact route for one tile of one pool: every value of tokens t0..t0+16
// (below end) of KV head kvh decoded as kv-quant decodes it (erasure
// policy included) into buf[16][HD], zeros past end; counted. All 32 lanes
// call it.
template <u32 CODING, u32 HD>
__device__ __noinline__ void rkv_decode_tile(const RkvPagedParams& P, const RkvPool& pool,
                                             const u8* table, u32 first_page, u32 t0, u32 end,
                                             u32 kvh, float* buf) {
    const u32 lane = threadIdx.x % 32;
    u32 c[RKV_ATT_STATS] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (u32 seg = lane; seg < HD; seg += 32) {
        const u32 r = seg / (HD / 16), part = seg % (HD / 16), t = t0 + r;
        float v[16];
        if (t < end) {
            u32 row;
            const u32 page = rkv_token_page(P, first_page, t, &row);
            rkv_load16<CODING>(P, pool, table, page, row, kvh * HD + part * 16, v, c);
        } else {
            #pragma unroll
            for (u32 i = 0; i < 16; ++i) v[i] = 0.0f;
        }
        #pragma unroll
        for (u32 i = 0; i < 16; ++i) buf[r * HD + part * 16 + i] = v[i];
    }
    rkv_add_stats(P.stats, c, RKV_ATT_STATS);
    __syncwarp();
}

// One metadata word (scale or offset) of a token row as stored, with its
// check byte (0 without metadata checks): loaded a tile ahead of its use.
struct RkvMetaRaw {
    u32 word;
    u32 check;
};

__device__ __forceinline__ RkvMetaRaw rkv_mma_meta_load(const RkvPagedParams& P, const RkvPool& pool,
                                                      u32 page, u32 row, u32 g, bool offset) {
    const u32 word = row * P.groups_per_row + g;
    const u8* base = (offset ? pool.offsets : pool.scales) + (u64)page * P.meta_stride;
    // One aligned load (blocks hold whole words). common.cuh's byte-wise
    // rkv_load_word stays for the CUDA-core kernels: an aligned load there
    // made ptxas spill in several of their instances that did not before.
    const u8* wp = base + (u64)word * P.scale_bytes;
    RkvMetaRaw r;
    r.word = P.scale_bytes == 2 ? (u32)__ldg((const unsigned short*)wp) : __ldg((const u32*)wp);
    r.check = 0;
    if (P.meta_checks) {
        const u32 words = P.block_size * P.groups_per_row;
        r.check = pool.checks[(u64)page * P.check_stride + (offset ? words : 0) + word];
    }
    return r;
}

// The word decoded with the syndrome tables (meta_syn: XOR of check
// columns per byte value) and checked against the bound. Returns the
// value; *clean is false where the tile must take the exact route (a
// detected word, or a value outside the bound); *outcome is 0 clean, 1
// corrected.
__device__ __forceinline__ float rkv_mma_meta(const RkvPagedParams& P, const RkvPool& pool,
                                              const u8* meta_syn, RkvMetaRaw raw, bool offset,
                                              bool* clean, u32* outcome) {
    u32 w = raw.word, o = 0;
    if (P.meta_checks) {
        u32 syn = meta_syn[w & 255u] ^ meta_syn[256 + ((w >> 8) & 255u)];
        if (P.scale_bytes == 4)
            syn ^= meta_syn[512 + ((w >> 16) & 255u)] ^ meta_syn[768 + (w >> 24)];
        if (((syn ^ raw.check) & ((1u << P.meta_check_bits) - 1u)) != 0)
            w = rkv_meta_decode(w, raw.check, P.meta_columns, P.meta_width, P.meta_check_bits, &o);
    }
    const float x = rkv_word_to_float(w, P.scale_bytes);
    const bool ok = offset ? fabsf(x) <= pool.offset_bound : (x >= 0.0f && x <= pool.scale_bound);
    *clean = ok && o < 2;
    *outcome = o;
    return x;
}

template <u32 CODING, u32 HD, u32 G>
__device__ __forceinline__ void rkv_paged_mma(const RkvPagedParams& P) {
    typedef RkvMmaShape<CODING, HD> S;
    constexpr u32 CH = S::CHUNKS;
    __shared__ float qs[G][HD];
    __shared__ uint4 qfrag[CH][32];
    __shared__ float buf[RKV_MMA_WARPS][16][HD];
    __shared__ float pbuf[RKV_MMA_WARPS][2][16][9];
    __shared__ float ml[RKV_MMA_WARPS][G][2];
    __shared__ u8 table[256];
    __shared__ u8 meta_syn[1024];
    __shared__ __align__(16) u8 cw_bytes[16];

    const u32 split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 gid = lane / 4, tig = lane % 4;

    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        const u8 e = P.secded_table[i];
        table[i] = e;
        if ((e & (RKV_NIBBLE_CORRECTED | RKV_NIBBLE_DETECTED)) == 0) cw_bytes[e & 15u] = (u8)i;
    }
    for (u32 i = threadIdx.x; i < 1024; i += blockDim.x) {
        const u32 k = i / 256, v = i % 256;
        u32 x = 0;
        for (u32 b = 0; b < 8; ++b)
            if (((v >> b) & 1u) && 8 * k + b < P.meta_width) x ^= P.meta_columns[8 * k + b];
        meta_syn[i] = (u8)x;
    }
    for (u32 i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const u32 g = i / HD, d = i % HD;
        qs[g][d] = P.q[((u64)seq * P.q_heads + kvh * G + g) * HD + d] * P.scale_log2;
    }
    __syncthreads();
    const u32 cw[4] = {((const u32*)cw_bytes)[0], ((const u32*)cw_bytes)[1],
                       ((const u32*)cw_bytes)[2], ((const u32*)cw_bytes)[3]};

    // q' scaled by a power of two, as B fragments (hi, lo) per key chunk.
    float qmax = 0.0f;
    for (u32 i = lane; i < G * HD; i += 32) qmax = fmaxf(qmax, fabsf(qs[i / HD][i % HD]));
    #pragma unroll
    for (u32 off = 16; off > 0; off >>= 1) qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, off));
    const float q_scale = rkv_pow2_scale(qmax), q_unscale = 1.0f / q_scale;
    // Kept in shared memory, one 16-byte vector per chunk and lane (b0 hi,
    // b1 hi, b0 lo, b1 lo), not in registers: the tile loop needs those.
    if (warp == 0)
        #pragma unroll
        for (u32 c = 0; c < CH; ++c) {
            u32 f[4];
            #pragma unroll
            for (u32 r = 0; r < 2; ++r) {
                float x0 = 0.0f, x1 = 0.0f;
                if (gid < G) {
                    x0 = qs[gid][tig * S::KCH + rkv_mma_key_channel<CODING>(c, 2 * r)] * q_scale;
                    x1 = qs[gid][tig * S::KCH + rkv_mma_key_channel<CODING>(c, 2 * r + 1)] * q_scale;
                }
                rkv_split2(x0, x1, &f[r], &f[2 + r]);
            }
            qfrag[c][lane] = make_uint4(f[0], f[1], f[2], f[3]);
        }
    __syncthreads();
    // Σq' of this lane's two score columns (heads 2tig, 2tig+1).
    float qsum[2];
    #pragma unroll
    for (u32 e = 0; e < 2; ++e) {
        float x = 0.0f;
        if (2 * tig + e < G)
            for (u32 d = 0; d < HD; ++d) x += qs[2 * tig + e][d];
        qsum[e] = x;
    }
    const float v_scale = rkv_pow2_scale(P.v.scale_bound), v_unscale = 1.0f / v_scale;
    const bool sym = P.symmetric != 0;
    // Metadata words of this head are counted by the CTA whose head starts
    // the group (as the CUDA-core kernel and kv-quant count them once).
    const bool count_meta = (kvh * HD) % P.channels_per_group == 0;
    const u32 group = (kvh * HD) / P.channels_per_group;
    const bool aligned = P.block_size % 16 == 0;

    const u32 first_page = P.indptr[seq], pages = P.indptr[seq + 1] - first_page;
    const u32 len = pages == 0 ? 0 : (pages - 1) * P.block_size + P.last_page_len[seq];
    const u32 begin = min(len, split * P.split_tokens);
    const u32 end = min(len, begin + P.split_tokens);

    float m[2] = {RKV_NEG_INF, RKV_NEG_INF}, l[2] = {0.0f, 0.0f}, beta[2] = {0.0f, 0.0f};
    float acc[CH][4];
    #pragma unroll
    for (u32 c = 0; c < CH; ++c)
        #pragma unroll
        for (u32 i = 0; i < 4; ++i) acc[c][i] = 0.0f;
    u32 cnt[RKV_ATT_STATS] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    float* wbuf = &buf[warp][0][0];

    // A tile lies in one block where the block size is a multiple of 16,
    // so its rows share a page (other block sizes look pages up per row).
    // Tile j of this warp starts at first + j·step; its bytes are staged
    // RKV_MMA_STAGES-1 tiles ahead, its metadata one tile ahead, and the
    // page index one tile before its bytes (pg[k]: tile j+k's page).
    const u32 step = 16 * RKV_MMA_WARPS, first = begin + 16 * warp;
    extern __shared__ __align__(16) u32 rkv_mma_stage[];
    u32* stages = rkv_mma_stage + warp * RKV_MMA_STAGES * S::STAGE_WORDS;
    const u32 stages_addr = (u32)__cvta_generic_to_shared(stages);
    auto tile_page_of = [&](u32 t) -> u32 {
        return aligned && t < end ? __ldg(P.indices + first_page + t / P.block_size) : 0u;
    };
    // Page and row of row r of the tile at t0 (page tile_page where
    // aligned). Past end: the last token (read, never used).
    auto locate = [&](u32 t0, u32 tile_page, u32 r, u32* row) -> u32 {
        const u32 t = min(t0 + r, end - 1);
        if (aligned) {
            *row = t % P.block_size;
            return tile_page;
        }
        return rkv_token_page(P, first_page, t, row);
    };
    // Byte `ch0` channels into row `r` of the tile at t0 in `data`.
    auto row_at = [&](const u8* data, u32 t0, u32 tile_page, u32 r, u32 ch0) -> const u8* {
        u32 row;
        const u32 page = locate(t0, tile_page, r, &row);
        const u32 bytes = CODING == RKV_SECDED ? ch0 : ch0 / 2;
        return data + (u64)page * P.data_stride + (u64)row * P.row_bytes + bytes;
    };
    // Rows this lane reads: keys gid, gid+8; values 2tig, 2tig+1, 2tig+8,
    // 2tig+9; metadata (both pools) row gid + 8·(tig/2), the scale for
    // even tig, the offset for odd tig.
    const u32 kr[2] = {gid, gid + 8}, vr[4] = {2 * tig, 2 * tig + 1, 2 * tig + 8, 2 * tig + 9};
    const u32 mrow = gid + 8 * (tig / 2);
    const bool is_offset = (tig & 1u) != 0, loads_meta = !(is_offset && sym);
    // Stages the tile at t0 (one commit group, empty past end).
    auto stage_tile = [&](u32 t0, u32 tile_page, u32 slot) {
        if (t0 < end) {
            const u32 addr = stages_addr + 4 * slot * S::STAGE_WORDS;
            #pragma unroll
            for (u32 i = 0; i < 2; ++i)
                rkv_stage_row<S::KWORDS>(addr, i, lane,
                                         row_at(P.k.data, t0, tile_page, kr[i], kvh * HD + tig * S::KCH));
            #pragma unroll
            for (u32 i = 0; i < 4; ++i)
                rkv_stage_row<S::VWORDS>(addr + 4 * 64 * S::KWORDS, i, lane,
                                         row_at(P.v.data, t0, tile_page, vr[i], kvh * HD + gid * S::VCH));
        }
        rkv_cp_async_commit();
    };
    auto load_meta = [&](u32 t0, u32 tile_page, RkvMetaRaw* km, RkvMetaRaw* vm) {
        if (t0 < end && loads_meta) {
            u32 row;
            const u32 page = locate(t0, tile_page, mrow, &row);
            *km = rkv_mma_meta_load(P, P.k, page, row, group, is_offset);
            *vm = rkv_mma_meta_load(P, P.v, page, row, group, is_offset);
        }
    };
    u32 pg[RKV_MMA_STAGES];
    #pragma unroll
    for (u32 k = 0; k < RKV_MMA_STAGES; ++k) pg[k] = tile_page_of(first + k * step);
    #pragma unroll
    for (u32 k = 0; k + 1 < RKV_MMA_STAGES; ++k) stage_tile(first + k * step, pg[k], k);
    RkvMetaRaw km_next = {0, 0}, vm_next = {0, 0};
    load_meta(first, pg[0], &km_next, &vm_next);
    u32 slot = 0;
    for (u32 t0 = first; t0 < end; t0 += step) {
        const u32 tile_page = pg[0];
        stage_tile(t0 + (RKV_MMA_STAGES - 1) * step, pg[RKV_MMA_STAGES - 1],
                   slot == 0 ? RKV_MMA_STAGES - 1 : slot - 1);
        const RkvMetaRaw km = km_next, vm = vm_next;
        load_meta(t0 + step, pg[1], &km_next, &vm_next);
        #pragma unroll
        for (u32 k = 0; k + 1 < RKV_MMA_STAGES; ++k) pg[k] = pg[k + 1];
        pg[RKV_MMA_STAGES - 1] = tile_page_of(t0 + RKV_MMA_STAGES * step);

        // This tile's group is complete once at most STAGES-1 are pending.
        rkv_cp_async_wait<RKV_MMA_STAGES - 1>();
        const u32* st = stages + slot * S::STAGE_WORDS;
        slot = slot + 1 == RKV_MMA_STAGES ? 0 : slot + 1;
        u32 kw[2][S::KWORDS], vw[4][S::VWORDS];
        #pragma unroll
        for (u32 i = 0; i < 2; ++i) rkv_staged_row<S::KWORDS>(st, i, lane, kw[i]);
        #pragma unroll
        for (u32 i = 0; i < 4; ++i) rkv_staged_row<S::VWORDS>(st + 64 * S::KWORDS, i, lane, vw[i]);
        const u32 mt = t0 + mrow;
        bool kclean = true, vclean = true;
        float kmeta = 0.0f, vmeta = 0.0f;
        u32 ko = 0, vo = 0;
        if (loads_meta) {
            kmeta = rkv_mma_meta(P, P.k, meta_syn, km, is_offset, &kclean, &ko);
            vmeta = rkv_mma_meta(P, P.v, meta_syn, vm, is_offset, &vclean, &vo);
        }
        if (CODING == RKV_SECDED) {
            u32 bad = 0;
            #pragma unroll
            for (u32 i = 0; i < 2; ++i)
                #pragma unroll
                for (u32 j = 0; j < S::KWORDS; ++j) bad |= rkv_secded_invalid(kw[i][j], cw);
            kclean = kclean && bad == 0;
            bad = 0;
            #pragma unroll
            for (u32 i = 0; i < 4; ++i)
                #pragma unroll
                for (u32 j = 0; j < S::VWORDS; ++j) bad |= rkv_secded_invalid(vw[i][j], cw);
            vclean = vclean && bad == 0;
        }
        const bool kfast = __all_sync(0xffffffffu, kclean);
        const bool vfast = __all_sync(0xffffffffu, vclean);
        // This lane's rows' a and b from the quad's four metadata lanes.
        const u32 q0 = lane & ~3u;
        float ka[2], kb[2], va[2], vb[2];
        #pragma unroll
        for (u32 i = 0; i < 2; ++i) {
            ka[i] = __shfl_sync(0xffffffffu, kmeta, q0 + 2 * i);
            kb[i] = sym ? 0.0f : __shfl_sync(0xffffffffu, kmeta, q0 + 2 * i + 1);
            va[i] = __shfl_sync(0xffffffffu, vmeta, q0 + 2 * i);
            vb[i] = sym ? 0.0f : __shfl_sync(0xffffffffu, vmeta, q0 + 2 * i + 1);
        }
        if (mt < end && count_meta && loads_meta) {
            if (kfast) { cnt[4] += 1; cnt[5] += ko == 0; cnt[6] += ko == 1; }
            if (vfast) { cnt[4] += 1; cnt[5] += vo == 0; cnt[6] += vo == 1; }
        }

        // 1. scores: s[0] (row gid, head 2tig), s[1] (gid, 2tig+1), s[2]
        // (gid+8, 2tig), s[3] (gid+8, 2tig+1).
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (kfast) {
            #pragma unroll
            for (u32 i = 0; i < 2; ++i)
                if (t0 + kr[i] < end) { cnt[0] += S::KCH; cnt[1] += S::KCH; }
            float part[2][2][4] = {};
            #pragma unroll
            for (u32 c = 0; c < CH; ++c) {
                u32 a[4];
                #pragma unroll
                for (u32 i = 0; i < 2; ++i) {
                    if (CODING == RKV_SECDED) {
                        const u32 x = kw[i][c];
                        a[i] = rkv_nib_lo(x);
                        a[2 + i] = rkv_nib_lo(x >> 8);
                    } else {
                        const u32 x = c % 2 ? kw[i][c / 2] >> 8 : kw[i][c / 2];
                        a[i] = rkv_nib_lo(x);
                        a[2 + i] = rkv_nib_hi(x);
                    }
                }
                // Four independent accumulators (hi and lo halves of q',
                // even and odd chunks): a chain of CH/2 dependent MMAs,
                // not 2·CH.
                const uint4 qb = qfrag[c][lane];
                rkv_mma16816(part[c % 2][0], a, qb.x, qb.y);
                rkv_mma16816(part[c % 2][1], a, qb.z, qb.w);
            }
            #pragma unroll
            for (u32 i = 0; i < 4; ++i)
                s[i] = (part[0][0][i] + part[1][0][i]) + (part[0][1][i] + part[1][1][i]);
            #pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u32 r = i / 2, e = i % 2;
                const float dot = s[i] * q_unscale;
                s[i] = sym ? ka[r] * (dot - 8.0f * qsum[e]) : fmaf(ka[r], dot, kb[r] * qsum[e]);
            }
        } else {
            rkv_decode_tile<CODING, HD>(P, P.k, table, first_page, t0, end, kvh, wbuf);
            #pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u32 r = kr[i / 2], g = 2 * tig + i % 2;
                float x = 0.0f;
                if (g < G)
                    for (u32 d = 0; d < HD; ++d) x = fmaf(qs[g][d], wbuf[r * HD + d], x);
                s[i] = x;
            }
            __syncwarp();
        }
        #pragma unroll
        for (u32 i = 0; i < 4; ++i)
            if (t0 + kr[i / 2] >= end) s[i] = RKV_NEG_INF;

        // 2. online softmax per head (column): max and sums over the rows.
        float alpha[2], p[4];
        #pragma unroll
        for (u32 e = 0; e < 2; ++e) {
            float mx = fmaxf(s[e], s[2 + e]);
            #pragma unroll
            for (u32 off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m[e], mx);
            alpha[e] = m[e] == RKV_NEG_INF ? 0.0f : exp2f(m[e] - m_new);
            // A column of -inf scores (a query of -inf on the exact route)
            // weighs nothing, as in the CUDA-core kernel.
            p[e] = m_new == RKV_NEG_INF ? 0.0f : exp2f(s[e] - m_new);
            p[2 + e] = m_new == RKV_NEG_INF ? 0.0f : exp2f(s[2 + e] - m_new);
            // l and beta are kept per lane (its two rows) and summed over
            // the column's eight lanes once, after the last tile: every
            // lane of a column scales by the same alpha.
            const float sum = p[e] + p[2 + e];
            const float bsum = vfast ? (sym ? -8.0f * (p[e] * va[0] + p[2 + e] * va[1])
                                            : p[e] * vb[0] + p[2 + e] * vb[1])
                                     : 0.0f;
            m[e] = m_new;
            l[e] = l[e] * alpha[e] + sum;
            beta[e] = beta[e] * alpha[e] + bsum;
        }
        #pragma unroll
        for (u32 c = 0; c < CH; ++c)
            #pragma unroll
            for (u32 i = 0; i < 4; ++i) acc[c][i] *= alpha[i % 2];

        // 3. values. pbuf[warp][0]: p·a·v_scale (fast), [1]: p (exact route).
        #pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            const u32 r = kr[i / 2], g = 2 * tig + i % 2;
            pbuf[warp][0][r][g] = p[i] * va[i / 2] * v_scale;
            pbuf[warp][1][r][g] = p[i];
        }
        __syncwarp();
        if (vfast) {
            #pragma unroll
            for (u32 i = 0; i < 4; ++i)
                if (t0 + vr[i] < end) { cnt[0] += S::VCH; cnt[1] += S::VCH; }
            u32 b[2][2];  // [b0 b1][hi lo]
            rkv_split2(pbuf[warp][0][vr[0]][gid], pbuf[warp][0][vr[1]][gid], &b[0][0], &b[0][1]);
            rkv_split2(pbuf[warp][0][vr[2]][gid], pbuf[warp][0][vr[3]][gid], &b[1][0], &b[1][1]);
            // Channel pairs of tokens (2tig, 2tig+1) and (2tig+8, 2tig+9).
            u32 h[2][S::VCH];
            #pragma unroll
            for (u32 pr = 0; pr < 2; ++pr)
                #pragma unroll
                for (u32 w = 0; w < S::VWORDS; ++w) {
                    const u32 x0 = __byte_perm(vw[2 * pr][w], vw[2 * pr + 1][w], 0x5410u);
                    const u32 x1 = __byte_perm(vw[2 * pr][w], vw[2 * pr + 1][w], 0x7632u);
                    if (CODING == RKV_SECDED) {
                        h[pr][4 * w] = rkv_nib_lo(x0);
                        h[pr][4 * w + 1] = rkv_nib_lo(x0 >> 8);
                        h[pr][4 * w + 2] = rkv_nib_lo(x1);
                        h[pr][4 * w + 3] = rkv_nib_lo(x1 >> 8);
                    } else {
                        h[pr][8 * w] = rkv_nib_lo(x0);
                        h[pr][8 * w + 1] = rkv_nib_hi(x0);
                        h[pr][8 * w + 2] = rkv_nib_lo(x0 >> 8);
                        h[pr][8 * w + 3] = rkv_nib_hi(x0 >> 8);
                        h[pr][8 * w + 4] = rkv_nib_lo(x1);
                        h[pr][8 * w + 5] = rkv_nib_hi(x1);
                        h[pr][8 * w + 6] = rkv_nib_lo(x1 >> 8);
                        h[pr][8 * w + 7] = rkv_nib_hi(x1 >> 8);
                    }
                }
            #pragma unroll
            for (u32 c = 0; c < CH; ++c) {
                const u32 a[4] = {h[0][2 * c], h[0][2 * c + 1], h[1][2 * c], h[1][2 * c + 1]};
                rkv_mma16816(acc[c], a, b[0][0], b[1][0]);
                rkv_mma16816(acc[c], a, b[0][1], b[1][1]);
            }
        } else {
            rkv_decode_tile<CODING, HD>(P, P.v, table, first_page, t0, end, kvh, wbuf);
            #pragma unroll
            for (u32 c = 0; c < CH; ++c)
                #pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    const u32 d = gid * S::VCH + 2 * c + i / 2, g = 2 * tig + i % 2;
                    float x = 0.0f;
                    if (g < G)
                        for (u32 t = 0; t < 16; ++t) x = fmaf(pbuf[warp][1][t][g], wbuf[t * HD + d], x);
                    acc[c][i] = fmaf(x, v_scale, acc[c][i]);
                }
        }
        __syncwarp();  // pbuf and wbuf are rewritten by the next tile
    }
    rkv_cp_async_wait<0>();  // no copy outlives the kernel's shared memory
    #pragma unroll
    for (u32 e = 0; e < 2; ++e)
        #pragma unroll
        for (u32 off = 4; off < 32; off <<= 1) {
            l[e] += __shfl_xor_sync(0xffffffffu, l[e], off);
            beta[e] += __shfl_xor_sync(0xffffffffu, beta[e], off);
        }

    // Merge the warps: unnormalised outputs into buf, (m, l) into ml.
    #pragma unroll
    for (u32 c = 0; c < CH; ++c)
        #pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            const u32 d = gid * S::VCH + 2 * c + i / 2, g = 2 * tig + i % 2;
            if (g < G) buf[warp][g][d] = fmaf(acc[c][i], v_unscale, beta[i % 2]);
        }
    if (gid == 0)
        #pragma unroll
        for (u32 e = 0; e < 2; ++e)
            if (2 * tig + e < G) {
                ml[warp][2 * tig + e][0] = m[e];
                ml[warp][2 * tig + e][1] = l[e];
            }
    __syncthreads();
    for (u32 i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const u32 g = i / HD, d = i % HD;
        float mm = RKV_NEG_INF;
        #pragma unroll
        for (u32 w = 0; w < RKV_MMA_WARPS; ++w) mm = fmaxf(mm, ml[w][g][0]);
        float x = 0.0f, ll = 0.0f;
        #pragma unroll
        for (u32 w = 0; w < RKV_MMA_WARPS; ++w)
            if (ml[w][g][0] != RKV_NEG_INF) {
                const float f = exp2f(ml[w][g][0] - mm);
                x += buf[w][g][d] * f;
                ll += ml[w][g][1] * f;
            }
        const u64 part = ((u64)seq * P.q_heads + kvh * G + g) * P.splits + split;
        P.part_acc[part * HD + d] = x;
        if (d == 0) {
            P.part_ml[2 * part] = mm;
            P.part_ml[2 * part + 1] = ll;
        }
    }
    rkv_add_stats(P.stats, cnt, RKV_ATT_STATS);
}

#define RKV_MMA_INSTANCE(NAME, CODING, HD, G)                                           \
    extern "C" __global__ void __launch_bounds__(RKV_MMA_WARPS * 32, 3)                 \
        paged_mma_##NAME##_hd##HD##_g##G(const __grid_constant__ RkvPagedParams P) {    \
        rkv_paged_mma<CODING, HD, G>(P);                                                \
    }

RKV_EACH_SHAPE(RKV_MMA_INSTANCE, int4, RKV_INT4)
RKV_EACH_SHAPE(RKV_MMA_INSTANCE, secded, RKV_SECDED)
