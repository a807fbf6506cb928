//! A small random Llama written as GGUF by the test (F32, Q8_0 and Q4_1
//! tensors), loaded back, and run: incremental = batched, the clean `fp32`
//! form = the plain pass bit for bit, seeded faults reproducible and
//! accounted for, perplexity = an f64 recomputation, and typed errors.

mod common;

use attention::{Attention, AttentionOutput, DenseBackend, KvBackend, Mask, ModelKvShape};
use kv_eval::EvalError;
use kv_eval::cache::{CacheMode, ChannelKind, FaultSpec, KvCache};
use kv_eval::metrics::{PplMethod, RunConfig, evaluate};
use kv_model::ModelError;
use kv_model::gguf::{GgufFile, GgufWriter, MetaValue};
use kv_model::model::LlamaModel;
use kv_quant::FaultTarget;

use common::tiny::{DIM, FFN, HEADS, KV_HEADS, LAYERS, VOCAB, model, run, tiny_gguf_eps, tokens};

fn form(spec: &str) -> CacheMode {
    CacheMode::form(spec.parse().unwrap())
}

fn faults(ber: f64, seed: u64) -> Option<FaultSpec> {
    Some(FaultSpec {
        channel: ChannelKind::Bsc,
        ber,
        seed,
        target: FaultTarget::Values,
        hot: None,
    })
}

#[test]
fn loads_every_tensor_type_and_reads_the_config() {
    let m = model();
    let c = m.config();
    assert_eq!((c.vocab, c.dim, c.layers, c.ffn), (VOCAB, DIM, LAYERS, FFN));
    assert_eq!(
        (c.q_heads, c.kv_heads, c.head_dim),
        (HEADS, KV_HEADS, DIM / HEADS)
    );
}

#[test]
fn incremental_decoding_equals_the_batched_pass() {
    let m = model();
    let toks = tokens(70);
    for mode in [CacheMode::Plain, form("int4+secded84"), form("fp16")] {
        let (batched, _) = run(&m, &toks, mode.clone(), None);
        let mut cache = KvCache::new(mode.clone(), None, 0).unwrap();
        let mut worst = 0f32;
        for (i, &t) in toks.iter().enumerate() {
            let step = m.forward(&[t], &mut cache, 0).unwrap();
            let row = &batched[i * VOCAB..(i + 1) * VOCAB];
            for (a, b) in step.iter().zip(row) {
                worst = worst.max((a - b).abs());
            }
        }
        assert_eq!(cache.tokens(), toks.len());
        assert!(
            worst <= 1e-4,
            "{mode:?}: max |incremental − batched| = {worst}"
        );
    }
}

/// A backend that fails the attention call of one layer, once.
struct FailOnce {
    inner: KvCache,
    layer: Option<usize>,
}

impl KvBackend for FailOnce {
    type Error = ModelError;
    fn fit(&mut self, model: &ModelKvShape<'_>) -> Result<(), ModelError> {
        self.inner.fit(model)
    }
    fn tokens(&self) -> usize {
        self.inner.tokens()
    }
    fn begin(&mut self, tokens: &[u32]) -> Result<(), ModelError> {
        self.inner.begin(tokens)
    }
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), ModelError> {
        self.inner.append(layer, k, v)
    }
    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        q: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput, ModelError> {
        if self.layer == Some(layer) {
            self.layer = None;
            return Err(ModelError::Shape("injected failure".into()));
        }
        self.inner.attend(layer, attention, q, positions, mask)
    }
    fn commit(&mut self) -> Result<(), ModelError> {
        self.inner.commit()
    }
    fn rollback(&mut self) {
        self.inner.rollback()
    }
    fn truncate(&mut self, tokens: usize) -> Result<(), ModelError> {
        self.inner.truncate(tokens)
    }
}

