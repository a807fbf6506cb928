// paged_decode.cu: fused flash-decoding over a paged KV cache.
//
// The page table is paged-cache's CSR form (indptr, indices, last_page_len;
// crates/paged-cache/src/page_table.rs); each physical block holds, per K
// and V, the four buffers of a kv-quant KvStore of `block_size` tokens,
// unchanged: values (f16, packed INT4, or one SECDED(8,4) byte per level),
// scales, offsets and metadata check bytes. Pools are arrays of blocks with
// a fixed stride per buffer.
//
// Grid (splits, kv_heads, batch); each CTA of RKV_WARPS warps reads one KV
// head's rows of one split of one sequence for the G query heads sharing
// that KV head (GQA), in tiles of RKV_TILE tokens:
//   1. scores: each token row is read by L = HD/16 consecutive lanes, 16
//      channels each (one 16-byte SECDED load, one 8-byte INT4 load, two
//      16-byte f16 loads), decoded in registers, dotted with the G queries,
//      and reduced over the L lanes by shuffles;
//   2. softmax: the online-softmax running max and sum per head (base 2);
//   3. values: the same lanes read and decode V and accumulate p·v.
// Erased values (a detected codeword, or a detected scale or offset) follow
// the form's policy inside the tile loop: keep (a group whose scale or
// offset was erased is interpolated even so), zero, or kv-quant's
// interpolation along the token axis within the same block (the CPU limits
// its neighbours to the block too). A second kernel merges the
// splits' partial results by log-sum-exp.

#define RKV_WARPS 4
#define RKV_TILE 64
#define RKV_ATT_STATS 9  // values: words clean corrected detected; metadata: same; erased

struct RkvPool {
    const u8* data;
    const u8* scales;
    const u8* offsets;
    const u8* checks;
    float scale_bound;   // kv-quant's ParamBound: the largest scale written
    float offset_bound;  // and the largest |offset|
};

struct RkvPagedParams {
    RkvPool k;
    RkvPool v;
    const u32* indptr;
    const u32* indices;
    const u32* last_page_len;
    const float* q;          // [batch][q_heads][HD]
    float* part_acc;         // [batch][q_heads][splits][HD]
    float* part_ml;          // [batch][q_heads][splits][2]: running max (base 2), sum
    u64* stats;              // RKV_ATT_STATS counters
    const u8* secded_table;  // 256 entries (src/tables.rs)
    const u8* meta_columns;  // 32 entries
    u64 data_stride;         // bytes per block in each pool
    u64 meta_stride;
    u64 check_stride;
    u32 block_size;
    u32 row_bytes;
    u32 channels;
    u32 channels_per_group;
    u32 groups_per_row;
    u32 scale_bytes;
    u32 symmetric;
    u32 meta_checks;
    u32 meta_width;
    u32 meta_check_bits;
    u32 policy;  // 0 keep, 1 zero, 2 interpolate
    u32 reach;
    u32 q_heads;
    u32 kv_heads;
    u32 splits;
    u32 split_tokens;
    float scale_log2;  // softmax scale * log2(e)
    u32 pad_;
};

