//! Checks on the second model, Qwen2.5-Coder-0.5B-Instruct in Q4_K_M
//! (`cargo xtask fetch-model --model qwen2.5-0.5b`, which `cargo xtask test`
//! runs first), against llama.cpp on the same GGUF (llama-cpp-python
//! 0.3.36): the `qwen2` tokenizer id for id, the next-token top-k, and the
//! perplexity of the corpus's first 20 chunks of 256 tokens. Without the
//! files the tests print why and pass, except under `CI=true`, where a
//! missing model is a failure.

use kv_eval::cache::{CacheMode, KvCache};
use kv_eval::metrics::{PplMethod, RunConfig, evaluate};
use kv_eval::paths;
use kv_model::gguf::GgufFile;
use kv_model::model::{LlamaArch, LlamaModel};
use kv_model::tokenizer::{ReadLimits, TextTokenizer};

fn skip(msg: &str) {
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
    test_support::skip(
        test_support::Requirement::Data,
        "kv-eval",
        "qwen_model",
        msg,
    );
}

fn load() -> Option<(LlamaModel, TextTokenizer)> {
    let path = paths::named_model("qwen2.5-0.5b").unwrap();
    if !path.is_file() {
        skip(&format!(
            "{} is missing; run `cargo xtask fetch-model --model qwen2.5-0.5b` (or `cargo xtask test`)",
            path.display()
        ));
        return None;
    }
    let file = GgufFile::open(&path).unwrap();
    Some((
        LlamaModel::from_gguf(&file).unwrap(),
        TextTokenizer::from_gguf(&file).unwrap(),
    ))
}

fn tokenizer() -> Option<TextTokenizer> {
    let path = paths::named_model("qwen2.5-0.5b").unwrap();
    if !path.is_file() {
        skip(&format!("{} is missing", path.display()));
        return None;
    }
    Some(TextTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap())
}

fn corpus(tok: &TextTokenizer, max_tokens: Option<usize>) -> Option<Vec<u32>> {
    let path = paths::default_text();
    let Ok(file) = std::fs::File::open(&path) else {
        skip(&format!("{} is missing", path.display()));
        return None;
    };
    let limits = ReadLimits {
        max_tokens,
        ..ReadLimits::default()
    };
    Some(tok.encode_reader(file, limits).unwrap())
}

/// Ids against llama.cpp's tokenizer on the same GGUF
/// (`Llama(model, vocab_only=True).tokenize(text, add_bos=False,
/// special=False)`; the corpus through `scripts/llama_cpp_ids.py`).
#[test]
fn qwen2_tokenizer_ids_equal_llama_cpp() {
    let Some(tok) = tokenizer() else { return };
    assert!(!tok.add_bos());
    let cases: [(&str, &[u32]); 2] = [
        (
            "Hello, the world! In 2024 there're 1,234.5 cats;\n\n  they ate   at 10:30 -- naïve café, 東京 ok?\n",
            &[
                9707, 11, 279, 1879, 0, 758, 220, 17, 15, 17, 19, 1052, 2299, 220, 16, 11, 17, 18,
                19, 13, 20, 19423, 401, 220, 807, 29812, 256, 518, 220, 16, 15, 25, 18, 15, 1177,
                94880, 586, 51950, 11, 60596, 109, 46553, 5394, 5267,
            ],
        ),
        (
            "def f(x):\n    return x**2  # 3.14159 <|endoftext|>\t\tOK!!! 'tis IT'S",
            &[
                750, 282, 2075, 982, 262, 470, 856, 334, 17, 220, 671, 220, 18, 13, 16, 19, 16, 20,
                24, 82639, 8691, 723, 427, 91, 29, 197, 197, 3925, 12069, 364, 83, 285, 8700,
                13272,
            ],
        ),
    ];
    for (text, ids) in cases {
        assert_eq!(tok.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(tok.decode(ids).unwrap(), text);
    }
    let Some(ids) = corpus(&tok, None) else {
        return;
    };
    assert_eq!(ids.len(), 64_658);
    use sha2::Digest;
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let digest: String = sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        digest, "b0fe86a55c10a202d0af551f5a04cfb6b3088a0c410d2ae1b396987ab735429f",
        "the corpus ids differ from llama.cpp's"
    );
}

/// The model's shape as the issue states it, and llama.cpp's next tokens:
/// its top-8 after the prompt (f32 KV cache) is ' Paris' 14.649, ' London'
/// 10.372, ' called' 9.492, '巴黎' 9.316, ' Geneva' 8.844, ' located',
/// ' New', ' Notre'. llama.cpp quantises the activations of its Q4_K/Q5_0
/// products, so logits agree to about 0.1, not to the last bit.
#[test]
fn qwen2_next_token_top_k_matches_llama_cpp() {
    let Some((model, tok)) = load() else { return };
    let c = model.config();
    assert_eq!(c.arch, LlamaArch::Qwen2);
    assert_eq!(
        (c.layers, c.q_heads, c.kv_heads, c.head_dim, c.context),
        (24, 14, 2, 64, 32_768)
    );
    assert_eq!(c.rope_base, 1e6);
    let ids = tok.encode("The capital of France is").unwrap();
    assert_eq!(ids, [785, 6722, 315, 9625, 374]);
    let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    let logits = model.forward(&ids, &mut cache, ids.len() - 1).unwrap();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    assert_eq!(order[0], 12095, "top-1 must be ' Paris'");
    for (id, want) in [
        (12095, 14.649),
        (7148, 10.372),
        (2598, 9.492),
        (106004, 9.316),
    ] {
        assert!(
            (logits[id] - want).abs() <= 0.25,
            "logit of {id}: {} against llama.cpp's {want}",
            logits[id]
        );
    }
    let llama_top5 = [12095, 7148, 2598, 106004, 44245];
    let shared = order[..5].iter().filter(|i| llama_top5.contains(i)).count();
    assert!(
        shared >= 4,
        "top-5 {:?} shares {shared} with llama.cpp's",
        &order[..5]
    );
}

/// The perplexity of the corpus's first 20 chunks of 256 tokens
/// (llama.cpp's method) against llama.cpp's on the same chunks
/// (`scripts/llama_cpp_perplexity.py`, its running figure after 20 chunks:
/// 10.7034), within 1%. The whole corpus is measured in the README.
#[test]
fn qwen2_perplexity_of_20_chunks_matches_llama_cpp() {
    let Some((model, tok)) = load() else { return };
    let Some(ids) = corpus(&tok, Some(20 * 256)) else {
        return;
    };
    let plain = RunConfig::new(CacheMode::Plain, None);
    let m = evaluate(&model, &ids, 256, PplMethod::LlamaCpp, &[plain], |_, _| {})
        .unwrap()
        .remove(0);
    let reference = 10.7034;
    eprintln!(
        "qwen2.5-0.5b: PPL {:.4} on 20 chunks ({:+.2}% from llama.cpp), {:.1} tokens/s",
        m.ppl,
        100.0 * (m.ppl / reference - 1.0),
        m.tokens_per_second
    );
    assert_eq!(m.tokens_scored, 20 * 127);
    assert!(
        (m.ppl / reference - 1.0).abs() < 0.01,
        "PPL {} vs {reference}",
        m.ppl
    );
}