#[test]
fn an_error_mid_pass_leaves_the_cache_as_before_the_step() {
    let m = model();
    let toks = tokens(30);
    let (whole, _) = run(&m, &toks, form("int4+secded84"), None);
    let mut cache = FailOnce {
        inner: KvCache::new(form("int4+secded84"), None, 0).unwrap(),
        layer: None,
    };
    let first = m.forward(&toks[..20], &mut cache, 0).unwrap();
    let stats = cache.inner.stats().clone();
    cache.layer = Some(1);
    // Layer 0 appends 10 rows, then layer 1 fails: the step is rolled back.
    assert!(matches!(
        m.forward(&toks[20..], &mut cache, 0),
        Err(ModelError::Shape(_))
    ));
    assert_eq!(cache.tokens(), 20);
    assert_eq!(cache.inner.stats(), &stats);
    // Run again, the logits are those of the pass that never failed.
    let rest = m.forward(&toks[20..], &mut cache, 0).unwrap();
    let again: Vec<f32> = first.into_iter().chain(rest).collect();
    let worst = again
        .iter()
        .zip(&whole)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst <= 1e-4, "{worst}");
}

/// A `shard` form folding generated tokens: a failed step whose first
/// layer folded a chunk of its (other) tokens leaves nothing behind; the
/// retried step gives the logits of a cache that never saw it.
#[test]
fn a_rolled_back_step_leaves_no_folded_chunk() {
    let m = model();
    let toks = tokens(140);
    let spec = form("shard-k4-g4-f16+win8");
    let mut clean = KvCache::new(spec.clone(), None, 0).unwrap();
    m.forward(&toks[..100], &mut clean, 99).unwrap();
    let want = m.forward(&toks[100..116], &mut clean, 0).unwrap();
    let mut cache = FailOnce {
        inner: KvCache::new(spec, None, 0).unwrap(),
        layer: None,
    };
    m.forward(&toks[..100], &mut cache, 99).unwrap();
    cache.layer = Some(1);
    // Sixteen other tokens: layer 0 folds them as one chunk, layer 1 fails.
    assert!(m.forward(&toks[120..136], &mut cache, 0).is_err());
    let got = m.forward(&toks[100..116], &mut cache, 0).unwrap();
    assert_eq!(got, want);
}

#[test]
fn the_dense_backend_is_the_plain_pass_bit_for_bit() {
    let m = model();
    let toks = tokens(40);
    let (plain, _) = run(&m, &toks, CacheMode::Plain, None);
    let mut adapted = kv_model::model::Adapted(DenseBackend::new());
    let got: Vec<f32> = [&toks[..25], &toks[25..]]
        .into_iter()
        .flat_map(|part| m.forward(part, &mut adapted, 0).unwrap())
        .collect();
    assert_eq!(got.len(), plain.len());
    let worst = got
        .iter()
        .zip(&plain)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst <= 1e-4, "{worst}");
}

#[test]
fn clean_fp32_form_is_the_plain_pass_bit_for_bit() {
    let m = model();
    let toks = tokens(150);
    let (plain, _) = run(&m, &toks, CacheMode::Plain, None);
    let (stored, cache) = run(&m, &toks, form("fp32"), faults(0.0, 3));
    assert_eq!(plain, stored);
    assert_eq!(cache.stats().injected_flips, 0);
    assert_eq!(cache.stats().stored_values as usize, 2 * LAYERS * 150 * 16);
    // And a quantized form is not (the comparison can fail).
    let (int4, _) = run(&m, &toks, form("int4"), None);
    assert_ne!(plain, int4);
}

