//! [`Numerics`]: how attention scores integer-coded keys and sums integer
//! values.

/// How scores against integer keys (INT8/INT4/INT3/INT2 at any
/// granularity, the ECC-protected INT4 forms, and NF4, read as levels plus
/// group parameters) are computed. Keys held as f32, half floats or FP8,
/// and tiles with erased values, are always scored exactly. Keys coded
/// before RoPE on pair codebooks ([`PairCodeRows`](crate::PairCodeRows))
/// are scored against the codebook under every setting, in f32: each score
/// is `Σ_blocks g·Σ_pairs (A·cos + B·sin)` with the table entries `A`, `B`
/// (one f32 product sum of the query pair and the centroid) and the
/// rows' angles within 4e-7 ([`Rope::trig_rows`](crate::Rope::trig_rows)),
/// held to the f64 oracle over the same keys like the exact path
/// (`tests/pair_scores.rs`).
///
/// Fast-path error bound (stated against scores computed exactly from the
/// dequantized keys): each query head `q` (already scaled by `1/√d`) is
/// coded as `q̂ = s_q·round(q / s_q)` with `s_q = max|q| / 127`, so
/// `|q_c − q̂_c| <= s_q / 2` and, for a key row whose group `g` has scale
/// `a_g` and levels `l_c`,
///
/// `|score − score_exact| <= (s_q / 2) · Σ_c |a_g(c)| · l_c`
///
/// plus f32 rounding (the integer sums themselves are exact). For
/// per-channel groups the scale is folded into the query first
/// (`q'_c = q_c·a_c`) and the levels are scored centred on
/// `m = 2^(bits−1)` (`Σ q̂·l − m·Σ q̂`, exact, with `m·Σ q'` added back in
/// f32), so the bound reads `(s'/2)·Σ_c |l_c − m|` with
/// `s' = max|q'| / 127`. If every score of a head moves by at most `Δ`,
/// its softmax weights move by a factor within `e^{±2Δ}` and its output
/// by at most `max_t |v_t| · (e^{2Δ} − 1)`; `tests/numerics.rs` checks
/// both bounds against the f64 oracle.
///
/// NF4 codes are read through an integer image, `l' = 128 + round(127·L)`
/// for the code's level `L`, as centred levels of scale `a/127`: the bound
/// above holds with `l'` for `l` and `a/127` for `a`, plus the image's own
/// rounding, `Σ_c |q_c·a_g(c)|·ε_c` with `ε_c = |L − (l' − 128)/127| <=
/// 0.0037`. That rounding is as coarse as an int8 query code, so NF4 keys
/// take the integer path under `Int8Query` only (`Int16Query` scores them
/// exactly), and NF4 values summed with integer dot products move the
/// output by at most `max|a|·0.0037` more.
///
/// Under `Int8Query`, values held as integer levels in per-token groups are
/// summed with integer dot products too: per tile, head and group, the
/// products `w_t·a_t` of the softmax weights and the row scales are coded
/// to 16 bits with the scale `S = max_t w_t·a_t / Q` (`Q = 32,767`, less for
/// very long tiles of 8-bit levels or NF4's image), so a tile's sum for a channel moves by
/// at most `(S/2)·Σ_t l_t`, and the output by at most `n·max(a·l) / (2Q)`
/// over `n` keys (weights are at most 1 and their sum at least 1). Values
/// in per-channel groups over blocks of at least 16 tokens (`int4-ch<B>`,
/// the paged cache's sealed blocks) code the weights alone, once per tile
/// and head (`S = max_t w_t / Q`), and apply each block's scales and
/// offsets per channel to the integer sums of its rows, so a channel's sum
/// moves by at most `(S/2)·Σ_t |a_tc|·l_tc`.
///
/// The default, [`Auto`](Self::Auto), takes the integer path only for the
/// layout whose perplexity it was measured to keep within 0.1% of the
/// exact path, and scores everything else exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Numerics {
    /// Per tile, by layout (the default): 4-bit affine levels in whole-row
    /// per-token groups (`int4` and its ECC-protected forms; also `int4+rot`
    /// and the INT4 middle of `+sink`/`+win` forms, the same layout but not
    /// measured) as under [`Int8Query`](Self::Int8Query); values in 4-bit
    /// per-channel groups over blocks of 16 to 128 tokens and keys in
    /// 4-bit per-channel groups read in place over blocks of 32 to 128
    /// tokens (the paged cache's sealed `int4-ch` blocks and groups) as
    /// integers too; everything else exactly; keys and values are decided
    /// apart. Chosen by measurement (`kv-eval ppl`, attention
    /// `docs/measurements.md`): `Int8Query` moved `int4` and
    /// `int4+secded84` by −0.05% and per-channel values in blocks of 64 by
    /// +0.01% on SmolLM2-135M, per-channel keys in blocks of 64 (coded by
    /// channel class) by +0.015% on Qwen2.5-Coder-0.5B, but `int8` by
    /// +0.66% and `int4-g32` by +0.80%. `int4`'s small difference is a
    /// cancellation of the score and value codings' errors, so other
    /// models may move it more.
    #[default]
    Auto,
    /// Keys dequantized to f32 in registers and dotted with the f32 query:
    /// within 1e-5 of the f64 oracle's largest |value|.
    Exact,
    /// The query quantized per head to int8 and scored with integer dot
    /// products (AVX-512 VNNI `vpdpbusd` where the configured
    /// [`Isa`](crate::Isa) has it, AVX2's `vpmaddubsw`/`vpmaddwd` or a
    /// portable loop with bit-identical results elsewhere), group scales and
    /// offsets applied once per group; integer values summed with 16-bit
    /// weight codes (`vpdpwssd`).
    Int8Query,
    /// As [`Int8Query`](Self::Int8Query) with the query coded to 16 bits
    /// (`s_q = max|q| / 32639`), split into two int8 halves
    /// `c = 256·hi + lo` scored by two integer dot products and combined
    /// exactly: 257 times the precision for twice the integer work. Values
    /// are summed in f32.
    Int16Query,
}
