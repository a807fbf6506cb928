//! The Llama-family forward pass (RMSNorm, RoPE in either pair layout, GQA,
//! SwiGLU, tied or untied output head, optional Q/K/V biases) in f32, with
//! batched prefill through faer's GEMM and attention through the `attention`
//! crate, reading K and V from whatever the [`ModelCache`] (any
//! [`KvBackend`](attention::KvBackend)) stores.
//!
//! Two GGUF architectures run on it ([`LlamaArch`]): `llama` (SmolLM2 and
//! the Llama models; Q/K rows permuted by llama.cpp's converter, so RoPE
//! rotates adjacent pairs) and `qwen2` (Qwen2, Qwen2.5: biases on Q, K and
//! V, rows as trained, so RoPE rotates halves as llama.cpp's NeoX mode does).
//!
//! Weights stay as the GGUF file stores them ([`Projection::Stored`]):
//! every projection multiplies kv-model's blocks by activations quantised to
//! 8 bits per block, as llama.cpp does; types without a kernel (`Q2_K`,
//! `Q3_K`) are dequantised to f32 at load with a notice. Q, K and V share
//! one stacked projection, and so do the gate and up projections.
//! [`LlamaModel::densify`] turns every projection into f32 (faer's GEMM),
//! and a [`ProjectionHook`] may compute every product instead.

use attention::{Attention, HeadShape, Mask, ModelKvShape, Rope, RopeLayout};
use rayon::prelude::*;

use super::{
    BatchItem, CausalLm, HookSlot, ModelCache, Projection, ProjectionHook, ProjectionId,
    ProjectionKind, check_norm_eps, forward_step_keeping, forward_steps, forward_steps_keeping,
    listed, project, reference_attention,
};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::weights::{Isa, QuantMatrix, StoredLinear, WeightType, first_non_finite};

/// The member of the Llama family a model is (its GGUF
/// `general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LlamaArch {
    /// `llama`: no projection biases, adjacent-pair RoPE in GGUF files.
    Llama,
    /// `qwen2`: biases on the Q, K and V projections, rotate-half RoPE.
    Qwen2,
}

impl LlamaArch {
    /// The GGUF architecture name (also the prefix of its metadata keys).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    /// The RoPE pair layout of the architecture's GGUF files.
    pub fn gguf_rope_layout(self) -> RopeLayout {
        match self {
            Self::Llama => RopeLayout::Adjacent,
            Self::Qwen2 => RopeLayout::RotateHalf,
        }
    }
}

/// Architecture hyper-parameters of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Which member of the family (decides the projection biases).
    pub arch: LlamaArch,
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub dim: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// SwiGLU hidden width.
    pub ffn: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_base: f64,
    /// Rotated dimensions per head.
    pub rope_dims: usize,
    /// RoPE pair layout (GGUF Llama files: adjacent pairs).
    pub rope_layout: RopeLayout,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// Training context length.
    pub context: usize,
}