#[test]
fn seeded_faults_are_reproducible_and_accounted_for() {
    let m = model();
    let toks = tokens(128);
    let (a, ca) = run(&m, &toks, form("int4+secded84"), faults(1e-2, 7));
    let (b, cb) = run(&m, &toks, form("int4+secded84"), faults(1e-2, 7));
    assert_eq!(a, b);
    assert_eq!(ca.stats(), cb.stats());
    let (_, cc) = run(&m, &toks, form("int4+secded84"), faults(1e-2, 8));
    assert_ne!(ca.stats(), cc.stats());
    let s = ca.stats();
    let words = s.keys.values.words + s.values.values.words;
    assert_eq!(words as usize, 2 * LAYERS * 128 * 16);
    let hit = s.keys.values.corrected
        + s.keys.values.detected
        + s.keys.values.miscorrected
        + s.keys.values.silent
        + s.values.values.corrected
        + s.values.values.detected
        + s.values.values.miscorrected
        + s.values.values.silent;
    // Every flip lands in some word; each hit word is counted once as
    // corrected, detected, miscorrected or silent, so 0 < hit ≤ flips.
    assert!(
        s.injected_flips > 0 && hit > 0 && hit <= s.injected_flips,
        "{s:?}"
    );
    // 8-bit codewords at p = 1e-2: about 7.7% are hit, most with one flip.
    let rate = hit as f64 / words as f64;
    assert!((0.05..0.11).contains(&rate), "{rate}");
    // Unprotected INT4 counts its changed values as silent.
    let (_, u) = run(&m, &toks, form("int4"), faults(1e-2, 7));
    let us = u.stats();
    assert!(us.keys.values.silent + us.values.values.silent > 0);
    assert_eq!(us.keys.values.corrected + us.keys.values.detected, 0);
}

#[test]
fn perplexity_matches_an_f64_recomputation() {
    let m = model();
    let toks = tokens(300);
    let got = evaluate(
        &m,
        &toks,
        64,
        PplMethod::LlamaCpp,
        &[RunConfig::new(CacheMode::Plain, None)],
        |_, _| {},
    )
    .unwrap()
    .remove(0);
    let mut nll = 0.0f64;
    let mut n = 0;
    for chunk in 0..300 / 64 {
        let w = &toks[chunk * 64..(chunk + 1) * 64];
        let (logits, _) = run(&m, w, CacheMode::Plain, None);
        for j in 32..63 {
            let row: Vec<f64> = logits[j * VOCAB..(j + 1) * VOCAB]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            nll += lse - row[w[j + 1] as usize];
            n += 1;
        }
    }
    assert_eq!(got.tokens_scored, n);
    assert!(
        (got.nll_mean - nll / n as f64).abs() < 1e-6,
        "{} vs {}",
        got.nll_mean,
        nll / n as f64
    );
    approx::assert_relative_eq!(got.ppl, (nll / n as f64).exp(), max_relative = 1e-5);
    assert_eq!((got.kl_mean, got.top1_agreement), (0.0, 1.0));
}

#[test]
fn bad_input_gets_typed_errors() {
    let m = model();
    let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    assert!(matches!(
        m.forward(&[VOCAB as u32], &mut cache, 0),
        Err(ModelError::TokenId { id, vocab: VOCAB }) if id == VOCAB as u32
    ));
    assert!(matches!(
        m.forward(&[], &mut cache, 0),
        Err(ModelError::EmptyForward {
            tokens: 0,
            logits_from: 0
        })
    ));
    assert!(matches!(
        m.forward(&[1, 2], &mut cache, 3),
        Err(ModelError::EmptyForward {
            tokens: 2,
            logits_from: 3
        })
    ));
    assert!(matches!(
        KvCache::new(CacheMode::Plain, faults(1e-3, 0), 0),
        Err(EvalError::InvalidParameter { name: "faults", .. })
    ));
    assert!(matches!(
        KvCache::new(form("int4"), faults(f64::NAN, 0), 0),
        Err(EvalError::InvalidParameter { name: "ber", .. })
    ));
    assert!(matches!(
        KvCache::new(form("int4"), faults(1.5, 0), 0),
        Err(EvalError::Channel(_))
    ));
    assert!("bsc2".parse::<ChannelKind>().is_err());
    // No window fits in fewer tokens than the context.
    assert!(matches!(
        evaluate(&m, &tokens(10), 64, PplMethod::LlamaCpp, &[], |_, _| {}),
        Err(EvalError::InvalidParameter { name: "tokens", .. })
    ));
    // A file that is not a Llama.
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("gpt2".into()));
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert!(matches!(
        LlamaModel::from_gguf(&f),
        Err(ModelError::ModelFile(_))
    ));
}

