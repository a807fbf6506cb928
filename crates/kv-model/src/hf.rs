//! Hugging Face checkpoints: a folder with `config.json`,
//! `model.safetensors` and `tokenizer.json`, for Llama-family
//! (`model_type` `"llama"` or `"qwen2"`, rotate-half RoPE) and GPT-2 models,
//! read with the `safetensors` crate and this crate's tokenizer.

use std::path::Path;

use attention::RopeLayout;
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::model::{
    CausalLm, Gpt2Config, Gpt2Layer, Gpt2Model, LlamaArch, LlamaConfig, LlamaLayer, LlamaModel,
    Matrix, Projection,
};
use crate::tokenizer::TextTokenizer;

/// A malformed file, found by this crate's checks.
fn malformed(context: String) -> ModelError {
    ModelError::Safetensors {
        context,
        source: None,
    }
}

/// A malformed file, found by the safetensors crate.
fn st_err(context: impl Into<String>) -> impl FnOnce(safetensors::SafeTensorError) -> ModelError {
    let context = context.into();
    move |source| ModelError::Safetensors {
        context,
        source: Some(source),
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The tensors of a `model.safetensors`, converted to f32 on request.
struct Weights<'a> {
    st: SafeTensors<'a>,
    prefix: &'static str,
}

impl Weights<'_> {
    /// Tensor `name` (with the checkpoint's prefix) as f32, checked to have `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let full = format!("{}{name}", self.prefix);
        let t = self.st.tensor(&full).map_err(st_err(full.clone()))?;
        if t.shape() != shape {
            return Err(malformed(format!(
                "{full} has shape {:?}, expected {shape:?}",
                t.shape()
            )));
        }
        let d = t.data();
        Ok(match t.dtype() {
            Dtype::F32 => d
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => d
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => d
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(malformed(format!(
                    "{full}: dtype {other:?} (F32, F16 and BF16 are read)"
                )));
            }
        })
    }

    fn has(&self, name: &str) -> bool {
        self.st.tensor(&format!("{}{name}", self.prefix)).is_ok()
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        Ok(Matrix::new(rows, cols, self.get(name, &[rows, cols])?)?)
    }
}

fn field(config: &Value, key: &str) -> Result<usize> {
    config
        .get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| ModelError::ModelFile(format!("config.json: missing integer {key}")))
}

fn float(config: &Value, key: &str, default: f64) -> f64 {
    config.get(key).and_then(Value::as_f64).unwrap_or(default)
}