impl LlamaConfig {
    /// Reads the `<arch>.*` hyper-parameters of a GGUF file whose
    /// `general.architecture` is `llama` or `qwen2`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = match file.meta_str("general.architecture")? {
            "llama" => LlamaArch::Llama,
            "qwen2" => LlamaArch::Qwen2,
            other => {
                return Err(ModelError::ModelFile(format!(
                    "architecture {other:?} (this reader runs \"llama\" and \"qwen2\")"
                )));
            }
        };
        let key = |k: &str| format!("{}.{k}", arch.gguf_name());
        let u = |k: &str| file.meta_u64(&key(k)).map(|v| v as usize);
        let dim = u("embedding_length")?;
        let q_heads = u("attention.head_count")?;
        let kv_heads = u("attention.head_count_kv").unwrap_or(q_heads);
        if q_heads == 0 || dim % q_heads != 0 {
            return Err(ModelError::ModelFile(format!(
                "embedding length {dim} is not a multiple of {q_heads} heads"
            )));
        }
        if kv_heads == 0 || q_heads % kv_heads != 0 {
            return Err(ModelError::ModelFile(format!(
                "{q_heads} query heads are not a multiple of {kv_heads} KV heads"
            )));
        }
        let head_dim = dim / q_heads;
        let layers = u("block_count")?;
        if layers == 0 {
            return Err(ModelError::ModelFile(format!(
                "{} is 0: a model has at least one block",
                key("block_count")
            )));
        }
        let vocab = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => file.tensor("token_embd.weight")?.info.rows(),
        };
        Ok(Self {
            arch,
            vocab,
            dim,
            layers,
            ffn: u("feed_forward_length")?,
            q_heads,
            kv_heads,
            head_dim,
            rope_base: file.meta_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_dims: u("rope.dimension_count").unwrap_or(head_dim),
            rope_layout: arch.gguf_rope_layout(),
            norm_eps: file
                .meta_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            context: u("context_length").unwrap_or(2048),
        })
    }

    /// K (or V) channels per token: `kv_heads × head_dim`.
    pub fn kv_channels(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One transformer block's weights.
#[derive(Clone, Debug)]
pub struct LlamaLayer {
    /// RMSNorm weight before attention.
    pub attn_norm: Vec<f32>,
    /// Q, K and V projections stacked (`(q + 2·kv channels) × dim`).
    pub qkv: Projection,
    /// Biases added to the Q, K and V projections, stacked as `qkv`'s rows
    /// (Qwen2; `None` for Llama).
    pub qkv_bias: Option<Vec<f32>>,
    /// Attention output projection.
    pub out: Projection,
    /// RMSNorm weight before the MLP.
    pub ffn_norm: Vec<f32>,
    /// Gate and up projections stacked (`2·ffn × dim`).
    pub gate_up: Projection,
    /// Down projection.
    pub down: Projection,
}

/// A Llama-family model.
#[derive(Clone, Debug)]
pub struct LlamaModel {
    config: LlamaConfig,
    embed: Projection,
    layers: Vec<LlamaLayer>,
    output_norm: Vec<f32>,
    output: Option<Projection>,
    rope: Rope,
    attention: Attention,
    hook: HookSlot,
    isa: Isa,
}

/// Scratch buffers of one forward call.
struct Buffers {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attended: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
}

/// How a model file is checked when it loads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Load weights holding NaN or infinity (a fault experiment's file);
    /// by default they are refused.
    pub allow_non_finite: bool,
}

