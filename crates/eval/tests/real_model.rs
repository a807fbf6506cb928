//! Checks on the default model and corpus (fetched by `cargo xtask
//! fetch-model`, which `cargo xtask test` runs first): tokenizer ids,
//! next-token top-k against llama.cpp, incremental = batched, the clean
//! `fp32` form = the plain pass, and the clean perplexity against
//! `llama-perplexity -c 256`. Without the files the tests print why and
//! pass, except under `CI=true`, where a missing model is a failure.

use kv_eval::cache::{CacheMode, KvCache};
use kv_eval::metrics::{PplMethod, RunConfig, evaluate};
use kv_eval::paths;
use kv_model::gguf::GgufFile;
use kv_model::model::LlamaModel;
use kv_model::model::Sampling;
use kv_model::tokenizer::TextTokenizer;

fn load() -> Option<(LlamaModel, TextTokenizer)> {
    let path = paths::default_model();
    if !path.is_file() {
        let msg = format!(
            "{} is missing; run `cargo xtask fetch-model` (or `cargo xtask test`)",
            path.display()
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        test_support::skip(
            test_support::Requirement::Data,
            "kv-eval",
            "real_model",
            &msg,
        );
        return None;
    }
    let file = GgufFile::open(&path).unwrap();
    Some((
        LlamaModel::from_gguf(&file).unwrap(),
        TextTokenizer::from_gguf(&file).unwrap(),
    ))
}

fn corpus(tok: &TextTokenizer) -> Option<Vec<u32>> {
    let path = paths::default_text();
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(tok.encode(&text).unwrap()),
        Err(e) => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{}: {e}",
                path.display()
            );
            test_support::skip(
                test_support::Requirement::Data,
                "kv-eval",
                "real_model",
                &format!("{} ({e})", path.display()),
            );
            None
        }
    }
}