#[test]
fn the_paged_backend_reproduces_reencode_for_row_local_forms() {
    use kv_eval::backend::BackendKind;
    let m = model();
    let toks = tokens(300);
    for spec in [
        "fp32",
        "fp16",
        "int8",
        "int4",
        "int4-g8",
        "int4+secded84",
        "int4+golay24+interp",
        "nf4-g16",
        "lm4+rot8",
        "int4+rot8",
        "fp8-e4m3-tok",
        "int8/int4+secded84",
        "0:int8;*:int4+hamming74",
    ] {
        let mode = CacheMode::parse(spec).unwrap();
        let runs: Vec<RunConfig> = [BackendKind::Reencode, BackendKind::Paged { block_size: 16 }]
            .into_iter()
            .map(|backend| RunConfig {
                backend,
                ..RunConfig::new(mode.clone(), None)
            })
            .collect();
        let got = evaluate(&m, &toks, 64, PplMethod::LlamaCpp, &runs, |_, _| {})
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
        let (re, paged) = (&got[0], &got[1]);
        // PPL, KL, accuracies and agreements within 1e-5 relative (1e-6
        // absolute near 0), the counts equal.
        assert!(
            approx::relative_eq!(re, paged, epsilon = 1e-6, max_relative = 1e-5),
            "{spec}: reencode {re:?}, paged {paged:?}"
        );
        assert_eq!(re.stats.words, paged.stats.words, "{spec}");
    }
}

#[test]
fn token_by_token_on_pages_equals_the_batched_pass() {
    use kv_eval::backend::paged_backend;
    use kv_model::model::Adapted;
    let m = model();
    let toks = tokens(48);
    let mode = form("int4+secded84");
    let (batched, _) = run(&m, &toks, mode.clone(), None);
    let mut cache = Adapted(paged_backend(&m, &mode, None, 16, toks.len()).unwrap());
    let mut worst = 0f32;
    for (i, &t) in toks.iter().enumerate() {
        let step = m.forward(&[t], &mut cache, 0).unwrap();
        for (a, b) in step.iter().zip(&batched[i * VOCAB..(i + 1) * VOCAB]) {
            worst = worst.max((a - b).abs());
        }
    }
    assert_eq!(cache.tokens(), toks.len());
    assert!(worst <= 1e-4, "{worst}");
    // The pool holds three blocks of 16; a 49th token is refused before any work.
    assert!(matches!(
        m.forward(&[1], &mut cache, 0).map_err(EvalError::from),
        Err(EvalError::Paged(_))
    ));
    assert_eq!(cache.tokens(), toks.len());
}