impl LlamaModel {
    /// The shape its KV backends are fitted to.
    fn kv_shape(&self) -> ModelKvShape<'_> {
        ModelKvShape {
            layers: self.config.layers,
            heads: *self.attention.shape(),
            rope: Some(&self.rope),
        }
    }

    /// Loads a `llama` or `qwen2` GGUF file, keeping every matrix as
    /// stored (norms and biases in f32), verified as
    /// [`from_gguf_with`](Self::from_gguf_with) verifies it by default.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        Self::from_gguf_with(file, &LoadOptions::default())
    }

    /// Loads a `llama` or `qwen2` GGUF file after checking it against the
    /// architecture: every tensor the file holds is one the model uses
    /// (a file whose `block_count` was lowered keeps the last block's
    /// tensors, and is refused), every tensor has the shape the
    /// hyper-parameters give it, norms and biases are F32, and no weight is
    /// NaN or infinite unless `options` allows it. (The reader has already
    /// checked that the tensors' bytes are aligned, inside the file and
    /// laid out one after another, so a changed type or offset shows.)
    pub fn from_gguf_with(file: &GgufFile, options: &LoadOptions) -> Result<Self> {
        let config = LlamaConfig::from_gguf(file)?;
        let used = std::cell::RefCell::new(std::collections::BTreeSet::new());
        let read = |name: &str| -> Result<crate::gguf::Tensor<'_>> {
            let t = file.tensor(name)?;
            used.borrow_mut().insert(name.to_string());
            if !options.allow_non_finite
                && let Ok(ty) = t.weight_type()
                && let Some(block) = first_non_finite(ty, t.data)
            {
                return Err(ModelError::ModelFile(format!(
                    "tensor {name}: block {block} holds a NaN or an infinity (a fault experiment \
                     can allow it: LoadOptions::allow_non_finite, kv-eval's \
                     --allow-non-finite-weights)"
                )));
            }
            Ok(t)
        };
        let mut converted = std::collections::BTreeSet::new();
        let mut quant = |name: &str, rows: usize, cols: usize| -> Result<QuantMatrix> {
            let t = read(name)?;
            if t.info.row_len() != cols || t.info.rows() != rows {
                return Err(ModelError::ModelFile(format!(
                    "tensor {name} is {:?}, expected {cols}×{rows}",
                    t.info.dims
                )));
            }
            let (m, dense) = t.to_quant_matrix()?.with_kernel();
            if dense && converted.insert(t.info.ty.name()) {
                eprintln!(
                    "notice: {} weights have no product kernel; they are dequantised to f32 at load",
                    t.info.ty.name()
                );
            }
            Ok(m)
        };
        let vector = |name: &str, len: usize| -> Result<Vec<f32>> {
            let t = read(name)?;
            if t.info.elements() != len as u64 || t.info.dims.len() != 1 {
                return Err(ModelError::ModelFile(format!(
                    "tensor {name} is {:?}, expected {len} values",
                    t.info.dims
                )));
            }
            if t.weight_type().ok() != Some(WeightType::F32) {
                return Err(ModelError::ModelFile(format!(
                    "tensor {name} is {}: norms and biases are stored as F32",
                    t.info.ty.name()
                )));
            }
            t.to_f32()
        };
        let mut matrix = |names: &[(&str, usize)], cols: usize| -> Result<Projection> {
            let parts = names
                .iter()
                .map(|&(n, rows)| quant(n, rows, cols))
                .collect::<Result<Vec<_>>>()?;
            Ok(Projection::Stored(StoredLinear::new(parts)?))
        };
        let c = &config;
        let kvc = c.kv_channels();
        let layers = (0..c.layers)
            .map(|l| {
                let n = |s: &str| format!("blk.{l}.{s}.weight");
                let bias = |s: &str| format!("blk.{l}.{s}.bias");
                let qkv_bias = match c.arch {
                    LlamaArch::Llama => None,
                    LlamaArch::Qwen2 => Some(
                        [
                            vector(&bias("attn_q"), c.dim)?,
                            vector(&bias("attn_k"), kvc)?,
                            vector(&bias("attn_v"), kvc)?,
                        ]
                        .concat(),
                    ),
                };
                Ok(LlamaLayer {
                    attn_norm: vector(&n("attn_norm"), c.dim)?,
                    qkv: matrix(
                        &[
                            (&n("attn_q"), c.dim),
                            (&n("attn_k"), kvc),
                            (&n("attn_v"), kvc),
                        ],
                        c.dim,
                    )?,
                    qkv_bias,
                    out: matrix(&[(&n("attn_output"), c.dim)], c.dim)?,
                    ffn_norm: vector(&n("ffn_norm"), c.dim)?,
                    gate_up: matrix(&[(&n("ffn_gate"), c.ffn), (&n("ffn_up"), c.ffn)], c.dim)?,
                    down: matrix(&[(&n("ffn_down"), c.dim)], c.ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = matrix(&[("token_embd.weight", c.vocab)], c.dim)?;
        let output = match file.tensor("output.weight") {
            Ok(_) => Some(matrix(&[("output.weight", c.vocab)], c.dim)?),
            Err(_) => None,
        };
        let output_norm = vector("output_norm.weight", c.dim)?;
        let used = used.into_inner();
        if let Some(extra) = file.tensors().iter().find(|t| !used.contains(&t.name)) {
            return Err(ModelError::ModelFile(format!(
                "tensor {} is not used by a {}-block {} model (does {}.block_count or the \
                 architecture disagree with the tensors?)",
                extra.name,
                c.layers,
                c.arch.gguf_name(),
                c.arch.gguf_name()
            )));
        }
        Self::from_parts(config, embed, layers, output_norm, output)
    }

    /// Assembles a model from its weights (tests build small random ones).
    pub fn from_parts(
        config: LlamaConfig,
        embed: Projection,
        layers: Vec<LlamaLayer>,
        output_norm: Vec<f32>,
        output: Option<Projection>,
    ) -> Result<Self> {
        let c = &config;
        if embed.rows() != c.vocab || embed.cols() != c.dim || layers.len() != c.layers {
            return Err(ModelError::Shape(
                "embedding or layer count does not fit the config".into(),
            ));
        }
        if c.q_heads * c.head_dim != c.dim {
            return Err(ModelError::Shape(
                "q_heads × head_dim must equal dim".into(),
            ));
        }
        check_norm_eps(c.norm_eps)?;
        if c.context == 0 {
            return Err(ModelError::ModelFile(
                "a training context of 0 tokens".into(),
            ));
        }
        let rope = Rope::new(c.rope_layout, c.head_dim, c.rope_dims, c.rope_base)?;
        let shape = HeadShape::new(c.q_heads, c.kv_heads, c.head_dim)?;
        let attention = reference_attention(shape)?;
        let kvc = c.kv_channels();
        for (l, layer) in layers.iter().enumerate() {
            let ok = layer.attn_norm.len() == c.dim
                && layer.ffn_norm.len() == c.dim
                && (layer.qkv.rows(), layer.qkv.cols()) == (c.dim + 2 * kvc, c.dim)
                && layer
                    .qkv_bias
                    .as_ref()
                    .is_none_or(|b| b.len() == c.dim + 2 * kvc)
                && (layer.out.rows(), layer.out.cols()) == (c.dim, c.dim)
                && (layer.gate_up.rows(), layer.gate_up.cols()) == (2 * c.ffn, c.dim)
                && (layer.down.rows(), layer.down.cols()) == (c.dim, c.ffn);
            if !ok {
                return Err(ModelError::Shape(format!(
                    "layer {l} weights do not fit the config"
                )));
            }
        }
        if output_norm.len() != c.dim
            || output
                .as_ref()
                .is_some_and(|o| o.rows() != c.vocab || o.cols() != c.dim)
        {
            return Err(ModelError::Shape(
                "output weights do not fit the config".into(),
            ));
        }
        Ok(Self {
            config,
            embed,
            layers,
            output_norm,
            output,
            rope,
            attention,
            hook: HookSlot(None),
            isa: Isa::detect(),
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The output head: its own matrix, or the token embedding where tied.
    fn output_projection(&self) -> &Projection {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// Pins the instruction set of the stored weights' products (every
    /// set computes the same bits; this changes the speed).
    pub fn set_isa(&mut self, isa: Isa) -> Result<()> {
        self.isa = isa.checked()?;
        Ok(())
    }

    /// Dequantises every projection to dense f32 (the products then run
    /// through faer's GEMM on f32 activations).
    pub fn densify(&mut self) -> Result<()> {
        for l in &mut self.layers {
            for p in [&mut l.qkv, &mut l.out, &mut l.gate_up, &mut l.down] {
                p.densify()?;
            }
        }
        self.embed.densify()?;
        if let Some(o) = &mut self.output {
            o.densify()?;
        }
        Ok(())
    }

    /// Bytes of the weights in memory (projections, embedding, norms and
    /// biases).
    pub fn weight_bytes(&self) -> usize {
        let vec = |v: &[f32]| v.len() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.out, &l.gate_up, &l.down]
                    .iter()
                    .map(|p| p.bytes())
                    .sum::<usize>()
                    + vec(&l.attn_norm)
                    + vec(&l.ffn_norm)
                    + l.qkv_bias.as_deref().map_or(0, vec)
            })
            .sum();
        layers
            + self.embed.bytes()
            + self.output.as_ref().map_or(0, Projection::bytes)
            + vec(&self.output_norm)
    }

    /// See [`CausalLm::forward`]: a batch of one.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut ModelCache<'_>,
        logits_from: usize,
    ) -> Result<Vec<f32>> {
        let mut batch = [BatchItem {
            tokens,
            cache,
            logits_from,
        }];
        let mut logits = self.forward_batch(&mut batch)?;
        Ok(logits.pop().expect("one item, one result"))
    }

    /// See [`CausalLm::forward_batch`].
    pub fn forward_batch(&self, batch: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let (c, shape) = (&self.config, self.kv_shape());
        forward_steps(batch, c.vocab, &shape, |batch| self.step(batch))
    }

    /// The forward pass of a batch inside its items' cache steps: every
    /// row of every item through each projection's one GEMM, attention per
    /// item over its own cache.
    fn step(&self, batch: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let kvc = c.kv_channels();
        // Each item's rows in the batch, and every row's position.
        let mut spans = Vec::with_capacity(batch.len());
        let mut positions = Vec::new();
        for item in batch.iter() {
            let start = item.cache.tokens();
            spans.push(positions.len()..positions.len() + item.tokens.len());
            positions.extend(start..start + item.tokens.len());
        }
        let t = positions.len();
        let mut b = Buffers {
            x: vec![0.0; t * c.dim],
            h: vec![0.0; t * c.dim],
            qkv: vec![0.0; t * (c.dim + 2 * kvc)],
            q: vec![0.0; t * c.dim],
            k: vec![0.0; t * kvc],
            v: vec![0.0; t * kvc],
            attended: vec![0.0; t * c.dim],
            gu: vec![0.0; t * 2 * c.ffn],
            act: vec![0.0; t * c.ffn],
        };
        let ids = batch.iter().flat_map(|item| item.tokens);
        for (row, &id) in b.x.chunks_exact_mut(c.dim).zip(ids) {
            let id = id as usize;
            self.embed.row_into(id, row)?;
        }
        let hook = &self.hook;
        for (l, layer) in self.layers.iter().enumerate() {
            // A layer every item's cache skips (a shallower self-speculative
            // draft) passes the hidden state through; its rows are zeros,
            // never attended.
            if batch.iter().all(|item| item.cache.skips_layer(l)) {
                b.k.fill(0.0);
                for (item, span) in batch.iter_mut().zip(&spans) {
                    let kv = span.start * kvc..span.end * kvc;
                    item.cache.append(l, &b.k[kv.clone()], &b.k[kv])?;
                }
                continue;
            }
            let id = |kind| ProjectionId::block(l, kind);
            rms_norm(&mut b.h, &b.x, &layer.attn_norm, c.norm_eps);
            project(
                &mut b.qkv,
                &b.h,
                (id(ProjectionKind::Qkv), &layer.qkv),
                false,
                hook,
                self.isa,
            )?;
            let width = c.dim + 2 * kvc;
            if let Some(bias) = &layer.qkv_bias {
                for row in b.qkv.chunks_exact_mut(width) {
                    for (x, &b) in row.iter_mut().zip(bias) {
                        *x += b;
                    }
                }
            }
            for (i, row) in b.qkv.chunks_exact(width).enumerate() {
                b.q[i * c.dim..(i + 1) * c.dim].copy_from_slice(&row[..c.dim]);
                b.k[i * kvc..(i + 1) * kvc].copy_from_slice(&row[c.dim..c.dim + kvc]);
                b.v[i * kvc..(i + 1) * kvc].copy_from_slice(&row[c.dim + kvc..]);
            }
            let rope = &self.rope;
            let rotate = |((q, k), &p): ((&mut [f32], &mut [f32]), &usize)| -> Result<()> {
                rope.apply(q, p)?;
                rope.apply(k, p)?;
                Ok(())
            };
            if t >= PARALLEL_ROWS {
                b.q.par_chunks_mut(c.dim)
                    .zip(b.k.par_chunks_mut(kvc))
                    .zip(&positions)
                    .try_for_each(rotate)?;
            } else {
                b.q.chunks_mut(c.dim)
                    .zip(b.k.chunks_mut(kvc))
                    .zip(&positions)
                    .try_for_each(rotate)?;
            }
            for (item, span) in batch.iter_mut().zip(&spans) {
                let (kv, qs) = (
                    span.start * kvc..span.end * kvc,
                    span.start * c.dim..span.end * c.dim,
                );
                item.cache.append(l, &b.k[kv.clone()], &b.v[kv])?;
                let out = item.cache.attend(
                    l,
                    &self.attention,
                    &b.q[qs.clone()],
                    &positions[span.clone()],
                    &Mask::Causal,
                )?;
                b.attended[qs].copy_from_slice(&out.out);
            }
            project(
                &mut b.x,
                &b.attended,
                (id(ProjectionKind::AttentionOut), &layer.out),
                true,
                hook,
                self.isa,
            )?;
            rms_norm(&mut b.h, &b.x, &layer.ffn_norm, c.norm_eps);
            project(
                &mut b.gu,
                &b.h,
                (id(ProjectionKind::MlpUp), &layer.gate_up),
                false,
                hook,
                self.isa,
            )?;
            for_each_row(&mut b.act, c.ffn, &b.gu, 2 * c.ffn, |a, gu| {
                let (g, u) = gu.split_at(c.ffn);
                for ((a, &g), &u) in a.iter_mut().zip(g).zip(u) {
                    *a = g / (1.0 + (-g).exp()) * u;
                }
            });
            project(
                &mut b.x,
                &b.act,
                (id(ProjectionKind::MlpDown), &layer.down),
                true,
                hook,
                self.isa,
            )?;
        }
        // The rows whose logits are asked for, through one output GEMM.
        let rows: Vec<usize> = batch
            .iter()
            .zip(&spans)
            .flat_map(|(item, span)| span.start + item.logits_from..span.end)
            .collect();
        let mut x = Vec::with_capacity(rows.len() * c.dim);
        for &r in &rows {
            x.extend_from_slice(&b.x[r * c.dim..(r + 1) * c.dim]);
        }
        let mut h = vec![0.0; x.len()];
        rms_norm(&mut h, &x, &self.output_norm, c.norm_eps);
        let mut logits = vec![0.0; rows.len() * c.vocab];
        project(
            &mut logits,
            &h,
            (ProjectionId::OUTPUT, self.output_projection()),
            false,
            hook,
            self.isa,
        )?;
        let mut rest = logits.as_slice();
        Ok(batch
            .iter()
            .zip(&spans)
            .map(|(item, span)| {
                let (mine, tail) = rest.split_at((span.len() - item.logits_from) * c.vocab);
                rest = tail;
                mine.to_vec()
            })
            .collect())
    }
}

impl CausalLm for LlamaModel {
    fn vocab(&self) -> usize {
        self.config.vocab
    }

    fn can_skip_layers(&self) -> bool {
        true
    }

    fn layers(&self) -> usize {
        self.config.layers
    }

    fn kv_channels(&self) -> usize {
        self.config.kv_channels()
    }

    fn head_dim(&self) -> usize {
        self.config.head_dim
    }

    fn rope(&self) -> Option<&Rope> {
        Some(&self.rope)
    }

    fn context(&self) -> Option<usize> {
        Some(self.config.context)
    }

    fn projections(&self) -> Vec<(ProjectionId, &Projection)> {
        listed(
            self.layers
                .iter()
                .map(|l| [&l.qkv, &l.out, &l.gate_up, &l.down]),
            self.output_projection(),
        )
    }

    fn projections_mut(&mut self) -> Vec<(ProjectionId, &mut Projection)> {
        let output = self.output.as_mut().unwrap_or(&mut self.embed);
        listed(
            self.layers
                .iter_mut()
                .map(|l| [&mut l.qkv, &mut l.out, &mut l.gate_up, &mut l.down]),
            output,
        )
    }

    fn set_projection_hook(&mut self, hook: Option<std::sync::Arc<dyn ProjectionHook>>) {
        self.hook = HookSlot(hook);
    }

    fn set_numerics(&mut self, numerics: attention::Numerics) {
        self.attention.set_numerics(numerics);
    }

    fn set_attention_isa(&mut self, isa: attention::Isa) -> Result<()> {
        Ok(self.attention.set_isa(isa)?)
    }

    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "{}: {} layers, {} heads / {} KV heads × {}, RoPE {:?} base {}; weights {:.1} MB",
            c.arch.gguf_name(),
            c.layers,
            c.q_heads,
            c.kv_heads,
            c.head_dim,
            c.rope_layout,
            c.rope_base,
            self.weight_bytes() as f64 / 1e6
        )
    }

    fn weight_bytes(&self) -> usize {
        LlamaModel::weight_bytes(self)
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut ModelCache<'_>,
        logits_from: usize,
    ) -> Result<Vec<f32>> {
        LlamaModel::forward(self, tokens, cache, logits_from)
    }

    fn forward_batch(&self, batch: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        LlamaModel::forward_batch(self, batch)
    }

    fn forward_batch_keeping(
        &self,
        batch: &mut [BatchItem<'_>],
        keep: &mut dyn FnMut(usize, &[f32]) -> usize,
    ) -> Result<Vec<Vec<f32>>> {
        let (c, shape) = (&self.config, self.kv_shape());
        forward_steps_keeping(batch, c.vocab, &shape, Some(keep), |batch| self.step(batch))
    }

    fn forward_keeping(
        &self,
        tokens: &[u32],
        cache: &mut ModelCache<'_>,
        logits_from: usize,
        keep: &mut dyn FnMut(&[f32]) -> usize,
    ) -> Result<Vec<f32>> {
        let (c, shape) = (&self.config, self.kv_shape());
        forward_step_keeping(tokens, c.vocab, logits_from, &shape, cache, keep, |cache| {
            let mut batch = [BatchItem {
                tokens,
                cache,
                logits_from,
            }];
            let mut logits = self.step(&mut batch)?;
            Ok(logits.pop().expect("one item, one result"))
        })
    }
}

/// `out = x / sqrt(mean(x²) + eps) · w` per row, the mean summed in f64 as
/// ggml's `rms_norm` does.
fn rms_norm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for_each_row(out, d, x, d, |o, x| {
        let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
        let mean = (sum / d as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
            *o = x * scale * w;
        }
    });
}

/// Rows from which the element-wise steps (norms, RoPE, activation) run on
/// the thread pool: below it, waking the pool between two GEMMs costs more
/// than the work (measured: the activation of 16 decode rows took 1.6 ms
/// in parallel, 0.09 ms on one thread). Rows are independent, so the result
/// is the same either way.
const PARALLEL_ROWS: usize = 64;

/// `f(out row, input row)` over rows of widths `ow` and `iw`.
fn for_each_row(
    out: &mut [f32],
    ow: usize,
    input: &[f32],
    iw: usize,
    f: impl Fn(&mut [f32], &[f32]) + Send + Sync,
) {
    if out.len() / ow >= PARALLEL_ROWS {
        out.par_chunks_mut(ow)
            .zip(input.par_chunks(iw))
            .for_each(|(o, i)| f(o, i));
    } else {
        out.chunks_mut(ow)
            .zip(input.chunks(iw))
            .for_each(|(o, i)| f(o, i));
    }
}
