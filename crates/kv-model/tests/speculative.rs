//! Speculative decoding on the tiny model: a step's rows have the bits
//! they have alone, so greedy speculative output is plain greedy output
//! token for token (on the f32 oracle and on paged caches whose blocks
//! seal, with every drafter, and on hierarchical caches drafting for
//! themselves through their upper planes); sampled output has the target's
//! distribution (a chi-square test against the exact marginal); drafts
//! cut back the drafter's cache; bad settings are refused before any work.

mod common;

use attention::{DenseBackend, KvBackend};
use kv_model::ModelError;
use kv_model::model::{
    Adapted, CausalLm, Draft, Drafter, GenerateOptions, LlamaModel, ModelDrafter, PromptLookup,
    Sampling, SelfDrafter, SpeculativeOptions, generate, generate_speculative,
};
use paged_cache::{LayerSpec, PagedBackend};

use common::{LAYERS, VOCAB, model, tiny};

/// A prompt that repeats itself (prompt lookup finds matches).
fn prompt() -> Vec<u32> {
    [3u32, 17, 5, 9, 3, 17, 5, 22, 3, 17]
        .into_iter()
        .chain((0..14).map(|i| (i * 7 % VOCAB) as u32))
        .collect()
}

fn options(max_new: usize, sampling: Sampling) -> GenerateOptions {
    GenerateOptions {
        context: 64,
        max_new,
        sampling,
        prefill_step: None,
    }
}

fn no_faults<C>(_: usize, _: &mut C) -> Result<(), ModelError> {
    Ok(())
}

fn plain<C: KvBackend<Error = ModelError> + 'static>(
    m: &LlamaModel,
    mut cache: C,
    opts: &GenerateOptions,
) -> Vec<u32> {
    generate(m, &mut cache, &prompt(), opts, no_faults, |_| Ok(()))
        .unwrap()
        .tokens
}

fn speculative<C: KvBackend<Error = ModelError> + 'static>(
    m: &LlamaModel,
    mut cache: C,
    drafter: &mut dyn Drafter,
    opts: &GenerateOptions,
    k: usize,
) -> (Vec<u32>, kv_model::model::SpeculativeStats) {
    let options = SpeculativeOptions { generate: *opts, k };
    let out = generate_speculative(
        m,
        &mut cache,
        drafter,
        &prompt(),
        &options,
        no_faults,
        |_| Ok(()),
    )
    .unwrap();
    (out.generated.tokens, out.stats)
}

