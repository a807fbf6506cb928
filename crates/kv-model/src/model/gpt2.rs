//! The GPT-2 forward pass: learned positions, pre-LayerNorm blocks with a
//! fused QKV projection and biases, multi-head attention (no RoPE) read
//! through the model's [`ModelCache`], a GELU (tanh form, `gelu_new`) MLP, and the
//! output head tied to the token embedding.

use attention::{Attention, HeadShape, Mask, ModelKvShape};
use rayon::prelude::*;

use super::{
    CausalLm, HookSlot, Matrix, ModelCache, Projection, ProjectionHook, ProjectionId,
    ProjectionKind, check_norm_eps, forward_step, forward_step_keeping, listed, project,
    reference_attention,
};
use crate::error::{ModelError, Result};
use crate::weights::Isa;

/// GPT-2 hyper-parameters (`config.json`'s `n_embd`, `n_layer`, ...).
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub dim: usize,
    /// Blocks.
    pub layers: usize,
    /// Heads.
    pub heads: usize,
    /// Learned positions.
    pub positions: usize,
    /// LayerNorm epsilon.
    pub norm_eps: f32,
}

/// One GPT-2 block's weights (each projection with its bias), matrices as
/// `outputs × inputs`.
#[derive(Clone, Debug)]
pub struct Gpt2Layer {
    /// LayerNorm before attention: weight and bias.
    pub ln_1: (Vec<f32>, Vec<f32>),
    /// Fused Q, K, V projection (`3·dim × dim`) and its bias.
    pub qkv: (Projection, Vec<f32>),
    /// Attention output projection and bias.
    pub out: (Projection, Vec<f32>),
    /// LayerNorm before the MLP.
    pub ln_2: (Vec<f32>, Vec<f32>),
    /// MLP up projection (`4·dim × dim`) and bias.
    pub fc: (Projection, Vec<f32>),
    /// MLP down projection and bias.
    pub proj: (Projection, Vec<f32>),
}

/// A GPT-2 model held in f32.
#[derive(Clone, Debug)]
pub struct Gpt2Model {
    config: Gpt2Config,
    wte: Projection,
    wpe: Matrix,
    layers: Vec<Gpt2Layer>,
    ln_f: (Vec<f32>, Vec<f32>),
    attention: Attention,
    hook: HookSlot,
    isa: Isa,
}

impl Gpt2Model {
    /// Assembles a model, checking every shape.
    pub fn new(
        config: Gpt2Config,
        wte: Projection,
        wpe: Matrix,
        layers: Vec<Gpt2Layer>,
        ln_f: (Vec<f32>, Vec<f32>),
    ) -> Result<Self> {
        let c = &config;
        let d = c.dim;
        if c.heads == 0 || !d.is_multiple_of(c.heads) {
            return Err(ModelError::Shape(format!(
                "width {d} is not a multiple of {} heads",
                c.heads
            )));
        }
        check_norm_eps(c.norm_eps)?;
        let norm_ok = |n: &(Vec<f32>, Vec<f32>)| n.0.len() == d && n.1.len() == d;
        let lin_ok = |l: &(Projection, Vec<f32>), rows: usize, cols: usize| {
            l.0.rows() == rows && l.0.cols() == cols && l.1.len() == rows
        };
        if (wte.rows(), wte.cols()) != (c.vocab, d)
            || (wpe.rows, wpe.cols) != (c.positions, d)
            || layers.len() != c.layers
            || !norm_ok(&ln_f)
        {
            return Err(ModelError::Shape(
                "GPT-2 embeddings or layer count do not fit the config".into(),
            ));
        }
        for (i, l) in layers.iter().enumerate() {
            let ok = norm_ok(&l.ln_1)
                && norm_ok(&l.ln_2)
                && lin_ok(&l.qkv, 3 * d, d)
                && lin_ok(&l.out, d, d)
                && lin_ok(&l.fc, 4 * d, d)
                && lin_ok(&l.proj, d, 4 * d);
            if !ok {
                return Err(ModelError::Shape(format!(
                    "GPT-2 layer {i} weights do not fit the config"
                )));
            }
        }
        let shape = HeadShape::new(c.heads, c.heads, d / c.heads)?;
        let attention = reference_attention(shape)?;
        Ok(Self {
            config,
            wte,
            wpe,
            layers,
            ln_f,
            attention,
            hook: HookSlot(None),
            isa: Isa::detect(),
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }
}

/// `out = (x − mean) / sqrt(var + eps) · w + b` per row (statistics in f64).
fn layer_norm(out: &mut [f32], x: &[f32], (w, b): &(Vec<f32>, Vec<f32>), eps: f32) {
    let d = w.len();
    out.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(o, x)| {
            let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
            let var = x
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / d as f64;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
                *o = ((f64::from(x) - mean) * inv) as f32 * w + b;
            }
        });
}

/// Adds `bias` to every row of `x`.
fn add_bias(x: &mut [f32], bias: &[f32]) {
    x.par_chunks_mut(bias.len()).for_each(|row| {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    });
}

/// GPT-2's `gelu_new`: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

impl CausalLm for Gpt2Model {
    fn vocab(&self) -> usize {
        self.config.vocab
    }

    fn layers(&self) -> usize {
        self.config.layers
    }

    fn kv_channels(&self) -> usize {
        self.config.dim
    }

    fn head_dim(&self) -> usize {
        self.config.dim / self.config.heads
    }