// Scale and offset of group `g` of row `row` of a block, decoded (and
// counted when `count`); returns whether either was detected.
__device__ __forceinline__ bool rkv_group_params(const RkvPagedParams& P, const RkvPool& pool,
                                                 u32 page, u32 row, u32 g, float* a, float* b,
                                                 u32* c) {
    u32 word = row * P.groups_per_row + g;
    u32 words = P.block_size * P.groups_per_row;
    const u8* sp = pool.scales + (u64)page * P.meta_stride + (u64)word * P.scale_bytes;
    u32 s = rkv_load_word(sp, P.scale_bytes), o = 0;
    u32 so = 0, oo = 0;
    const u8* chk = pool.checks + (u64)page * P.check_stride;
    if (P.meta_checks)
        s = rkv_meta_decode(s, chk[word], P.meta_columns, P.meta_width, P.meta_check_bits, &so);
    if (!P.symmetric) {
        const u8* op = pool.offsets + (u64)page * P.meta_stride + (u64)word * P.scale_bytes;
        o = rkv_load_word(op, P.scale_bytes);
        if (P.meta_checks)
            o = rkv_meta_decode(o, chk[words + word], P.meta_columns, P.meta_width,
                                P.meta_check_bits, &oo);
    }
    if (c) {
        // Constant indices only: a run-time index would put c in local memory.
        c[4] += 1 + (P.symmetric ? 0 : 1);
        c[5] += (so == 0) + (!P.symmetric && oo == 0);
        c[6] += (so == 1) + (!P.symmetric && oo == 1);
        c[7] += (so == 2) + (!P.symmetric && oo == 2);
    }
    *a = rkv_word_to_float(s, P.scale_bytes);
    *b = P.symmetric ? 0.0f : rkv_word_to_float(o, P.scale_bytes);
    // kv-quant's rules for protected metadata: a scale outside
    // 0..=scale_bound or an offset outside -offset_bound..=offset_bound
    // (NaN and infinities included: the comparisons fail) is an error the
    // code let through; it and a detected word read as 0 and erase the group.
    if (P.meta_checks) {
        bool bad_a = so == 2 || !(*a >= 0.0f && *a <= pool.scale_bound);
        bool bad_b = oo == 2 || !(fabsf(*b) <= pool.offset_bound);
        if (bad_a) *a = 0.0f;
        if (bad_b) *b = 0.0f;
        return bad_a || bad_b;
    }
    return false;
}

// The value of channel `ch` of row `row` of a block if neither its codeword
// nor its group's metadata is detected (kv-quant's valid_value_at).
template <u32 CODING>
__device__ bool rkv_valid_value(const RkvPagedParams& P, const RkvPool& pool, const u8* table,
                                u32 page, u32 row, u32 ch, float* v) {
    float a, b;
    if (rkv_group_params(P, pool, page, row, ch / P.channels_per_group, &a, &b, 0)) return false;
    const u8* rowp = pool.data + (u64)page * P.data_stride + (u64)row * P.row_bytes;
    u32 level;
    if (CODING == RKV_SECDED) {
        u32 e = table[rowp[ch]];
        if (e & RKV_NIBBLE_DETECTED) return false;
        level = e & 15u;
    } else {
        level = (rowp[ch / 2] >> (4 * (ch & 1))) & 15u;
    }
    *v = rkv_dequant(level, a, b, P.symmetric != 0);
    return true;
}

// What an erased value (channel `ch` of row `row`, decoded as `received`)
// becomes under the form's policy; under keep, a value whose group's
// metadata was erased (`meta`) has nothing to keep and is interpolated
// (kv-quant's apply_policy). Out of line: it runs only on erasures.
template <u32 CODING>
__device__ __noinline__ float rkv_erased_value(const RkvPagedParams& P, const RkvPool& pool,
                                               const u8* table, u32 page, u32 row, u32 ch,
                                               float received, bool meta) {
    if (P.policy == 1) return 0.0f;
    if (P.policy == 0 && !meta) return received;
    u32 dl = 0, dr = 0;
    float l = 0.0f, r = 0.0f, x;
    for (u32 d = 1; d <= P.reach && d <= row; ++d)
        if (rkv_valid_value<CODING>(P, pool, table, page, row - d, ch, &x)) { dl = d; l = x; break; }
    for (u32 d = 1; d <= P.reach && row + d < P.block_size; ++d)
        if (rkv_valid_value<CODING>(P, pool, table, page, row + d, ch, &x)) { dr = d; r = x; break; }
    return rkv_interpolate(dl, l, dr, r);
}