#[test]
fn generation_refuses_bad_input_before_any_work() {
    use kv_eval::backend::BackendKind;
    use kv_eval::generate::{GenerateConfig, StepFaults, generate};
    use kv_model::model::Sampling;
    let m = model();
    let good = GenerateConfig {
        mode: form("int4+secded84"),
        backend: BackendKind::Paged { block_size: 16 },
        context: 32,
        max_new: 8,
        sampling: Sampling::default(),
        faults: None,
        prefill_step: None,
        eviction: None,
    };
    let called = std::cell::Cell::new(0);
    let count = |_| {
        called.set(called.get() + 1);
        Ok(())
    };
    let g = generate(&m, &tokens(5), &good, count).unwrap();
    assert_eq!((g.tokens.len(), called.get()), (8, 8));
    // The context bounds prompt and continuation.
    let long = generate(&m, &tokens(30), &good, |_| Ok(())).unwrap();
    assert_eq!(long.tokens.len(), 3);
    // Also for a continuation asked to run without end (prompt plus
    // continuation wrapped around once, leaving a pool of no block).
    let endless = GenerateConfig {
        max_new: usize::MAX,
        ..good.clone()
    };
    let g = generate(&m, &tokens(5), &endless, |_| Ok(())).unwrap();
    assert_eq!(g.tokens.len(), 32 - 5 + 1);
    let sampled = |temperature, top_p| GenerateConfig {
        sampling: Sampling {
            temperature,
            top_p,
            seed: 1,
        },
        ..good.clone()
    };
    let bad = [
        (tokens(33), good.clone(), "prompt"),
        (vec![], good.clone(), "prompt"),
        (tokens(5), sampled(-0.1, 1.0), "temperature"),
        (tokens(5), sampled(f64::NAN, 1.0), "temperature"),
        (tokens(5), sampled(1.0, 0.0), "top-p"),
        (tokens(5), sampled(1.0, 1.5), "top-p"),
        (
            tokens(5),
            GenerateConfig {
                prefill_step: Some(0),
                ..good.clone()
            },
            "prefill-step",
        ),
        (
            tokens(5),
            GenerateConfig {
                // A channel group of 24 tokens in blocks of 16.
                mode: form("int4-ch24"),
                ..good.clone()
            },
            "form",
        ),
        (
            tokens(5),
            GenerateConfig {
                backend: BackendKind::Reencode,
                faults: Some(StepFaults {
                    channel: ChannelKind::Bsc,
                    ber_per_step: 1e-3,
                    target: FaultTarget::Values,
                    seed: 0,
                    scrub_every: None,
                }),
                ..good.clone()
            },
            "ber-per-step",
        ),
    ];
    called.set(0);
    for (prompt, config, name) in bad {
        match generate(&m, &prompt, &config, count) {
            Err(EvalError::InvalidParameter { name: n, .. }) => assert_eq!(n, name),
            Err(EvalError::Paged(paged_cache::PagedCacheError::InvalidParameter {
                name: n,
                ..
            })) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    assert_eq!(called.get(), 0);
    // Sampling is reproducible from its seed.
    let a = generate(&m, &tokens(5), &sampled(0.9, 0.8), |_| Ok(())).unwrap();
    let b = generate(&m, &tokens(5), &sampled(0.9, 0.8), |_| Ok(())).unwrap();
    assert_eq!(a.tokens, b.tokens);
}

/// Pools sized from user input are checked against the memory budget
/// before anything is allocated: a paged cache of 2^40 tokens and a batch
/// pool of 2^36 blocks are refused with the sizes, while a host tier of
/// a hundred million blocks costs nothing until used.
#[test]
fn pools_past_the_memory_budget_are_refused_before_allocating() {
    let m = model();
    let mode = form("int4+secded84");
    match kv_eval::backend::paged_backend(&m, &mode, None, 16, 1 << 40) {
        Err(EvalError::MemoryBudget {
            what, bytes, limit, ..
        }) => {
            assert!(bytes > limit, "{bytes} <= {limit}");
            assert!(what.contains("1099511627776 tokens"), "{what}");
        }
        other => panic!("{:?}", other.err()),
    }
    let config = |num_blocks, host_blocks| paged_cache::CacheConfig {
        num_blocks,
        block_size: 16,
        host_blocks,
    };
    let huge =
        kv_eval::batch::paged_cache(&m, &mode, config(1 << 36, 0), paged_cache::NoPrefixCache);
    assert!(
        matches!(huge, Err(EvalError::MemoryBudget { .. })),
        "{:?}",
        huge.err()
    );
    let host = kv_eval::batch::paged_cache(
        &m,
        &mode,
        config(64, 100_000_000),
        paged_cache::NoPrefixCache,
    )
    .unwrap();
    assert_eq!(host.host_free(), 100_000_000);
}

/// Faults in an unprotected cache are measured, not fatal: an `fp16` cache
/// whose exponents are flipped holds NaN and infinities, and generation
/// runs to its end, counting what it stored.
#[test]
fn faults_in_an_unprotected_cache_are_an_outcome_not_an_error() {
    use kv_eval::backend::BackendKind;
    use kv_eval::generate::{GenerateConfig, StepFaults, generate};
    use kv_model::model::Sampling;
    let m = model();
    let config = GenerateConfig {
        mode: form("fp16"),
        backend: BackendKind::Paged { block_size: 4 },
        context: 32,
        max_new: 12,
        sampling: Sampling::default(),
        faults: Some(StepFaults {
            channel: ChannelKind::Bsc,
            ber_per_step: 3e-2,
            target: FaultTarget::Everything,
            seed: 5,
            scrub_every: None,
        }),
        prefill_step: None,
        eviction: None,
    };
    let g = generate(&m, &tokens(6), &config, |_| Ok(())).unwrap();
    assert_eq!(g.tokens.len(), 12);
    assert!(g.injected_flips > 0);
    assert!(
        g.non_finite_stored > 0,
        "flipped fp16 exponents made no NaN or infinity"
    );
    // The same run without faults stores none.
    let clean = generate(
        &m,
        &tokens(6),
        &GenerateConfig {
            faults: None,
            ..config
        },
        |_| Ok(()),
    )
    .unwrap();
    assert_eq!(clean.non_finite_stored, 0);
}

/// A normalisation epsilon that is NaN, infinite, zero or negative is
/// refused when the model loads (it would give PPL inf without a word), and
/// a corpus that scores no prediction is an error, not PPL 1.
#[test]
fn bad_epsilons_and_empty_scores_are_errors() {
    for eps in [f32::NAN, f32::INFINITY, 0.0, -1e-5] {
        let file = GgufFile::from_bytes(tiny_gguf_eps(eps)).unwrap();
        assert!(
            matches!(LlamaModel::from_gguf(&file), Err(ModelError::ModelFile(_))),
            "{eps}"
        );
    }
    // A header of no blocks is refused at load (it was refused only at the
    // first step, as "the backend was not fitted to a model").
    let file = GgufFile::from_bytes(common::tiny::tiny_gguf_with(1e-5, 0)).unwrap();
    match LlamaModel::from_gguf(&file) {
        Err(ModelError::ModelFile(m)) => assert!(m.contains("llama.block_count is 0"), "{m}"),
        other => panic!("{other:?}"),
    }
    let m = model();
    let plain = [RunConfig::new(CacheMode::Plain, None)];
    for (n, ctx) in [(3, 4), (0, 8), (1, 4)] {
        assert!(
            evaluate(&m, &tokens(n), ctx, PplMethod::LlamaCpp, &plain, |_, _| {}).is_err(),
            "{n} tokens, ctx {ctx}"
        );
    }
}

/// With V-ABFT checks on, every projection is checked (four per layer and
/// the output), clean products raise no alarm, and the logits stay those of
/// the unchecked pass (checked products are added to the residual after
/// the GEMM instead of inside it: the last bits may differ).
#[test]
fn gemm_checks_cover_every_projection_without_false_alarms() {
    use kv_model::model::CausalLm;
    // Checked GEMMs run on f32 weights (the checks hold f32 copies of the
    // stored ones), so the unchecked pass they are compared with does too.
    let mut plain = model();
    plain.densify().unwrap();
    let ids = tokens(48);
    let run = |m: &LlamaModel| {
        let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
        CausalLm::forward(m, &ids, &mut cache, 0).unwrap()
    };
    let install = |config| {
        let mut m = model();
        let checks = kv_eval::gemm_checks::install(&mut m, Some(config))
            .unwrap()
            .expect("checks installed");
        (m, checks)
    };
    let rules: [abft_gemm::LinearRule; 3] = [
        abft_gemm::VAbft::design(abft_gemm::Precision::Fp32.e_max_ascend()).into(),
        abft_gemm::AAbft::for_precision(abft_gemm::Precision::Fp32).into(),
        abft_gemm::FixedThreshold { tau: 1e-3 }.into(),
    ];
    for rule in rules {
        let (checked, checks) = install(kv_eval::gemm_checks::GemmCheckConfig {
            rule,
            flips: None,
            correct: false,
        });
        let (a, b) = (run(&plain), run(&checked));
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "{worst}");
        let stats = checks.stats();
        assert_eq!(stats.products, 4 * LAYERS as u64 + 1);
        assert_eq!(stats.rows, 48 * (4 * LAYERS as u64 + 1));
        assert_eq!(stats.flagged, 0, "{}", rule.name());
        // A clone starts with the checks off: its products are not counted.
        let _ = run(&checked.clone());
        assert_eq!(checks.stats(), stats);
    }
    let rule = rules[0];

    // Flips injected into the products: every one is counted at its bit,
    // exponent flips are caught, low mantissa bits of large sums are not,
    // and no row without a flip fires.
    let flips = Some(kv_eval::gemm_checks::GemmFlips {
        rate: 0.01,
        seed: 3,
        site: kv_eval::gemm_checks::FlipSite::Output,
    });
    let (faulty, checks) = install(kv_eval::gemm_checks::GemmCheckConfig {
        rule,
        flips,
        correct: false,
    });
    let _ = run(&faulty);
    let s = checks.stats();
    let total: u64 = s.injected.iter().sum();
    assert!(total > 0);
    assert_eq!(s.false_alarms, 0);
    assert!(s.eligible.iter().zip(&s.injected).all(|(e, i)| e <= i));
    assert!(s.detected.iter().zip(&s.eligible).all(|(d, e)| d <= e));
    let high: (u64, u64) =
        (27..31).fold((0, 0), |(d, i), b| (d + s.detected[b], i + s.eligible[b]));
    assert_eq!(
        high.0, high.1,
        "exponent flips 27-30 must all be caught: {s:?}"
    );
    assert!(s.detected[0] < s.injected[0].max(1), "{s:?}");

    // With correction, the same flips leave products that pass: the
    // logits come back near the clean ones wherever a product had one bad row.
    let (fixed, checks) = install(kv_eval::gemm_checks::GemmCheckConfig {
        rule,
        flips: Some(kv_eval::gemm_checks::GemmFlips {
            rate: 0.0005,
            seed: 5,
            site: kv_eval::gemm_checks::FlipSite::Output,
        }),
        correct: true,
    });
    let _ = run(&fixed);
    let f = checks.stats();
    assert!(f.corrected > 0, "{f:?}");

    // Flips in running sums and in weights: every one counted, none of the
    // clean rows fires, and flips of the top exponent bit are caught far
    // more often than flips of the low mantissa bits.
    for (site, rate) in [
        (kv_eval::gemm_checks::FlipSite::Accumulator, 0.01),
        (kv_eval::gemm_checks::FlipSite::Weight, 0.0005),
    ] {
        let (faulty, checks) = install(kv_eval::gemm_checks::GemmCheckConfig {
            rule,
            flips: Some(kv_eval::gemm_checks::GemmFlips {
                rate,
                seed: 11,
                site,
            }),
            correct: false,
        });
        let _ = run(&faulty);
        let s = checks.stats();
        let share = |bits: std::ops::Range<usize>| {
            let (d, e) = bits.fold((0, 0), |(d, e), b| (d + s.detected[b], e + s.eligible[b]));
            (d as f64 / e.max(1) as f64, e)
        };
        let (high, seen_high) = share(23..31);
        let (low, seen_low) = share(0..12);
        assert!(seen_high > 0 && seen_low > 0, "{} {s:?}", site.name());
        assert!(
            high > 0.5 && low < 0.2,
            "{}: {high} {low} {s:?}",
            site.name()
        );
        assert_eq!(s.false_alarms, 0, "{}", site.name());
        assert!(s.detected.iter().zip(&s.eligible).all(|(d, e)| d <= e));
    }
}

/// The stored-weight products (Q8_0/Q4_1 blocks times 8-bit activations)
/// against the same model dequantised to f32: close logits, the same
/// next token wherever the f32 model's choice is clear; and the same
/// bits on every instruction set the CPU has.
#[test]
fn stored_weights_track_the_f32_model_and_every_isa_agrees() {
    use kv_eval::cache::CacheMode;
    use kv_model::weights::Isa;
    let ids = tokens(40);
    let stored = model();
    let mut dense = model();
    dense.densify().unwrap();
    let (a, _) = run(&stored, &ids, CacheMode::Plain, None);
    let (b, _) = run(&dense, &ids, CacheMode::Plain, None);
    for (t, (a, b)) in a.chunks_exact(VOCAB).zip(b.chunks_exact(VOCAB)).enumerate() {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 0.05 * scale, "token {t}: {worst} against {scale}");
        let top = |l: &[f32]| (0..VOCAB).max_by(|&i, &j| l[i].total_cmp(&l[j])).unwrap();
        let mut sorted = b.to_vec();
        sorted.sort_by(|x, y| y.total_cmp(x));
        if sorted[0] - sorted[1] > 2.0 * worst {
            assert_eq!(top(a), top(b), "token {t}");
        }
    }
    for isa in Isa::ALL.into_iter().filter(|i| i.is_supported()) {
        let mut pinned = model();
        pinned.set_isa(isa).unwrap();
        let (c, _) = run(&pinned, &ids, CacheMode::Plain, None);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&c), bits(&a), "{isa:?}");
    }
}

