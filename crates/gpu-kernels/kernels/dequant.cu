// dequant.cu: INT4 and FP8 stores of kv-quant (crates/kv-quant/src/store.rs)
// back to f32, bit-identical to KvStore::decode for unprotected forms.
//
// Groups follow kv-quant's GroupLayout: value (t, c) belongs to group
// (t / tokens_per_block) * groups_per_block + c / channels_per_group, and
// the scale (and offset) buffers hold one little-endian word of
// `scale_bytes` bytes per group.

struct RkvGroups {
    u32 tokens_per_block;
    u32 channels_per_group;
    u32 groups_per_block;
    u32 scale_bytes;
};

__device__ __forceinline__ u32 rkv_group(const RkvGroups& g, u32 t, u32 c) {
    return (t / g.tokens_per_block) * g.groups_per_block + c / g.channels_per_group;
}

// One thread per pair of values (one packed byte), grid-stride over
// tokens x ceil(channels/2). Row t's levels start at byte t * row_bytes.
extern "C" __global__ void int4_dequant(const u8* __restrict__ data, u32 tokens, u32 channels,
                                        u32 row_bytes, const u8* __restrict__ scales,
                                        const u8* __restrict__ offsets, u32 symmetric,
                                        RkvGroups groups, float* __restrict__ out) {
    u32 pairs = (channels + 1) / 2;
    u64 total = (u64)tokens * pairs;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u32 t = (u32)(i / pairs), p = (u32)(i % pairs);
        u32 byte = data[(u64)t * row_bytes + p];
        for (u32 j = 0; j < 2; ++j) {
            u32 c = 2 * p + j;
            if (c >= channels) break;
            u32 g = rkv_group(groups, t, c);
            float a = rkv_word_to_float(rkv_load_word(scales + (u64)g * groups.scale_bytes,
                                                      groups.scale_bytes), groups.scale_bytes);
            float b = symmetric ? 0.0f
                                : rkv_word_to_float(rkv_load_word(offsets + (u64)g * groups.scale_bytes,
                                                                  groups.scale_bytes),
                                                    groups.scale_bytes);
            out[(u64)t * channels + c] = rkv_dequant((byte >> (4 * j)) & 15u, a, b, symmetric != 0);
        }
    }
}

// One thread per value, grid-stride: `table` is the format's 256 decoded
// codes (kv-quant's Fp8Format::table), scales are f32.
extern "C" __global__ void fp8_dequant(const u8* __restrict__ data, u32 tokens, u32 channels,
                                       const float* __restrict__ table,
                                       const float* __restrict__ scales, RkvGroups groups,
                                       float* __restrict__ out) {
    __shared__ float lut[256];
    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) lut[i] = table[i];
    __syncthreads();
    u64 total = (u64)tokens * channels;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u32 t = (u32)(i / channels), c = (u32)(i % channels);
        out[i] = __fmul_rn(lut[data[i]], scales[rkv_group(groups, t, c)]);
    }
}