/// Token ids against llama.cpp's own tokenizer on the same GGUF
/// (llama-cpp-python 0.3.36, `Llama(model, vocab_only=True).tokenize(text,
/// add_bos=False, special=False)`, through
/// `crates/eval/scripts/llama_cpp_ids.py`): the pinned prompt, strings where
/// the smollm pre-tokenizer's single-digit split matters, and the whole
/// corpus by the SHA-256 of its ids as little-endian u32.
#[test]
fn tokenizer_ids_equal_llama_cpp() {
    let Some((_, tok)) = load() else { return };
    assert!(!tok.add_bos());
    let cases: [(&str, &[u32]); 5] = [
        ("The capital of France is", &[504, 3575, 282, 4649, 314]),
        (
            "x = 2024\n\n  print(x)",
            &[104, 446, 216, 34, 32, 34, 36, 8866, 1628, 24, 104, 25],
        ),
        (
            "pi is 3.14159, not 1,000,000 (2^10 = 1024)",
            &[
                9020, 314, 216, 35, 30, 33, 36, 33, 37, 41, 28, 441, 216, 33, 28, 32, 32, 32, 28,
                32, 32, 32, 365, 34, 78, 33, 32, 446, 216, 33, 32, 34, 36, 25,
            ],
        ),
        (
            "It's 10:30pm; we'll see 42nd St.",
            &[
                1589, 506, 216, 33, 32, 42, 35, 32, 11043, 43, 392, 3060, 963, 216, 36, 34, 268,
                625, 30,
            ],
        ),
        (
            "    for i in range(100):\n\tpass",
            &[
                333, 327, 2056, 281, 1845, 24, 33, 32, 32, 727, 198, 197, 5467,
            ],
        ),
    ];
    for (text, ids) in cases {
        assert_eq!(tok.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(tok.decode(ids).unwrap(), text);
    }
    if let Some(ids) = corpus(&tok) {
        assert_eq!(ids.len(), 68_341);
        let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        let digest: String = sha256(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            digest, "8ee2b602a690b72d578d1dadef141c147f908980e766a8b5371fca711f04cec3",
            "the corpus ids differ from llama.cpp's"
        );
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

#[test]
fn next_token_top_k_matches_llama_cpp() {
    let Some((model, tok)) = load() else { return };
    let ids = tok.encode("The capital of France is").unwrap();
    let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    let logits = model.forward(&ids, &mut cache, ids.len() - 1).unwrap();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let max = logits[order[0]];
    let z: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let p_paris = 1.0 / z;
    // llama.cpp's top-8 on the same file (issue 5).
    let llama_top5 = [7042, 260, 4528, 1315, 5145];
    assert_eq!(order[0], 7042, "top-1 must be ' Paris'");
    assert!(
        (logits[7042] - 17.344).abs() <= 0.25,
        "Paris logit {}",
        logits[7042]
    );
    assert!(
        (p_paris - 0.768).abs() <= 0.03,
        "Paris probability {p_paris}"
    );
    assert_eq!(order[1], 260, "top-2 must be ' the'");
    let shared = order[..5].iter().filter(|i| llama_top5.contains(i)).count();
    assert!(
        shared >= 4,
        "top-5 {:?} shares {shared} with llama.cpp's",
        &order[..5]
    );
}

#[test]
fn incremental_equals_batched_and_fp32_form_equals_plain() {
    let Some((model, tok)) = load() else { return };
    let ids = tok
        .encode(
            "def fib(n):\n    \"\"\"Return the Fibonacci series up to n.\"\"\"\n    a, b = 0, 1",
        )
        .unwrap();
    let vocab = model.config().vocab;
    let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    let batched = model.forward(&ids, &mut cache, 0).unwrap();
    let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    let mut worst = 0f32;
    for (i, &t) in ids.iter().enumerate() {
        let step = model.forward(&[t], &mut cache, 0).unwrap();
        for (a, b) in step.iter().zip(&batched[i * vocab..(i + 1) * vocab]) {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(
        worst <= 1e-4,
        "max |incremental − batched| logit difference {worst}"
    );
    let mut cache = KvCache::new(CacheMode::form("fp32".parse().unwrap()), None, 0).unwrap();
    let stored = model.forward(&ids, &mut cache, 0).unwrap();
    assert_eq!(
        stored, batched,
        "the clean fp32 form must reproduce the plain pass bit for bit"
    );
}

/// The clean perplexity over the whole corpus (266 chunks of 256 tokens)
/// against `llama-perplexity -c 256` on the same GGUF and text. The slowest
/// test of the suite (about two and a half minutes in release on 2 cores);
/// kept because it is the one end-to-end agreement with llama.cpp.
#[test]
fn clean_perplexity_matches_llama_perplexity() {
    let Some((model, tok)) = load() else { return };
    let Some(ids) = corpus(&tok) else { return };
    let plain = RunConfig::new(CacheMode::Plain, None);
    let m = evaluate(&model, &ids, 256, PplMethod::LlamaCpp, &[plain], |_, _| {})
        .unwrap()
        .remove(0);
    // `llama-perplexity -c 256` on the same GGUF and text: 10.5504 ± 0.150.
    let reference = 10.5504;
    eprintln!(
        "clean PPL {:.4} ({:+.2}% from llama.cpp), {:.1} tokens/s",
        m.ppl,
        100.0 * (m.ppl / reference - 1.0),
        m.tokens_per_second
    );
    assert_eq!(m.tokens_scored, 266 * 127);
    assert!(
        (m.ppl / reference - 1.0).abs() < 0.01,
        "PPL {} vs {reference}",
        m.ppl
    );
}

/// `pca-r64` keeps the full rank of SmolLM2's 64-channel heads: the only
/// changes are f16 bases and f16 coefficients, so the perplexity must stay
/// within 0.1% of the plain pass (bases fitted on 1,024 tokens of the
/// corpus's second half, evaluated on four windows of its first).
#[test]
fn full_rank_pca_reproduces_the_plain_perplexity() {
    use kv_eval::calibration::{Calibration, CalibrationRows, Part};
    use kv_model::model::CausalLm;
    let Some((model, tok)) = load() else { return };
    let Some(ids) = corpus(&tok) else { return };
    let rows = CalibrationRows::collect(&model, &ids[40_000..41_024], 256).unwrap();
    let form: kv_quant::CacheForm = "pca-r64".parse().unwrap();
    let cal = Calibration::fit(
        &model,
        &rows,
        "corpus tail",
        &[(form, Part::Key), (form, Part::Value)],
        kv_quant::FitOptions::default(),
    )
    .unwrap();
    assert_eq!(model.head_dim(), 64);
    let runs = [
        RunConfig::new(CacheMode::Plain, None),
        RunConfig::new(
            CacheMode::form(form).with_calibration(Some(std::sync::Arc::new(cal))),
            None,
        ),
    ];
    let m = evaluate(
        &model,
        &ids[..1024],
        256,
        PplMethod::LlamaCpp,
        &runs,
        |_, _| {},
    )
    .unwrap();
    let change = m[1].ppl / m[0].ppl - 1.0;
    eprintln!(
        "plain {:.4}, pca-r64 {:.4} ({:+.4}%)",
        m[0].ppl,
        m[1].ppl,
        100.0 * change
    );
    assert!(change.abs() < 1e-3, "{change}");
    assert!(m[1].stats.certificates.iter().any(|c| c.count > 0));
}

#[test]
fn greedy_generation_starts_paris_on_every_backend() {
    use kv_eval::backend::BackendKind;
    use kv_eval::generate::{GenerateConfig, generate};
    let Some((model, tok)) = load() else { return };
    let ids = tok.encode("The capital of France is").unwrap();
    for (backend, form) in [
        (BackendKind::Dense, "plain"),
        (BackendKind::Reencode, "plain"),
        (BackendKind::Paged { block_size: 16 }, "plain"),
        (BackendKind::Paged { block_size: 16 }, "int4+secded84"),
    ] {
        let config = GenerateConfig {
            mode: CacheMode::parse(form).unwrap(),
            backend,
            context: 64,
            max_new: 4,
            sampling: Sampling::default(),
            faults: None,
            prefill_step: None,
            eviction: None,
        };
        let g = generate(&model, &ids, &config, |_| Ok(())).unwrap();
        assert_eq!(g.tokens.len(), 4);
        let text = tok.decode(&g.tokens).unwrap();
        assert!(text.starts_with(" Paris"), "{backend:?} {form}: {text:?}");
    }
}

/// A pinned run: form, channel, BER, value counts, metadata counts.
type Pinned = (
    &'static str,
    kv_eval::cache::ChannelKind,
    f64,
    [u64; 7],
    [u64; 4],
);

/// The codec statistics of the paper's protocol (re-encode backend, BSC and
/// burst faults, values and metadata hit) on the first 768 tokens, pinned
/// to the numbers the clean-twin implementation (`StoreWithTruth`, which
/// decoded every faulted store next to its fault-free copy) produced at
/// commit 18a6454: the fault ledger that replaced it must count every
/// corrected, detected, miscorrected and silent word exactly as it did
/// (erased values may have grown since: see the loop).
/// The counts depend only on the flips (the codes are linear), not on the
/// model's floating-point values, so they are the same on every CPU.
#[test]
fn ledger_statistics_equal_the_clean_twin_numbers() {
    use kv_eval::cache::{ChannelKind, FaultSpec};
    use kv_quant::FaultTarget;
    let Some((model, tok)) = load() else { return };
    let Some(ids) = corpus(&tok) else { return };
    let forms = [
        "int4",
        "fp16",
        "fp8-e4m3",
        "int4-ch",
        "int4+hamming74",
        // Pinned with SECDED metadata, which SECDED and Golay forms had by
        // default then.
        "int4+secded84+meta-secded",
        "int4+secded84+interp+meta-secded",
        "int4+golay24+meta-secded",
        "int4+secded84+sink4+win16+meta-secded",
    ];
    let faults = [
        (ChannelKind::Bsc, 1e-3),
        (ChannelKind::Bsc, 1e-2),
        (ChannelKind::Burst, 1e-3),
    ];
    let runs: Vec<RunConfig> = forms
        .iter()
        .flat_map(|f| {
            faults.iter().map(move |&(channel, ber)| {
                RunConfig::new(
                    CacheMode::parse(f).unwrap(),
                    Some(FaultSpec {
                        channel,
                        ber,
                        seed: 7,
                        target: FaultTarget::Everything,
                        hot: None,
                    }),
                )
            })
        })
        .collect();
    // (form, channel, BER, [flips, words, corrected, detected, miscorrected,
    // silent, erased values], metadata [corrected, detected, miscorrected, silent]),
    // printed by this test at commit 18a6454.
    #[rustfmt::skip]
    let pinned: [Pinned; 27] = [
        ("int4", ChannelKind::Bsc, 1e-3, [36861, 8812800, 0, 0, 0, 35399, 0], [0, 0, 0, 1403]),
        ("int4", ChannelKind::Bsc, 1e-2, [367385, 8812800, 0, 0, 0, 347515, 0], [0, 0, 0, 13585]),
        ("int4", ChannelKind::Burst, 1e-3, [37647, 8812800, 0, 0, 0, 14481, 0], [0, 0, 0, 364]),
        ("fp16", ChannelKind::Bsc, 1e-3, [140619, 8812800, 0, 0, 0, 139616, 0], [0, 0, 0, 0]),
        ("fp16", ChannelKind::Bsc, 1e-2, [1409606, 8812800, 0, 0, 0, 1307848, 0], [0, 0, 0, 0]),
        ("fp16", ChannelKind::Burst, 1e-3, [140914, 8812800, 0, 0, 0, 35338, 0], [0, 0, 0, 0]),
        ("fp8-e4m3", ChannelKind::Bsc, 1e-3, [70555, 8812800, 0, 0, 0, 70313, 0], [0, 0, 0, 7]),
        ("fp8-e4m3", ChannelKind::Bsc, 1e-2, [704982, 8812800, 0, 0, 0, 680631, 0], [0, 0, 0, 50]),
        ("fp8-e4m3", ChannelKind::Burst, 1e-3, [71386, 8812800, 0, 0, 0, 21388, 0], [0, 0, 0, 1]),
        ("int4-ch", ChannelKind::Bsc, 1e-3, [36517, 8812800, 0, 0, 0, 35399, 0], [0, 0, 0, 1059]),
        ("int4-ch", ChannelKind::Bsc, 1e-2, [363727, 8812800, 0, 0, 0, 347515, 0], [0, 0, 0, 10227]),
        ("int4-ch", ChannelKind::Burst, 1e-3, [37258, 8812800, 0, 0, 0, 14481, 0], [0, 0, 0, 271]),
        ("int4+hamming74", ChannelKind::Bsc, 1e-3, [63953, 8812800, 61405, 0, 170, 1, 3840], [1969, 20, 0, 0]),
        ("int4+hamming74", ChannelKind::Bsc, 1e-2, [639022, 8812800, 580903, 0, 17766, 64, 352704], [16347, 1854, 71, 1]),
        ("int4+hamming74", ChannelKind::Burst, 1e-3, [65041, 8812800, 3535, 0, 12304, 3877, 59904], [67, 312, 158, 14]),
        ("int4+secded84+meta-secded", ChannelKind::Bsc, 1e-3, [72753, 8812800, 70079, 233, 1, 0, 4073], [1969, 20, 0, 0]),
        ("int4+secded84+meta-secded", ChannelKind::Bsc, 1e-2, [727098, 8812800, 656829, 23325, 476, 1, 375133], [16347, 1854, 71, 1]),
        ("int4+secded84+meta-secded", ChannelKind::Burst, 1e-3, [73604, 8812800, 3460, 9746, 7685, 497, 69593], [67, 312, 158, 14]),
        ("int4+secded84+interp+meta-secded", ChannelKind::Bsc, 1e-3, [72753, 8812800, 70079, 233, 1, 0, 4073], [1969, 20, 0, 0]),
        ("int4+secded84+interp+meta-secded", ChannelKind::Bsc, 1e-2, [727098, 8812800, 656829, 23325, 476, 1, 375133], [16347, 1854, 71, 1]),
        ("int4+secded84+interp+meta-secded", ChannelKind::Burst, 1e-3, [73604, 8812800, 3460, 9746, 7685, 497, 69593], [67, 312, 158, 14]),
        ("int4+golay24+meta-secded", ChannelKind::Bsc, 1e-3, [72753, 2937600, 69722, 0, 0, 0, 3840], [1969, 20, 0, 0]),
        ("int4+golay24+meta-secded", ChannelKind::Bsc, 1e-2, [727098, 2937600, 629007, 288, 12, 0, 353538], [16347, 1854, 71, 1]),
        ("int4+golay24+meta-secded", ChannelKind::Burst, 1e-3, [73604, 2937600, 6804, 5789, 3981, 0, 77148], [67, 312, 158, 14]),
        ("int4+sink4+win16+secded84+meta-secded", ChannelKind::Bsc, 1e-3, [89151, 10886400, 86554, 278, 1, 0, 2966], [1826, 14, 0, 0]),
        ("int4+sink4+win16+secded84+meta-secded", ChannelKind::Bsc, 1e-2, [891580, 10886400, 811585, 28904, 578, 1, 350448], [15082, 1696, 66, 1]),
        ("int4+sink4+win16+secded84+meta-secded", ChannelKind::Burst, 1e-3, [89367, 10886400, 4274, 11953, 9385, 597, 66849], [61, 288, 143, 12]),
    ];
    let m = evaluate(
        &model,
        &ids[..768],
        256,
        PplMethod::LlamaCpp,
        &runs,
        |_, _| {},
    )
    .unwrap();
    assert_eq!(m.len(), pinned.len());
    for ((run, m), (form, channel, ber, values, metadata)) in runs.iter().zip(&m).zip(pinned) {
        let s = &m.stats;
        let f = run.faults.unwrap();
        assert_eq!(
            (run.mode.label().as_str(), f.channel, f.ber),
            (form, channel, ber)
        );
        let got = s.value_counts();
        assert_eq!(
            (&got[..6], s.metadata),
            (&values[..6], metadata),
            "{form} {channel:?} {ber:e}"
        );
        // Erased values: since the twin, protected metadata that decodes to
        // an implausible scale or offset (NaN, ±∞, a negative scale) also
        // erases its group, so they can only have grown, and only where
        // metadata is protected and hit.
        assert!(got[6] >= values[6], "{form} {channel:?} {ber:e}");
        if !form.contains('+') {
            assert_eq!(got[6], values[6], "{form}");
        }
    }
}

/// Reading and tokenizing the corpus a block at a time gives the ids of
/// tokenizing it whole, id for id, with blocks small enough that the corpus
/// takes dozens of them; a token limit keeps exactly the first ids.
#[test]
fn incremental_tokenizing_equals_the_whole_text() {
    use kv_model::tokenizer::ReadLimits;
    let Some((_, tok)) = load() else { return };
    let Some(whole) = corpus(&tok) else { return };
    let text = std::fs::read(paths::default_text()).unwrap();
    for (block, max_tokens) in [(4096, None), (1000, Some(5000)), (1 << 20, Some(777))] {
        let limits = ReadLimits {
            max_tokens,
            block_bytes: block,
            ..ReadLimits::default()
        };
        let ids = tok.encode_reader(text.as_slice(), limits).unwrap();
        let want = &whole[..max_tokens.unwrap_or(whole.len()).min(whole.len())];
        assert_eq!(ids, want, "blocks of {block}, limit {max_tokens:?}");
    }
    let tiny = ReadLimits {
        max_bytes: 1000,
        ..ReadLimits::default()
    };
    assert!(tok.encode_reader(text.as_slice(), tiny).is_err());
}

/// Forms that cannot fit the model (groups or rotation blocks that do not
/// divide its channels, layers it lacks) fail right after the model loads,
/// before the corpus is read.
#[test]
fn forms_the_model_cannot_run_fail_before_the_corpus_is_read() {
    if load().is_none() {
        return;
    }
    for form in ["int4-g100", "int4+rot128", "0,99:fp16;*:int4"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-eval"))
            .args(["ppl", "--max-tokens", "300", "--form", form])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{form}");
        assert!(
            stderr.contains("cannot run on this model"),
            "{form}: {stderr}"
        );
        assert!(!stderr.contains("tokens read"), "{form}: {stderr}");
    }
}

/// The needle test on the default model: a 5-digit passkey at the start,
/// middle and end of 1,024-token haystacks of the Jargon File, with the
/// plain cache and with `int4+secded84` on the paged backend. Measured: all
/// found (docs/niah.md has the whole grid).
#[test]
fn niah_finds_the_passkey_in_1k_haystacks() {
    use kv_eval::backend::BackendKind;
    use kv_eval::generate::GenerateConfig;
    use kv_eval::niah::{Haystack, NiahConfig, run_grid};
    let Some((mut model, tok)) = load() else {
        return;
    };
    // The needles of this test were chosen on f32 weights: with the
    // stored Q4_1 weights and 8-bit activations, `int4+secded84` misses
    // one of the three at 1k (measured; plain still finds all three), a
    // shift of the model, not of the cache, which is what this test pins.
    model.densify().unwrap();
    let path = paths::default_haystack();
    if !path.is_file() {
        let msg = format!(
            "{} is missing; run `cargo xtask fetch-model`",
            path.display()
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        test_support::skip(test_support::Requirement::Data, "kv-eval", "niah", &msg);
        return;
    }
    let hay = Haystack::open(&path).unwrap().tokens(&tok, 1024).unwrap();
    let config = NiahConfig {
        lengths: vec![1024],
        depths: vec![0.0, 0.5, 1.0],
        ..NiahConfig::default()
    };
    for form in ["plain", "int4+secded84"] {
        let mode = CacheMode::parse(form).unwrap();
        let base = GenerateConfig {
            mode: mode.clone(),
            backend: BackendKind::Paged { block_size: 16 },
            context: 1024,
            max_new: 0,
            sampling: Sampling::default(),
            faults: None,
            prefill_step: None,
            eviction: None,
        };
        let base = if form == "plain" {
            GenerateConfig {
                backend: BackendKind::Dense,
                ..base
            }
        } else {
            base
        };
        let grid = run_grid(&model, &tok, &hay, &config, &mode, &base, |_| {}).unwrap();
        let answers: Vec<&str> = grid.cells.iter().map(|c| c.answer.as_str()).collect();
        assert_eq!(grid.found, 3, "{form}: {answers:?}");
    }
}

/// `top` refuses a prompt past the model's trained context before the
/// forward pass (it once ran one dense pass of 20,000 tokens).
#[test]
fn top_refuses_a_prompt_past_the_trained_context() {
    if load().is_none() {
        return;
    }
    let prompt = "word ".repeat(10_000);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-eval"))
        .args(["top", "-k", "2", "--prompt", &prompt])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("the model was trained to"), "{stderr}");
}

/// Speculative decoding on the real model (release test): 1,000 greedy
/// tokens after 200 tokens of the corpus, plain (each step's top-two
/// margin recorded) and with prompt lookup (k = 4), on the f32 cache. A
/// verification step's rows have the bits they have alone, so every
/// position should agree; where one does not, plain decoding's two best
/// logits there must be within 0.05. The margins are printed.
#[test]
fn speculative_greedy_decoding_agrees_with_plain_over_1000_positions() {
    use attention::DenseBackend;
    use kv_model::model::{
        Adapted, GenerateOptions, PromptLookup, SpeculativeOptions, generate_speculative,
    };
    let Some((model, tok)) = load() else { return };
    let Some(corpus) = corpus(&tok) else { return };
    let (prompt, n) = (&corpus[..200], 1000);
    // Plain greedy decoding, with the top-two margin of every step.
    let mut cache = Adapted(DenseBackend::new());
    let mut logits = model.forward(prompt, &mut cache, prompt.len() - 1).unwrap();
    let (mut plain, mut margins) = (Vec::new(), Vec::new());
    let greedy = Sampling::default();
    let mut rng = greedy.stream();
    while plain.len() < n {
        let next = greedy.pick(&logits, &mut rng);
        let mut sorted = logits.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        margins.push(sorted[0] - sorted[1]);
        plain.push(next);
        if plain.len() < n {
            logits = model.forward(&[next], &mut cache, 0).unwrap();
        }
    }
    let options = SpeculativeOptions {
        generate: GenerateOptions {
            context: prompt.len() + n + 1,
            max_new: n,
            sampling: greedy,
            prefill_step: None,
        },
        k: 4,
    };
    let mut spec_cache = Adapted(DenseBackend::new());
    let out = generate_speculative(
        &model,
        &mut spec_cache,
        &mut PromptLookup::default(),
        prompt,
        &options,
        |_, _: &mut Adapted<DenseBackend>| Ok::<(), kv_model::ModelError>(()),
        |_| Ok(()),
    )
    .unwrap();
    let spec = &out.generated.tokens;
    let agree = plain.iter().zip(spec).take_while(|(a, b)| a == b).count();
    let mut sorted = margins.clone();
    sorted.sort_by(f32::total_cmp);
    println!(
        "speculative (prompt lookup, k 4): {agree} of {n} positions agree with plain greedy \
         decoding; {} drafted, {} accepted, {:.2} tokens per pass; plain top-two margins: \
         smallest {:.4}, 1% {:.4}, median {:.4}",
        out.stats.drafted,
        out.stats.accepted,
        out.stats.tokens_per_pass(),
        sorted[0],
        sorted[n / 100],
        sorted[n / 2]
    );
    assert_eq!(spec.len(), n);
    if agree < n {
        println!(
            "first divergence at {agree}: plain margin {:.4}",
            margins[agree]
        );
        assert!(
            margins[agree] <= 0.05,
            "a divergence where plain decoding was sure"
        );
    }
    assert!(agree >= n * 99 / 100, "{agree} of {n}");
    assert!(out.stats.accepted > 0);
}