/// Speculative generation through kv-eval's backends: greedy prompt lookup
/// gives plain greedy decoding's tokens on the dense, re-encode and paged
/// backends (faults between steps included), with its drafting counted;
/// `k` of 0 is refused before any work.
#[test]
fn speculative_generation_equals_plain_greedy_on_every_backend() {
    use kv_eval::backend::BackendKind;
    use kv_eval::generate::{GenerateConfig, generate, generate_speculative};
    use kv_model::model::{PromptLookup, Sampling};
    let m = model();
    // A prompt that repeats, so lookup proposes.
    let prompt: Vec<u32> = tokens(8).into_iter().cycle().take(20).collect();
    for (mode, backend) in [
        (CacheMode::Plain, BackendKind::Dense),
        (form("int4+secded84"), BackendKind::Reencode),
        (form("int4-ch+sink4"), BackendKind::Paged { block_size: 4 }),
    ] {
        let config = GenerateConfig {
            mode,
            backend,
            context: 48,
            max_new: 16,
            sampling: Sampling::default(),
            faults: None,
            prefill_step: None,
            eviction: None,
        };
        let plain = generate(&m, &prompt, &config, |_| Ok(())).unwrap();
        let mut lookup = PromptLookup::default();
        let spec = generate_speculative(&m, &mut lookup, 3, &prompt, &config, |_| Ok(())).unwrap();
        assert_eq!(spec.tokens, plain.tokens, "{backend:?}");
        let stats = spec.speculation.expect("speculated");
        assert!(stats.drafted > 0 && stats.verify_passes < 16, "{stats:?}");
        assert!(plain.speculation.is_none());
        let refused = generate_speculative(&m, &mut lookup, 0, &prompt, &config, |_| Ok(()));
        assert!(
            matches!(
                refused,
                Err(kv_eval::EvalError::InvalidParameter { name: "k", .. })
            ),
            "{refused:?}"
        );
    }
}
