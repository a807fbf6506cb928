//! Hugging Face checkpoints written by the test itself: a random Llama in
//! the HF layout (rotate-half RoPE) must give the logits of the same weights
//! written as GGUF with Q/K rows permuted to adjacent pairs, as llama.cpp's
//! converter does; a random GPT-2 must match an f64 reference forward pass;
//! broken folders get typed errors.

mod common;

use common::Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::f16;
use kv_eval::cache::{CacheMode, KvCache};
use kv_model::ModelError;
use kv_model::gguf::{GgmlType, GgufFile, GgufWriter, MetaValue};
use kv_model::hf::load_hf;
use kv_model::model::{CausalLm, LlamaModel};
use safetensors::{Dtype, tensor::TensorView};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kv-eval-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Tensors as (name, dtype, shape, bytes).
type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn write_safetensors(path: &Path, tensors: &Tensors) {
    let views: HashMap<String, TensorView<'_>> = tensors
        .iter()
        .map(|(n, dt, shape, bytes)| {
            (
                n.clone(),
                TensorView::new(*dt, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// A byte-level BPE `tokenizer.json` over a few tokens.
fn write_tokenizer(path: &Path) {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let vocab: tokenizers::models::bpe::Vocab = ["a", "b", "c", "Ġ", "ab", "Ġc", "Ġab"]
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges = vec![
        ("a".into(), "b".into()),
        ("Ġ".into(), "c".into()),
        ("Ġ".into(), "ab".into()),
    ];
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .unwrap();
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    t.save(path, false).unwrap();
}

const V: usize = 40;
const D: usize = 32;
const HEADS: usize = 4;
const KV: usize = 2;
const HD: usize = D / HEADS;
const FFN: usize = 40;
const L: usize = 2;

/// llama.cpp's converter permutation of Q/K rows: HF's rotate-half pairs
/// (i, i + hd/2) become adjacent rows (2i, 2i + 1) within each head.
fn permute_rows(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for half in 0..2 {
            for j in 0..HD / 2 {
                let src = h * HD + half * HD / 2 + j;
                let dst = h * HD + 2 * j + half;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[test]
fn hf_llama_equals_the_gguf_twin() {
    let mut rng = Rng(42);
    let d = dir("llama");
    let mut st: Tensors = Vec::new();
    let mut gg = GgufWriter::new();
    gg.meta("general.architecture", MetaValue::String("llama".into()))
        .meta("llama.embedding_length", MetaValue::U32(D as u32))
        .meta("llama.block_count", MetaValue::U32(L as u32))
        .meta("llama.feed_forward_length", MetaValue::U32(FFN as u32))
        .meta("llama.attention.head_count", MetaValue::U32(HEADS as u32))
        .meta("llama.attention.head_count_kv", MetaValue::U32(KV as u32))
        .meta("llama.rope.freq_base", MetaValue::F32(10_000.0))
        .meta(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        )
        .meta("llama.vocab_size", MetaValue::U32(V as u32));
    // The embedding in F16 in both files (same bits).
    let embed: Vec<u8> = rng
        .vec(V * D, 1.0)
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect();
    st.push((
        "model.embed_tokens.weight".into(),
        Dtype::F16,
        vec![V, D],
        embed.clone(),
    ));
    gg.tensor(
        "token_embd.weight",
        &[D as u64, V as u64],
        GgmlType::from_name("F16").unwrap(),
        embed,
    );
    let s = 1.0 / (D as f32).sqrt();
    for l in 0..L {
        let mut both =
            |hf: &str, ggn: &str, rows: usize, cols: usize, w: Vec<f32>, permute: Option<usize>| {
                st.push((
                    format!("model.layers.{l}.{hf}.weight"),
                    Dtype::F32,
                    if cols == 1 {
                        vec![rows]
                    } else {
                        vec![rows, cols]
                    },
                    f32_bytes(&w),
                ));
                let g = permute.map_or_else(|| w.clone(), |heads| permute_rows(&w, heads, cols));
                let dims: Vec<u64> = if cols == 1 {
                    vec![rows as u64]
                } else {
                    vec![cols as u64, rows as u64]
                };
                gg.tensor_f32(&format!("blk.{l}.{ggn}.weight"), &dims, &g);
            };
        both(
            "input_layernorm",
            "attn_norm",
            D,
            1,
            rng.vec(D, 0.1).iter().map(|x| 1.0 + x).collect(),
            None,
        );
        both(
            "self_attn.q_proj",
            "attn_q",
            D,
            D,
            rng.vec(D * D, 2.0 * s),
            Some(HEADS),
        );
        both(
            "self_attn.k_proj",
            "attn_k",
            KV * HD,
            D,
            rng.vec(KV * HD * D, 2.0 * s),
            Some(KV),
        );
        both(
            "self_attn.v_proj",
            "attn_v",
            KV * HD,
            D,
            rng.vec(KV * HD * D, s),
            None,
        );
        both(
            "self_attn.o_proj",
            "attn_output",
            D,
            D,
            rng.vec(D * D, s),
            None,
        );
        both(
            "post_attention_layernorm",
            "ffn_norm",
            D,
            1,
            vec![1.0; D],
            None,
        );
        both(
            "mlp.gate_proj",
            "ffn_gate",
            FFN,
            D,
            rng.vec(FFN * D, s),
            None,
        );
        both("mlp.up_proj", "ffn_up", FFN, D, rng.vec(FFN * D, s), None);
        both(
            "mlp.down_proj",
            "ffn_down",
            D,
            FFN,
            rng.vec(D * FFN, 1.0 / (FFN as f32).sqrt()),
            None,
        );
    }
    st.push((
        "model.norm.weight".into(),
        Dtype::F32,
        vec![D],
        f32_bytes(&[1.0; D]),
    ));
    gg.tensor_f32("output_norm.weight", &[D as u64], &[1.0; D]);
    write_safetensors(&d.join("model.safetensors"), &st);
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": D, "intermediate_size": FFN,
        "num_hidden_layers": L, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": V, "tie_word_embeddings": true
    });
    std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    write_tokenizer(&d.join("tokenizer.json"));

    let (hf, tok) = load_hf(&d).unwrap();
    assert_eq!(tok.encode("ab c").unwrap(), [4, 5]);
    assert!(hf.describe().contains("RotateHalf"));
    let gguf = LlamaModel::from_gguf(&GgufFile::from_bytes(gg.to_bytes()).unwrap()).unwrap();
    let tokens: Vec<u32> = (0..50).map(|i| (i * 7 % V) as u32).collect();
    let mut c1 = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    let mut c2 = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    let a = hf.forward(&tokens, &mut c1, 0).unwrap();
    let b = CausalLm::forward(&gguf, &tokens, &mut c2, 0).unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        worst < 1e-4,
        "HF (rotate-half) and GGUF (adjacent) logits differ by {worst}"
    );
    // The command line reaches the same folder through --model.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-eval"))
        .args(["top", "--prompt", "ab c", "-k", "3", "--model"])
        .arg(&d)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("\"ab c\" -> [4, 5]"), "{stdout}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// GPT-2 weights as f32 vectors, in the HF layout (Conv1D: inputs × outputs).
struct Gpt2Weights {
    wte: Vec<f32>,
    wpe: Vec<f32>,
    layers: Vec<HashMap<&'static str, Vec<f32>>>,
    ln_f: (Vec<f32>, Vec<f32>),
}

const P: usize = 64;

fn gpt2_weights() -> Gpt2Weights {
    let mut rng = Rng(7);
    let s = 1.0 / (D as f32).sqrt();
    let layers = (0..L)
        .map(|_| {
            HashMap::from([
                (
                    "ln_1.weight",
                    rng.vec(D, 0.1).iter().map(|x| 1.0 + x).collect(),
                ),
                ("ln_1.bias", rng.vec(D, 0.1)),
                ("attn.c_attn.weight", rng.vec(D * 3 * D, 2.0 * s)),
                ("attn.c_attn.bias", rng.vec(3 * D, 0.1)),
                ("attn.c_proj.weight", rng.vec(D * D, s)),
                ("attn.c_proj.bias", rng.vec(D, 0.1)),
                ("ln_2.weight", vec![1.0; D]),
                ("ln_2.bias", vec![0.0; D]),
                ("mlp.c_fc.weight", rng.vec(D * 4 * D, s)),
                ("mlp.c_fc.bias", rng.vec(4 * D, 0.1)),
                ("mlp.c_proj.weight", rng.vec(4 * D * D, 0.5 * s)),
                ("mlp.c_proj.bias", rng.vec(D, 0.1)),
            ])
        })
        .collect();
    Gpt2Weights {
        wte: rng.vec(V * D, 1.0),
        wpe: rng.vec(P * D, 0.5),
        layers,
        ln_f: (vec![1.0; D], rng.vec(D, 0.1)),
    }
}

fn write_gpt2(d: &Path, w: &Gpt2Weights, prefix: &str) {
    let mut st: Tensors = vec![
        (
            format!("{prefix}wte.weight"),
            Dtype::F32,
            vec![V, D],
            f32_bytes(&w.wte),
        ),
        (
            format!("{prefix}wpe.weight"),
            Dtype::F32,
            vec![P, D],
            f32_bytes(&w.wpe),
        ),
        (
            format!("{prefix}ln_f.weight"),
            Dtype::F32,
            vec![D],
            f32_bytes(&w.ln_f.0),
        ),
        (
            format!("{prefix}ln_f.bias"),
            Dtype::F32,
            vec![D],
            f32_bytes(&w.ln_f.1),
        ),
    ];
    for (l, layer) in w.layers.iter().enumerate() {
        for (name, v) in layer {
            let shape = match *name {
                "attn.c_attn.weight" => vec![D, 3 * D],
                "attn.c_proj.weight" => vec![D, D],
                "mlp.c_fc.weight" => vec![D, 4 * D],
                "mlp.c_proj.weight" => vec![4 * D, D],
                _ => vec![v.len()],
            };
            st.push((
                format!("{prefix}h.{l}.{name}"),
                Dtype::F32,
                shape,
                f32_bytes(v),
            ));
        }
    }
    write_safetensors(&d.join("model.safetensors"), &st);
    let config = serde_json::json!({
        "model_type": "gpt2", "n_embd": D, "n_layer": L, "n_head": HEADS,
        "n_positions": P, "vocab_size": V, "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new"
    });
    std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    write_tokenizer(&d.join("tokenizer.json"));
}

/// The f64 reference GPT-2 forward pass: logits of every position.
fn gpt2_reference(w: &Gpt2Weights, tokens: &[u32]) -> Vec<f64> {
    let t = tokens.len();
    let ln = |x: &[f64], g: &[f32], b: &[f32]| -> Vec<f64> {
        let m = x.iter().sum::<f64>() / D as f64;
        let v = x.iter().map(|a| (a - m).powi(2)).sum::<f64>() / D as f64;
        x.iter()
            .zip(g)
            .zip(b)
            .map(|((a, &g), &b)| (a - m) / (v + 1e-5).sqrt() * f64::from(g) + f64::from(b))
            .collect()
    };
    // y = x · W + b with W inputs × outputs.
    let conv = |x: &[f64], wt: &[f32], b: &[f32], outs: usize| -> Vec<f64> {
        (0..outs)
            .map(|o| {
                f64::from(b[o])
                    + x.iter()
                        .enumerate()
                        .map(|(i, a)| a * f64::from(wt[i * outs + o]))
                        .sum::<f64>()
            })
            .collect()
    };
    let mut x: Vec<Vec<f64>> = (0..t)
        .map(|p| {
            (0..D)
                .map(|c| f64::from(w.wte[tokens[p] as usize * D + c]) + f64::from(w.wpe[p * D + c]))
                .collect()
        })
        .collect();
    for layer in &w.layers {
        let g = |n: &str| layer[n].as_slice();
        let qkv: Vec<Vec<f64>> = x
            .iter()
            .map(|r| {
                conv(
                    &ln(r, g("ln_1.weight"), g("ln_1.bias")),
                    g("attn.c_attn.weight"),
                    g("attn.c_attn.bias"),
                    3 * D,
                )
            })
            .collect();
        for i in 0..t {
            let mut att = vec![0.0; D];
            for h in 0..HEADS {
                let q = &qkv[i][h * HD..(h + 1) * HD];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        q.iter()
                            .zip(&qkv[j][D + h * HD..D + (h + 1) * HD])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (HD as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    for c in 0..HD {
                        att[h * HD + c] += (s - m).exp() / z * qkv[j][2 * D + h * HD + c];
                    }
                }
            }
            let o = conv(&att, g("attn.c_proj.weight"), g("attn.c_proj.bias"), D);
            for (a, b) in x[i].iter_mut().zip(o) {
                *a += b;
            }
        }
        for r in x.iter_mut() {
            let hidden: Vec<f64> = conv(
                &ln(r, g("ln_2.weight"), g("ln_2.bias")),
                g("mlp.c_fc.weight"),
                g("mlp.c_fc.bias"),
                4 * D,
            )
            .into_iter()
            .map(|v| {
                0.5 * v
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
            })
            .collect();
            let o = conv(&hidden, g("mlp.c_proj.weight"), g("mlp.c_proj.bias"), D);
            for (a, b) in r.iter_mut().zip(o) {
                *a += b;
            }
        }
    }
    x.iter()
        .flat_map(|r| {
            let h = ln(r, &w.ln_f.0, &w.ln_f.1);
            (0..V)
                .map(move |v| {
                    h.iter()
                        .enumerate()
                        .map(|(c, a)| a * f64::from(w.wte[v * D + c]))
                        .sum::<f64>()
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn hf_gpt2_matches_an_f64_reference() {
    let w = gpt2_weights();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 11 % V) as u32).collect();
    let want = gpt2_reference(&w, &tokens);
    for prefix in ["", "transformer."] {
        let d = dir(&format!("gpt2{}", prefix.len()));
        write_gpt2(&d, &w, prefix);
        let (model, _) = load_hf(&d).unwrap();
        assert!(model.describe().starts_with("gpt2"));
        let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
        let got = model.forward(&tokens, &mut cache, 0).unwrap();
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .fold(0f64, f64::max);
        assert!(
            worst <= 1e-5 * scale.max(1.0),
            "GPT-2 logits differ from the f64 reference by {worst} (scale {scale})"
        );
        // Incremental decoding through a stored form agrees with the batched pass.
        let mut inc = KvCache::new(CacheMode::form("fp16".parse().unwrap()), None, 0).unwrap();
        let mut batch = KvCache::new(CacheMode::form("fp16".parse().unwrap()), None, 0).unwrap();
        let all = model.forward(&tokens, &mut batch, 0).unwrap();
        for (i, &t) in tokens.iter().enumerate() {
            let step = model.forward(&[t], &mut inc, 0).unwrap();
            let diff = step
                .iter()
                .zip(&all[i * V..(i + 1) * V])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff <= 1e-4, "position {i}: {diff}");
        }
        // Past the learned positions: a typed error.
        let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
        assert!(matches!(
            model.forward(&vec![1; P + 1], &mut cache, 0),
            Err(kv_model::ModelError::InvalidParameter {
                name: "positions",
                ..
            })
        ));
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn broken_folders_get_typed_errors() {
    let d = dir("broken");
    assert!(matches!(load_hf(&d), Err(ModelError::Io { .. })));
    let w = gpt2_weights();
    write_gpt2(&d, &w, "");
    // Unknown architecture.
    std::fs::write(d.join("config.json"), r#"{"model_type": "mamba"}"#).unwrap();
    assert!(matches!(load_hf(&d), Err(ModelError::ModelFile(_))));
    // Not JSON.
    std::fs::write(d.join("config.json"), "{").unwrap();
    assert!(matches!(load_hf(&d), Err(ModelError::ModelFile(_))));
    // A config whose width disagrees with the tensors.
    let config = serde_json::json!({
        "model_type": "gpt2", "n_embd": 2 * D, "n_layer": L, "n_head": HEADS,
        "n_positions": P, "vocab_size": V
    });
    std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    assert!(matches!(load_hf(&d), Err(ModelError::Safetensors { .. })));
    // A truncated safetensors file.
    write_gpt2(&d, &w, "");
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(load_hf(&d), Err(ModelError::Safetensors { .. })));
    std::fs::write(
        d.join("model.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\xff{",
    )
    .unwrap();
    assert!(matches!(load_hf(&d), Err(ModelError::Safetensors { .. })));
    // A broken tokenizer.json.
    write_gpt2(&d, &w, "");
    std::fs::write(d.join("tokenizer.json"), "{}").unwrap();
    assert!(matches!(load_hf(&d), Err(ModelError::Tokenizer(_))));
    std::fs::remove_dir_all(&d).unwrap();
}

/// A valid GPT-2 checkpoint's three files, as bytes.
fn gpt2_files() -> &'static (Vec<u8>, Vec<u8>, Vec<u8>) {
    static FILES: std::sync::OnceLock<(Vec<u8>, Vec<u8>, Vec<u8>)> = std::sync::OnceLock::new();
    FILES.get_or_init(|| {
        let d = dir("proptest");
        write_gpt2(&d, &gpt2_weights(), "");
        let read = |name: &str| std::fs::read(d.join(name)).unwrap();
        let files = (
            read("config.json"),
            read("model.safetensors"),
            read("tokenizer.json"),
        );
        std::fs::remove_dir_all(&d).unwrap();
        files
    })
}

/// A config with each hyperparameter drawn from sane, absurd and wrong
/// values (zero, huge, negative, a string) for either architecture.
fn any_config() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let number = prop_oneof![
        Just(serde_json::json!(D)),
        Just(serde_json::json!(HEADS)),
        Just(serde_json::json!(L)),
        (0u64..200).prop_map(|n| serde_json::json!(n)),
        any::<u64>().prop_map(|n| serde_json::json!(n)),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
        any::<f64>().prop_map(|x| serde_json::json!(x)),
        Just(serde_json::json!("32")),
    ];
    let keys = [
        "n_embd",
        "n_layer",
        "n_head",
        "n_positions",
        "vocab_size",
        "layer_norm_epsilon",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
    ];
    (
        prop_oneof![Just("gpt2"), Just("llama"), Just("qwen2"), Just("bert")],
        proptest::collection::vec(number, keys.len()),
        proptest::collection::vec(any::<bool>(), keys.len()),
    )
        .prop_map(move |(arch, values, present)| {
            let mut config = serde_json::Map::new();
            config.insert("model_type".into(), arch.into());
            for ((key, value), keep) in keys.iter().zip(values).zip(present) {
                if keep {
                    config.insert((*key).into(), value);
                }
            }
            serde_json::Value::Object(config).to_string()
        })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

    /// Whatever the config says and however the weights and tokenizer bytes
    /// are corrupted, loading gives a model that runs (or refuses a forward
    /// pass with a typed error) or a typed error, never a panic or a huge
    /// allocation.
    #[test]
    fn loading_any_hf_checkpoint_never_panics(
        config in any_config(),
        keep_config in proptest::prelude::any::<bool>(),
        weight_flips in proptest::collection::vec((0usize..4096, 0u8..8), 0..3),
        cut in proptest::option::weighted(0.25, 0usize..4096),
        tokenizer_cut in proptest::option::weighted(0.25, 0usize..512),
    ) {
        let (good_config, weights, tokenizer) = gpt2_files();
        let config = if keep_config { good_config.clone() } else { config.into_bytes() };
        let mut weights = weights.clone();
        for (at, bit) in weight_flips {
            let at = at % weights.len();
            weights[at] ^= 1 << bit;
        }
        if let Some(cut) = cut {
            weights.truncate(cut.min(weights.len()));
        }
        let tokenizer = &tokenizer[..tokenizer_cut.map_or(tokenizer.len(), |c| c.min(tokenizer.len()))];
        if let Ok((model, _)) = kv_model::hf::load_hf_bytes(&config, &weights, tokenizer) {
            let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
            let _ = model.forward(&[0, 1, 2], &mut cache, 0);
        }
    }
}