/// Loads a Hugging Face folder (`config.json`, `model.safetensors`,
/// `tokenizer.json`).
pub fn load_hf(dir: &Path) -> Result<(Box<dyn CausalLm>, TextTokenizer)> {
    let config = read(&dir.join("config.json"))?;
    let weights = read(&dir.join("model.safetensors"))?;
    let path = dir.join("tokenizer.json");
    let tokenizer = std::fs::read(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    let tokenizer = TextTokenizer::from_json(&tokenizer, &path.display().to_string())?;
    load_hf_parts(&config, &weights, tokenizer)
}

/// [`load_hf`] over the three files' bytes (what the fuzz target feeds).
pub fn load_hf_bytes(
    config: &[u8],
    weights: &[u8],
    tokenizer: &[u8],
) -> Result<(Box<dyn CausalLm>, TextTokenizer)> {
    let tokenizer = TextTokenizer::from_json(tokenizer, "tokenizer.json")?;
    load_hf_parts(config, weights, tokenizer)
}

fn load_hf_parts(
    config: &[u8],
    weights: &[u8],
    tokenizer: TextTokenizer,
) -> Result<(Box<dyn CausalLm>, TextTokenizer)> {
    let config: Value = serde_json::from_slice(config)
        .map_err(|e| ModelError::ModelFile(format!("config.json: {e}")))?;
    let st = SafeTensors::deserialize(weights).map_err(st_err("model.safetensors"))?;
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    let model: Box<dyn CausalLm> = match model_type {
        "llama" => Box::new(llama(&config, st, LlamaArch::Llama)?),
        "qwen2" => Box::new(llama(&config, st, LlamaArch::Qwen2)?),
        "gpt2" => Box::new(gpt2(&config, st)?),
        other => {
            return Err(ModelError::ModelFile(format!(
                "config.json: model_type {other:?} (llama, qwen2 and gpt2 are read)"
            )));
        }
    };
    if tokenizer.vocab_size() > model.vocab() {
        return Err(ModelError::ModelFile(format!(
            "tokenizer has {} tokens, the model {}",
            tokenizer.vocab_size(),
            model.vocab()
        )));
    }
    Ok((model, tokenizer))
}

/// A `llama` or `qwen2` checkpoint (Hugging Face's rotate-half RoPE; Qwen2
/// adds biases to the Q, K and V projections).
fn llama(config: &Value, st: SafeTensors<'_>, arch: LlamaArch) -> Result<LlamaModel> {
    let dim = field(config, "hidden_size")?;
    let q_heads = field(config, "num_attention_heads")?;
    let kv_heads = field(config, "num_key_value_heads").unwrap_or(q_heads);
    if q_heads == 0 || !dim.is_multiple_of(q_heads) {
        return Err(ModelError::ModelFile(format!(
            "hidden_size {dim} is not a multiple of {q_heads} heads"
        )));
    }
    let head_dim = field(config, "head_dim").unwrap_or(dim / q_heads);
    let c = LlamaConfig {
        arch,
        vocab: field(config, "vocab_size")?,
        dim,
        layers: field(config, "num_hidden_layers")?,
        ffn: field(config, "intermediate_size")?,
        q_heads,
        kv_heads,
        head_dim,
        rope_base: float(config, "rope_theta", 10_000.0),
        rope_dims: head_dim,
        rope_layout: RopeLayout::RotateHalf,
        norm_eps: float(config, "rms_norm_eps", 1e-6) as f32,
        context: field(config, "max_position_embeddings").unwrap_or(2048),
    };
    let w = Weights { st, prefix: "" };
    let kvc = c.kv_channels();
    let layers = (0..c.layers)
        .map(|l| {
            let n = |s: &str| format!("model.layers.{l}.{s}.weight");
            let bias = |s: &str| format!("model.layers.{l}.self_attn.{s}.bias");
            let qkv_bias = match arch {
                LlamaArch::Qwen2 => Some(
                    [
                        w.get(&bias("q_proj"), &[q_heads * head_dim])?,
                        w.get(&bias("k_proj"), &[kvc])?,
                        w.get(&bias("v_proj"), &[kvc])?,
                    ]
                    .concat(),
                ),
                _ => None,
            };
            Ok(LlamaLayer {
                attn_norm: w.get(&n("input_layernorm"), &[dim])?,
                qkv: Matrix::stack(&[
                    w.matrix(&n("self_attn.q_proj"), q_heads * head_dim, dim)?,
                    w.matrix(&n("self_attn.k_proj"), kvc, dim)?,
                    w.matrix(&n("self_attn.v_proj"), kvc, dim)?,
                ])?
                .into(),
                qkv_bias,
                out: w
                    .matrix(&n("self_attn.o_proj"), dim, q_heads * head_dim)?
                    .into(),
                ffn_norm: w.get(&n("post_attention_layernorm"), &[dim])?,
                gate_up: Matrix::stack(&[
                    w.matrix(&n("mlp.gate_proj"), c.ffn, dim)?,
                    w.matrix(&n("mlp.up_proj"), c.ffn, dim)?,
                ])?
                .into(),
                down: w.matrix(&n("mlp.down_proj"), dim, c.ffn)?.into(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let embed = w.matrix("model.embed_tokens.weight", c.vocab, dim)?;
    let output = if w.has("lm_head.weight") {
        Some(w.matrix("lm_head.weight", c.vocab, dim)?)
    } else {
        None
    };
    let norm = w.get("model.norm.weight", &[dim])?;
    LlamaModel::from_parts(c, embed.into(), layers, norm, output.map(Into::into))
}

fn gpt2(config: &Value, st: SafeTensors<'_>) -> Result<Gpt2Model> {
    let c = Gpt2Config {
        vocab: field(config, "vocab_size")?,
        dim: field(config, "n_embd")?,
        layers: field(config, "n_layer")?,
        heads: field(config, "n_head")?,
        positions: field(config, "n_positions")?,
        norm_eps: float(config, "layer_norm_epsilon", 1e-5) as f32,
    };
    let act = config
        .get("activation_function")
        .and_then(Value::as_str)
        .unwrap_or("gelu_new");
    if act != "gelu_new" {
        return Err(ModelError::ModelFile(format!(
            "activation_function {act:?} (gelu_new is run)"
        )));
    }
    // OpenAI's checkpoint has bare names; re-saved ones prefix `transformer.`.
    let prefix = if st.tensor("transformer.wte.weight").is_ok() {
        "transformer."
    } else {
        ""
    };
    let w = Weights { st, prefix };
    let d = c.dim;
    let norm = |name: &str| -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((
            w.get(&format!("{name}.weight"), &[d])?,
            w.get(&format!("{name}.bias"), &[d])?,
        ))
    };
    // `Conv1D` weights are stored inputs × outputs.
    let conv = |name: &str, inputs: usize, outputs: usize| -> Result<(Projection, Vec<f32>)> {
        let weight = w.get(&format!("{name}.weight"), &[inputs, outputs])?;
        Ok((
            Matrix::new(inputs, outputs, weight)?.transpose().into(),
            w.get(&format!("{name}.bias"), &[outputs])?,
        ))
    };
    let layers = (0..c.layers)
        .map(|l| {
            Ok(Gpt2Layer {
                ln_1: norm(&format!("h.{l}.ln_1"))?,
                qkv: conv(&format!("h.{l}.attn.c_attn"), d, 3 * d)?,
                out: conv(&format!("h.{l}.attn.c_proj"), d, d)?,
                ln_2: norm(&format!("h.{l}.ln_2"))?,
                fc: conv(&format!("h.{l}.mlp.c_fc"), d, 4 * d)?,
                proj: conv(&format!("h.{l}.mlp.c_proj"), 4 * d, d)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let wte = w.matrix("wte.weight", c.vocab, d)?;
    let wpe = w.matrix("wpe.weight", c.positions, d)?;
    let ln_f = norm("ln_f")?;
    Gpt2Model::new(c, wte.into(), wpe, layers, ln_f)
}