// Decodes channels ch0..ch0+16 of token row `row` of block `page` into v,
// counting into c (metadata only when this lane starts the group).
template <u32 CODING>
__device__ __forceinline__ void rkv_load16(const RkvPagedParams& P, const RkvPool& pool,
                                           const u8* table, u32 page, u32 row, u32 ch0,
                                           float* v, u32* c) {
    const u8* rowp = pool.data + (u64)page * P.data_stride + (u64)row * P.row_bytes;
    if (CODING == RKV_F16) {
        const uint4* p = (const uint4*)(rowp + 2 * ch0);
        uint4 h0 = __ldg(p), h1 = __ldg(p + 1);
        u32 w[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[2 * i] = rkv_h2f((u16)(w[i] & 0xffffu));
            v[2 * i + 1] = rkv_h2f((u16)(w[i] >> 16));
        }
        c[0] += 16;
        c[1] += 16;
        return;
    }
    float a, b;
    bool counted = (ch0 % P.channels_per_group) == 0;
    bool meta_bad = rkv_group_params(P, pool, page, row, ch0 / P.channels_per_group, &a, &b,
                                     counted ? c : 0);
    u32 levels[16];
    u32 detected = meta_bad ? 0xffffu : 0u;
    if (CODING == RKV_INT4) {
        uint2 w = __ldg((const uint2*)(rowp + ch0 / 2));
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            levels[i] = (w.x >> (4 * i)) & 15u;
            levels[8 + i] = (w.y >> (4 * i)) & 15u;
        }
        c[0] += 16;
        c[1] += 16;
    } else {
        uint4 w = __ldg((const uint4*)(rowp + ch0));
        u32 ws[4] = {w.x, w.y, w.z, w.w};
        u32 dec = 0, corr = 0;
        #pragma unroll
        for (int i = 0; i < 16; ++i) {
            u32 e = table[(ws[i / 4] >> (8 * (i % 4))) & 0xffu];
            levels[i] = e & 15u;
            if (e & RKV_NIBBLE_DETECTED) dec |= 1u << i;
            if (e & RKV_NIBBLE_CORRECTED) corr |= 1u << i;
        }
        c[0] += 16;
        c[3] += __popc(dec);
        c[2] += __popc(corr);
        c[1] += 16 - __popc(dec) - __popc(corr);
        detected |= dec;
    }
    #pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = rkv_dequant(levels[i], a, b, P.symmetric != 0);
    if (detected) {  // rare: the erasure policy, out of line
        c[8] += __popc(detected);
        #pragma unroll
        for (int i = 0; i < 16; ++i)
            if ((detected >> i) & 1u)
                v[i] = rkv_erased_value<CODING>(P, pool, table, page, row, ch0 + i, v[i], meta_bad);
    }
}

