//! The Shard pipeline's parameters ([`ShardSpec`], the `shard` spelling of
//! `shard-kv-compression-blog.md`), their defaults and their checks.

/// Bits per key value of a `shard` form's compressed middle when a spelling
/// gives none, in millionths (1.0 bit: the coefficient bits of a token over
/// its key channels).
pub const DEFAULT_SHARD_KEY_BUDGET: u32 = 1_000_000;

/// Principal components per bit-allocation group of a `shard` form when a
/// spelling gives none.
pub const DEFAULT_SHARD_GROUP: usize = 16;

/// Exact sink tokens of a `shard` form when a spelling gives none (the
/// blog's four attention sinks, section 7).
pub const DEFAULT_SHARD_SINK: usize = 4;

/// Exact recent tokens of a `shard` form when a spelling gives none (the
/// blog's 64-token residual window, section 7).
pub const DEFAULT_SHARD_WINDOW: usize = 64;

/// Bits of a `shard` form's decode stream when a spelling gives none (the
/// blog's lossless 8-bit stream, section 8).
pub const DEFAULT_SHARD_STREAM: u8 = 8;

/// Fewest tokens per folded chunk of a `shard` form (`-f<C>`): each chunk
/// stores its own per-component and per-channel scales.
pub const MIN_SHARD_FOLD: usize = 16;

/// Most tokens per folded chunk of a `shard` form.
pub const MAX_SHARD_FOLD: usize = 1 << 16;

/// How a `shard` form stores the values of its compressed middle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShardValues {
    /// Hadamard rotation per head, per-channel max scaling, k-means vector
    /// quantization of groups of 4 channels with 256 centroids fitted on the
    /// middle itself (2 bits per value; section 6, option 3).
    Vq,
    /// Hadamard rotation per head and NF4 (section 6, option 2; `-vnf4`).
    Nf4,
}

/// The Shard pipeline (`shard`, `shard-k0.75-g16-s4`): keys with RoPE
/// undone, projected on one per-layer PCA basis over all KV heads and
/// stored as coefficients whose bits per group of components come from a
/// dynamic program under a budget; values Hadamard-rotated and vector
/// quantized; the form's [`Segments`](super::Segments) (default 4 sink and 64 window
/// tokens) exact; tokens written after the compressed prefill in a
/// data-oblivious decode stream. Stored by the `attention` crate's
/// `ShardLayer`, from kv-lowrank's keys and this crate's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShardSpec {
    /// Coefficient bits per key value of the middle, in millionths.
    pub key_budget: u32,
    /// Principal components per bit-allocation group (a multiple of 4, so
    /// every group's codes fill whole bytes).
    pub group: usize,
    /// Most principal components considered (all key channels when `None`).
    pub rank: Option<usize>,
    /// How the middle's values are stored.
    pub values: ShardValues,
    /// Bits of the Lloyd-Max decode stream (Hadamard + Lloyd-Max per
    /// token); `None` keeps generated tokens in f16 (the blog's "off").
    pub stream: Option<u8>,
    /// The stream adds a 1-bit QJL sketch of each token's residual
    /// (`-s<b>q`, [`crate::qjl`]; `b` at most 7).
    pub stream_qjl: bool,
    /// Generated tokens are folded into the compressed middle in chunks of
    /// this many (`-f<C>`: keys on the prefill's basis and bit allocation,
    /// values on its codebook, each chunk with its own scales); `None` keeps
    /// them in the stream (the blog's choice, section 8). A prefill too
    /// short to compress has no basis to fold into: its generated tokens
    /// stay in the stream.
    pub fold: Option<usize>,
    /// The key basis comes from a calibration text (`-cal`) rather than
    /// from the prefill itself (the blog's choice).
    pub calibrated: bool,
}

impl Default for ShardSpec {
    fn default() -> Self {
        Self {
            key_budget: DEFAULT_SHARD_KEY_BUDGET,
            group: DEFAULT_SHARD_GROUP,
            rank: None,
            values: ShardValues::Vq,
            stream: Some(DEFAULT_SHARD_STREAM),
            stream_qjl: false,
            fold: None,
            calibrated: false,
        }
    }
}

impl ShardSpec {
    /// The key budget in bits per key value.
    pub fn key_bits(&self) -> f64 {
        f64::from(self.key_budget) / 1e6
    }

    /// Whether the parameters can be built (the segments and protection
    /// are checked with the rest of the form).
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let bits = self.key_bits();
        if self.key_budget == 0 || bits > 8.0 {
            return Err(format!(
                "a key budget of {bits} bits per value cannot be met (more than 0, at most 8)"
            ));
        }
        if self.group == 0 || !self.group.is_multiple_of(4) {
            return Err(format!(
                "bit-allocation groups of {} components are not a positive multiple of 4",
                self.group
            ));
        }
        if let Some(r) = self.rank
            && (r == 0 || !r.is_multiple_of(self.group))
        {
            return Err(format!(
                "a rank of {r} is not a positive multiple of the group of {}",
                self.group
            ));
        }
        match self.stream {
            Some(b) if !(1..=8).contains(&b) => {
                return Err(format!("a decode stream of {b} bits (1 to 8)"));
            }
            Some(8) if self.stream_qjl => {
                return Err("a QJL stream adds a bit to the code: -s1q to -s7q".into());
            }
            None if self.stream_qjl => {
                return Err("-soff keeps f16 rows and takes no QJL sketch".into());
            }
            _ => {}
        }
        if let Some(c) = self.fold
            && !(MIN_SHARD_FOLD..=MAX_SHARD_FOLD).contains(&c)
        {
            return Err(format!(
                "folding chunks of {c} tokens ({MIN_SHARD_FOLD} to {MAX_SHARD_FOLD})"
            ));
        }
        Ok(())
    }
}