fn paged(m: &LlamaModel, key: &str, value: &str, block: usize) -> Adapted<PagedBackend> {
    let spec = LayerSpec {
        key: key.parse().unwrap(),
        value: value.parse().unwrap(),
        channels: m.kv_channels(),
    };
    Adapted(PagedBackend::new(&vec![spec; LAYERS], block, 40).unwrap())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every layer stored, so every product has the bits it has alone.
fn stored_model() -> LlamaModel {
    tiny(0, |_| true)
}

#[test]
fn a_steps_rows_have_the_bits_they_have_alone() {
    let m = stored_model();
    let p = prompt();
    let mut together = Adapted(DenseBackend::new());
    m.forward(&p[..10], &mut together, 0).unwrap();
    let rows = m.forward(&p[10..16], &mut together, 0).unwrap();
    let mut alone = Adapted(DenseBackend::new());
    m.forward(&p[..10], &mut alone, 0).unwrap();
    for (i, &t) in p[10..16].iter().enumerate() {
        let row = m.forward(&[t], &mut alone, 0).unwrap();
        assert_eq!(
            bits(&row),
            bits(&rows[i * VOCAB..(i + 1) * VOCAB]),
            "row {i}"
        );
    }
}

#[test]
fn greedy_speculation_is_plain_greedy_decoding_token_for_token() {
    let target = stored_model();
    let other = tiny(5_000, |_| true);
    let opts = options(30, Sampling::default());
    let want = plain(&target, Adapted(DenseBackend::new()), &opts);
    for k in [1, 3, 6] {
        // The target drafting for itself: every draft accepted.
        let mut own = ModelDrafter::new(
            &target,
            Adapted(DenseBackend::new()),
            VOCAB,
            Sampling::default(),
        )
        .unwrap();
        let (got, stats) = speculative(&target, Adapted(DenseBackend::new()), &mut own, &opts, k);
        assert_eq!(got, want, "own drafts, k {k}");
        assert_eq!(stats.accepted, stats.drafted, "k {k}");
        assert!(stats.verify_passes < 30);
        // Another model: some accepted, some not.
        let mut draft = ModelDrafter::new(
            &other,
            Adapted(DenseBackend::new()),
            VOCAB,
            Sampling::default(),
        )
        .unwrap();
        let (got, stats) = speculative(&target, Adapted(DenseBackend::new()), &mut draft, &opts, k);
        assert_eq!(got, want, "another model, k {k}");
        assert!(stats.accepted < stats.drafted, "{stats:?}");
        // Prompt lookup.
        let mut lookup = PromptLookup::default();
        let (got, _) = speculative(&target, Adapted(DenseBackend::new()), &mut lookup, &opts, k);
        assert_eq!(got, want, "prompt lookup, k {k}");
    }
}

#[test]
fn greedy_speculation_on_paged_caches_seals_what_plain_decoding_seals() {
    let target = stored_model();
    let other = tiny(5_000, |_| true);
    let opts = options(30, Sampling::default());
    for (key, value, block) in [
        ("int8", "int8", 4),
        ("int4-ch+sink4", "int4", 4),
        ("int4-ch", "int4-ch", 8),
    ] {
        let want = plain(&target, paged(&target, key, value, block), &opts);
        for k in [2, 5] {
            let mut draft = ModelDrafter::new(
                &other,
                Adapted(DenseBackend::new()),
                VOCAB,
                Sampling::default(),
            )
            .unwrap();
            let cache = paged(&target, key, value, block);
            let (got, stats) = speculative(&target, cache, &mut draft, &opts, k);
            assert_eq!(got, want, "{key}/{value} in blocks of {block}, k {k}");
            assert!(stats.accepted < stats.drafted);
            let mut lookup = PromptLookup::default();
            let cache = paged(&target, key, value, block);
            let (got, _) = speculative(&target, cache, &mut lookup, &opts, k);
            assert_eq!(got, want, "{key}/{value} lookup, k {k}");
        }
    }
}

/// A drafter that proposes the tokens of a fixed continuation and records
/// where it was asked and for how many.
struct Recording {
    continuation: Vec<u32>,
    asked: Vec<(usize, usize)>,
}

impl Drafter for Recording {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft, ModelError> {
        self.asked.push((context.len(), k));
        let from = (context.len() - prompt().len()).min(self.continuation.len());
        let tokens = self.continuation[from..].iter().copied().take(k).collect();
        Ok(Draft {
            tokens,
            probs: Vec::new(),
        })
    }
}

/// A verification never crosses the end of a block that a staged form
/// seals: its rows past the block would read it staged (exact) where plain
/// decoding's read it sealed. The drafter is asked for no more than the
/// block has room for, and not at all where the next token completes the
/// block; the output is plain decoding's, with the plain continuation's
/// own tokens drafted (all accepted). Row-local forms are not capped.
#[test]
fn a_verification_stops_where_a_staged_block_seals() {
    let target = stored_model();
    let opts = options(30, Sampling::default());
    for (key, value, block, capped) in [
        ("int4-ch+sink4", "int4", 4, true),
        ("int4-ch", "int8", 8, true),
        ("int8h-ch", "int8h", 4, true),
        ("int8", "int4", 4, false),
    ] {
        let want = plain(&target, paged(&target, key, value, block), &opts);
        let mut drafter = Recording {
            continuation: want.clone(),
            asked: Vec::new(),
        };
        let (got, stats) = speculative(
            &target,
            paged(&target, key, value, block),
            &mut drafter,
            &opts,
            6,
        );
        assert_eq!(got, want, "{key}/{value}");
        assert_eq!(stats.accepted, stats.drafted, "{key}/{value}");
        // The cache holds every token of the context but the last.
        let room = |context: usize| block - (context - 1) % block;
        let crossing = drafter.asked.iter().any(|&(context, k)| k >= room(context));
        assert_eq!(crossing, !capped, "{key}/{value}: {:?}", drafter.asked);
        assert!(!drafter.asked.is_empty());
    }
}

/// The target drafting for itself through the upper plane of a
/// hierarchical cache: output is plain greedy decoding's on the same
/// cache, most drafts are accepted, and the cache holds exactly what plain
/// decoding left (drafts never enter it). A cache without a draft view is
/// refused before any work.
#[test]
fn self_speculation_on_a_hierarchical_cache_is_plain_greedy_decoding() {
    let target = stored_model();
    let opts = options(30, Sampling::default());
    for (key, value, block) in [("int8h", "int8h-g4", 4), ("int8h-g8+secded84", "int8h", 8)] {
        let mut cache = paged(&target, key, value, block);
        let want = generate(&target, &mut cache, &prompt(), &opts, no_faults, |_| Ok(()))
            .unwrap()
            .tokens;
        let held = cache.tokens();
        for k in [2, 5] {
            let mut drafter = SelfDrafter::new(&target, Sampling::default()).unwrap();
            let mut cache = paged(&target, key, value, block);
            let options = SpeculativeOptions { generate: opts, k };
            let out = generate_speculative(
                &target,
                &mut cache,
                &mut drafter,
                &prompt(),
                &options,
                no_faults,
                |_| Ok(()),
            )
            .unwrap();
            assert_eq!(out.generated.tokens, want, "{key}/{value}, k {k}");
            let stats = out.stats;
            assert!(
                stats.accepted * 2 > stats.drafted,
                "{key}/{value}: {stats:?}"
            );
            assert_eq!(cache.tokens(), held, "{key}/{value}");
        }
    }
    // A shallower draft: fewer accepted, the same output.
    let mut cache = paged(&target, "int8h", "int8h", 4);
    let want = generate(&target, &mut cache, &prompt(), &opts, no_faults, |_| Ok(()))
        .unwrap()
        .tokens;
    let mut drafter = SelfDrafter::new(&target, Sampling::default())
        .unwrap()
        .skipping(&[1, 1])
        .unwrap();
    assert_eq!(drafter.skipped(), [1]);
    let (got, stats) = speculative(
        &target,
        paged(&target, "int8h", "int8h", 4),
        &mut drafter,
        &opts,
        3,
    );
    assert_eq!(got, want);
    assert!(stats.accepted < stats.drafted, "{stats:?}");
    let skip = |layers: &[usize]| {
        SelfDrafter::new(&target, Sampling::default())
            .unwrap()
            .skipping(layers)
    };
    assert!(skip(&[LAYERS]).is_err());
    assert!(skip(&(0..LAYERS).collect::<Vec<_>>()).is_err());
    let mut drafter = SelfDrafter::new(&target, Sampling::default()).unwrap();
    for (key, value) in [("int8", "int8h"), ("int8h", "int4")] {
        let mut cache = paged(&target, key, value, 4);
        let err = generate_speculative(
            &target,
            &mut cache,
            &mut drafter,
            &prompt(),
            &SpeculativeOptions {
                generate: opts,
                k: 3,
            },
            no_faults,
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(err.to_string().contains("keeps no draft view"), "{err}");
        assert_eq!(cache.tokens(), 0);
    }
    assert!(drafter.propose(&prompt(), 2).is_err());
}

/// Sampled speculation draws the second generated token from the target's
/// marginal `Σ_t p(t | prompt)·p(· | prompt, t)`: a chi-square test over
/// 2,000 seeded runs (fixed seeds: the outcome is reproducible). The
/// drafter samples the other model at temperature 0.3, far from the
/// target's distribution, so rejections and residual draws are frequent.
#[test]
fn sampled_speculation_has_the_targets_distribution() {
    let target = model();
    let other = tiny(9_000, |_| true);
    let sampling = |seed| Sampling {
        temperature: 1.0,
        top_p: 1.0,
        seed,
    };
    let p = prompt();
    let dist = |tokens: &[u32]| {
        let mut cache = Adapted(DenseBackend::new());
        let logits = target
            .forward(tokens, &mut cache, tokens.len() - 1)
            .unwrap();
        sampling(0).distribution(&logits).unwrap()
    };
    let first = dist(&p);
    let mut marginal = vec![0.0; VOCAB];
    for (t, &pt) in first.iter().enumerate() {
        let mut ctx = p.clone();
        ctx.push(t as u32);
        for (m, q) in marginal.iter_mut().zip(dist(&ctx)) {
            *m += pt * q;
        }
    }
    let runs = 2_000;
    let mut counts = vec![0usize; VOCAB];
    let mut rejected = 0;
    for seed in 0..runs {
        let opts = options(3, sampling(seed));
        let mut draft = ModelDrafter::new(
            &other,
            Adapted(DenseBackend::new()),
            VOCAB,
            sampling(seed + 77),
        )
        .unwrap();
        let (got, stats) = speculative(&target, Adapted(DenseBackend::new()), &mut draft, &opts, 1);
        counts[got[1] as usize] += 1;
        rejected += stats.drafted - stats.accepted;
    }
    assert!(
        rejected > runs / 4,
        "the draft model must disagree often: {rejected}"
    );
    // Cells with an expected count of at least 5; the rest pooled.
    let (mut chi2, mut cells, mut pooled) = (0.0, 0usize, (0.0, 0usize));
    for (m, &c) in marginal.iter().zip(&counts) {
        let e = m * runs as f64;
        if e >= 5.0 {
            chi2 += (c as f64 - e).powi(2) / e;
            cells += 1;
        } else {
            pooled.0 += e;
            pooled.1 += c;
        }
    }
    if pooled.0 > 0.0 {
        chi2 += (pooled.1 as f64 - pooled.0).powi(2) / pooled.0;
        cells += 1;
    }
    // The 99.9% point of chi-square with `cells − 1` degrees of freedom
    // (Wilson–Hilferty), so a correct sampler fails one seed set in 1,000.
    let df = (cells - 1) as f64;
    let z = 3.09;
    let bound = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    assert!(
        chi2 < bound,
        "chi2 {chi2:.1} over {cells} cells, bound {bound:.1}"
    );
}

#[test]
fn prompt_lookup_proposes_what_followed_the_latest_match() {
    let mut lookup = PromptLookup::new(1, 3).unwrap();
    // "3 17" occurs at 0 and 4; the latest is at 4, followed by 5 22.
    let ctx = [3, 17, 5, 9, 3, 17, 5, 22, 3, 17];
    let draft = lookup.propose(&ctx, 2).unwrap();
    assert_eq!(draft.tokens, [5, 22]);
    assert!(draft.probs.is_empty());
    // Proposals stop at the end of the context; no match proposes nothing.
    assert_eq!(lookup.propose(&[1, 2, 1], 5).unwrap().tokens, [2, 1]);
    assert_eq!(lookup.propose(&[1, 2, 3], 5).unwrap(), Draft::default());
    assert!(PromptLookup::new(0, 2).is_err());
    assert!(PromptLookup::new(3, 2).is_err());
}

#[test]
fn a_draft_model_cuts_its_cache_back_to_the_accepted_tokens() {
    let m = stored_model();
    let mut draft =
        ModelDrafter::new(&m, Adapted(DenseBackend::new()), VOCAB, Sampling::default()).unwrap();
    let ctx: Vec<u32> = prompt()[..12].to_vec();
    let d = draft.propose(&ctx, 4).unwrap();
    assert_eq!(d.tokens.len(), 4);
    // The cache holds the context and the first three drafts.
    assert_eq!(draft.cache().tokens(), 12 + 3);
    // The target took one draft and its own token: the cache goes back to
    // the shared 13 tokens and catches up from there.
    let mut next = ctx.clone();
    next.extend([d.tokens[0], (d.tokens[1] + 1) % VOCAB as u32]);
    let again = draft.propose(&next, 2).unwrap();
    assert_eq!(draft.cache().tokens(), 14 + 1);
    // What it drafts is what a fresh drafter drafts from that context.
    let mut fresh =
        ModelDrafter::new(&m, Adapted(DenseBackend::new()), VOCAB, Sampling::default()).unwrap();
    assert_eq!(fresh.propose(&next, 2).unwrap(), again);
}

#[test]
fn bad_settings_are_refused_before_any_work() {
    let m = stored_model();
    let opts = options(8, Sampling::default());
    let mut lookup = PromptLookup::default();
    for k in [0, 64 - prompt().len() + 1] {
        let mut cache = Adapted(DenseBackend::new());
        let err = generate_speculative(
            &m,
            &mut cache,
            &mut lookup,
            &prompt(),
            &SpeculativeOptions { generate: opts, k },
            no_faults,
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(
            matches!(err, ModelError::InvalidParameter { name: "k", .. }),
            "{err}"
        );
        assert_eq!(cache.tokens(), 0);
    }
    // A draft model of another vocabulary, a used draft cache.
    let other = tiny(3, |_| true);
    assert!(matches!(
        ModelDrafter::new(
            &other,
            Adapted(DenseBackend::new()),
            VOCAB + 1,
            Sampling::default()
        ),
        Err(ModelError::InvalidParameter {
            name: "draft model",
            ..
        })
    ));
    let mut used = Adapted(DenseBackend::new());
    other.forward(&[1, 2], &mut used, 0).unwrap();
    assert!(matches!(
        ModelDrafter::new(&other, used, VOCAB, Sampling::default()),
        Err(ModelError::InvalidParameter {
            name: "draft cache",
            ..
        })
    ));
}