template <u32 CODING, u32 HD, u32 G>
__device__ __forceinline__ void rkv_paged_decode(const RkvPagedParams& P) {
    constexpr u32 L = HD / 16;       // lanes per token row
    constexpr u32 TPW = 32 / L;      // token rows per warp step
    constexpr u32 ROWS = RKV_TILE / RKV_WARPS;  // token rows per warp per tile
    __shared__ float scores[G][RKV_TILE];
    __shared__ float alpha[G];
    __shared__ float run_m[G], run_l[G];
    __shared__ float red[RKV_WARPS][G][HD];
    __shared__ u8 table[256];

    const u32 split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 sub = lane % L, slot = lane / L;
    const u32 ch0 = kvh * HD + sub * 16;

    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) table[i] = P.secded_table[i];
    if (threadIdx.x < G) { run_m[threadIdx.x] = RKV_NEG_INF; run_l[threadIdx.x] = 0.0f; }

    const u32 first_page = P.indptr[seq], pages = P.indptr[seq + 1] - first_page;
    const u32 len = pages == 0 ? 0 : (pages - 1) * P.block_size + P.last_page_len[seq];
    const u32 begin = min(len, split * P.split_tokens);
    const u32 end = min(len, begin + P.split_tokens);

    float q[G][16];
    #pragma unroll
    for (u32 g = 0; g < G; ++g) {
        const float* qp = P.q + ((u64)seq * P.q_heads + kvh * G + g) * HD + sub * 16;
        #pragma unroll
        for (u32 i = 0; i < 16; ++i) q[g][i] = qp[i] * P.scale_log2;
    }
    float acc[G][16];
    #pragma unroll
    for (u32 g = 0; g < G; ++g)
        #pragma unroll
        for (u32 i = 0; i < 16; ++i) acc[g][i] = 0.0f;
    u32 c[RKV_ATT_STATS] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    __syncthreads();

    for (u32 tile = begin; tile < end; tile += RKV_TILE) {
        // 1. scores
        #pragma unroll
        for (u32 s = 0; s < ROWS / TPW; ++s) {
            const u32 tt = warp * ROWS + s * TPW + slot, t = tile + tt;
            float dot[G];
            #pragma unroll
            for (u32 g = 0; g < G; ++g) dot[g] = 0.0f;
            if (t < end) {
                const u32 page = P.indices[first_page + t / P.block_size];
                float k[16];
                rkv_load16<CODING>(P, P.k, table, page, t % P.block_size, ch0, k, c);
                #pragma unroll
                for (u32 g = 0; g < G; ++g)
                    #pragma unroll
                    for (u32 i = 0; i < 16; ++i) dot[g] = fmaf(q[g][i], k[i], dot[g]);
            }
            #pragma unroll
            for (u32 g = 0; g < G; ++g) {
                #pragma unroll
                for (u32 off = L / 2; off > 0; off >>= 1)
                    dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], off);
                if (sub == 0) scores[g][tt] = t < end ? dot[g] : RKV_NEG_INF;
            }
        }
        __syncthreads();
        // 2. online softmax, one warp per head
        for (u32 g = warp; g < G; g += RKV_WARPS) {
            float s0 = scores[g][lane], s1 = scores[g][lane + 32];
            float m = fmaxf(s0, s1);
            for (u32 off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
            const float m_old = run_m[g], m_new = fmaxf(m_old, m);
            const float p0 = m_new == RKV_NEG_INF ? 0.0f : exp2f(s0 - m_new);
            const float p1 = m_new == RKV_NEG_INF ? 0.0f : exp2f(s1 - m_new);
            float sum = p0 + p1;
            for (u32 off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            scores[g][lane] = p0;
            scores[g][lane + 32] = p1;
            __syncwarp();
            if (lane == 0) {
                const float a = m_old == RKV_NEG_INF ? 0.0f : exp2f(m_old - m_new);
                alpha[g] = a;
                run_m[g] = m_new;
                run_l[g] = run_l[g] * a + sum;
            }
        }
        __syncthreads();
        // 3. values
        #pragma unroll
        for (u32 g = 0; g < G; ++g) {
            const float a = alpha[g];
            #pragma unroll
            for (u32 i = 0; i < 16; ++i) acc[g][i] *= a;
        }
        #pragma unroll
        for (u32 s = 0; s < ROWS / TPW; ++s) {
            const u32 tt = warp * ROWS + s * TPW + slot, t = tile + tt;
            if (t < end) {
                const u32 page = P.indices[first_page + t / P.block_size];
                float v[16];
                rkv_load16<CODING>(P, P.v, table, page, t % P.block_size, ch0, v, c);
                #pragma unroll
                for (u32 g = 0; g < G; ++g) {
                    const float p = scores[g][tt];
                    #pragma unroll
                    for (u32 i = 0; i < 16; ++i) acc[g][i] = fmaf(p, v[i], acc[g][i]);
                }
            }
        }
        __syncthreads();  // scores are rewritten by the next tile
    }

    // Reduce the TPW token slots of each warp, then the warps.
    #pragma unroll
    for (u32 g = 0; g < G; ++g)
        #pragma unroll
        for (u32 i = 0; i < 16; ++i) {
            float x = acc[g][i];
            #pragma unroll
            for (u32 off = 16; off >= L; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
            if (slot == 0) red[warp][g][sub * 16 + i] = x;
        }
    __syncthreads();
    for (u32 i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const u32 g = i / HD, d = i % HD;
        float x = 0.0f;
        #pragma unroll
        for (u32 w = 0; w < RKV_WARPS; ++w) x += red[w][g][d];
        const u64 part = ((u64)seq * P.q_heads + kvh * G + g) * P.splits + split;
        P.part_acc[part * HD + d] = x;
        if (d == 0) {
            P.part_ml[2 * part] = run_m[g];
            P.part_ml[2 * part + 1] = run_l[g];
        }
    }
    rkv_add_stats(P.stats, c, RKV_ATT_STATS);
}

// Merges the splits of each (sequence, query head): out = Σ acc_s·2^(m_s−M)
// / Σ l_s·2^(m_s−M), and the natural log-sum-exp of the scaled scores
// (-inf, with a zero output, for a sequence without tokens).
extern "C" __global__ void paged_merge(const float* __restrict__ part_acc,
                                       const float* __restrict__ part_ml, u32 splits, u32 hd,
                                       float* __restrict__ out, float* __restrict__ lse) {
    const u64 row = (u64)blockIdx.y * gridDim.x + blockIdx.x;  // seq * q_heads + head
    float m = RKV_NEG_INF;
    for (u32 s = 0; s < splits; ++s) m = fmaxf(m, part_ml[2 * (row * splits + s)]);
    float l = 0.0f;
    for (u32 s = 0; s < splits; ++s) {
        const float ms = part_ml[2 * (row * splits + s)];
        if (ms != RKV_NEG_INF) l += part_ml[2 * (row * splits + s) + 1] * exp2f(ms - m);
    }
    for (u32 d = threadIdx.x; d < hd; d += blockDim.x) {
        float x = 0.0f;
        for (u32 s = 0; s < splits; ++s) {
            const float ms = part_ml[2 * (row * splits + s)];
            if (ms != RKV_NEG_INF) x += part_acc[(row * splits + s) * hd + d] * exp2f(ms - m);
        }
        out[row * hd + d] = l > 0.0f ? x / l : 0.0f;
    }
    if (threadIdx.x == 0) lse[row] = l > 0.0f ? (m + log2f(l)) * 0.69314718055994531f : RKV_NEG_INF;
}

// Every (head_dim, query heads per KV head) instance of one kernel family:
// INSTANCE(NAME, CODING, HD, G) for head_dim 64 and 128 and G 1, 2, 4, 8.
#define RKV_EACH_SHAPE(INSTANCE, NAME, CODING)                                          \
    INSTANCE(NAME, CODING, 64, 1) INSTANCE(NAME, CODING, 64, 2)                         \
    INSTANCE(NAME, CODING, 64, 4) INSTANCE(NAME, CODING, 64, 8)                         \
    INSTANCE(NAME, CODING, 128, 1) INSTANCE(NAME, CODING, 128, 2)                       \
    INSTANCE(NAME, CODING, 128, 4) INSTANCE(NAME, CODING, 128, 8)

#define RKV_INSTANCE(NAME, CODING, HD, G)                                               \
    extern "C" __global__ void __launch_bounds__(RKV_WARPS * 32)                        \
        paged_decode_##NAME##_hd##HD##_g##G(const __grid_constant__ RkvPagedParams P) {  \
        rkv_paged_decode<CODING, HD, G>(P);                                             \
    }

RKV_EACH_SHAPE(RKV_INSTANCE, f16, RKV_F16)
RKV_EACH_SHAPE(RKV_INSTANCE, int4, RKV_INT4)
RKV_EACH_SHAPE(RKV_INSTANCE, secded, RKV_SECDED)