    fn context(&self) -> Option<usize> {
        Some(self.config.positions)
    }

    fn projections(&self) -> Vec<(ProjectionId, &Projection)> {
        listed(
            self.layers
                .iter()
                .map(|l| [&l.qkv.0, &l.out.0, &l.fc.0, &l.proj.0]),
            &self.wte,
        )
    }

    fn projections_mut(&mut self) -> Vec<(ProjectionId, &mut Projection)> {
        listed(
            self.layers
                .iter_mut()
                .map(|l| [&mut l.qkv.0, &mut l.out.0, &mut l.fc.0, &mut l.proj.0]),
            &mut self.wte,
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
            "gpt2: {} layers, {} heads × {}, {} positions",
            c.layers,
            c.heads,
            c.dim / c.heads,
            c.positions
        )
    }

    fn weight_bytes(&self) -> usize {
        let pair = |p: &(Projection, Vec<f32>)| p.0.bytes() + p.1.len() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                pair(&l.qkv)
                    + pair(&l.out)
                    + pair(&l.fc)
                    + pair(&l.proj)
                    + 4 * (l.ln_1.0.len() + l.ln_1.1.len() + l.ln_2.0.len() + l.ln_2.1.len())
            })
            .sum();
        layers
            + self.wte.bytes()
            + self.wpe.data.len() * 4
            + 4 * (self.ln_f.0.len() + self.ln_f.1.len())
    }

    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut ModelCache<'_>,
        logits_from: usize,
    ) -> Result<Vec<f32>> {
        let (c, shape) = (&self.config, self.kv_shape());
        forward_step(tokens, c.vocab, logits_from, &shape, cache, |cache| {
            self.step(tokens, cache, logits_from)
        })
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
            self.step(tokens, cache, logits_from)
        })
    }
}

impl Gpt2Model {
    /// The shape its KV backends are fitted to.
    fn kv_shape(&self) -> ModelKvShape<'_> {
        ModelKvShape {
            layers: self.config.layers,
            heads: *self.attention.shape(),
            rope: None,
        }
    }

    /// The forward pass inside one cache step.
    fn step(
        &self,
        tokens: &[u32],
        cache: &mut ModelCache<'_>,
        logits_from: usize,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let hook = &self.hook;
        let (t, d) = (tokens.len(), c.dim);
        let start = cache.tokens();
        if start + t > c.positions {
            return Err(ModelError::InvalidParameter {
                name: "positions",
                reason: format!(
                    "{} tokens exceed GPT-2's {} learned positions",
                    start + t,
                    c.positions
                ),
            });
        }
        let mut x = vec![0.0f32; t * d];
        for (i, (row, &id)) in x.chunks_exact_mut(d).zip(tokens).enumerate() {
            self.wte.row_into(id as usize, row)?;
            let p = start + i;
            for (o, &q) in row.iter_mut().zip(&self.wpe.data[p * d..(p + 1) * d]) {
                *o += q;
            }
        }
        let positions: Vec<usize> = (start..start + t).collect();
        let mut h = vec![0.0; t * d];
        let mut qkv = vec![0.0; t * 3 * d];
        let (mut q, mut k, mut v) = (vec![0.0; t * d], vec![0.0; t * d], vec![0.0; t * d]);
        let mut fc = vec![0.0; t * 4 * d];
        for (l, layer) in self.layers.iter().enumerate() {
            let id = |kind| ProjectionId::block(l, kind);
            layer_norm(&mut h, &x, &layer.ln_1, c.norm_eps);
            project(
                &mut qkv,
                &h,
                (id(ProjectionKind::Qkv), &layer.qkv.0),
                false,
                hook,
                self.isa,
            )?;
            add_bias(&mut qkv, &layer.qkv.1);
            for (i, row) in qkv.chunks_exact(3 * d).enumerate() {
                q[i * d..(i + 1) * d].copy_from_slice(&row[..d]);
                k[i * d..(i + 1) * d].copy_from_slice(&row[d..2 * d]);
                v[i * d..(i + 1) * d].copy_from_slice(&row[2 * d..]);
            }
            cache.append(l, &k, &v)?;
            let attended = cache.attend(l, &self.attention, &q, &positions, &Mask::Causal)?;
            add_bias(&mut x, &layer.out.1);
            project(
                &mut x,
                &attended.out,
                (id(ProjectionKind::AttentionOut), &layer.out.0),
                true,
                hook,
                self.isa,
            )?;
            layer_norm(&mut h, &x, &layer.ln_2, c.norm_eps);
            project(
                &mut fc,
                &h,
                (id(ProjectionKind::MlpUp), &layer.fc.0),
                false,
                hook,
                self.isa,
            )?;
            add_bias(&mut fc, &layer.fc.1);
            fc.par_iter_mut().for_each(|v| *v = gelu_tanh(*v));
            add_bias(&mut x, &layer.proj.1);
            project(
                &mut x,
                &fc,
                (id(ProjectionKind::MlpDown), &layer.proj.0),
                true,
                hook,
                self.isa,
            )?;
        }
        let rows = t - logits_from;
        let mut hf = vec![0.0; rows * d];
        layer_norm(&mut hf, &x[logits_from * d..], &self.ln_f, c.norm_eps);
        let mut logits = vec![0.0; rows * c.vocab];
        project(
            &mut logits,
            &hf,
            (ProjectionId::OUTPUT, &self.wte),
            false,
            hook,
            self.isa,
        )?;
        Ok(logits)
    }
}
