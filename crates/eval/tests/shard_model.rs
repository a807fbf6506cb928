//! The `shard` form on the tiny random Llama: a prefill through the
//! re-encode cache gives finite logits near the plain pass and counts true
//! bytes; tokens generated after a prefill go to the decode stream and give
//! finite logits, and folded into the middle hold fewer bytes (that a
//! layer extended after its prefill equals one stored at once is
//! attention's `tests/shard.rs`); seeded faults go through the
//! form's code and are accounted; bad input (faults on what a shard form
//! does not expose, mixed key/value forms, a window covering the context,
//! the paged backend) is a typed error.

mod common;

use attention::KvBackend;
use kv_eval::backend::BackendKind;
use kv_eval::cache::{CacheMode, ChannelKind, FaultSpec, KvCache};
use kv_model::ModelError;
use kv_quant::{CacheForm, FaultTarget};

use common::tiny::{DIM, HEADS, KV_HEADS, VOCAB, model, tokens};

const SPEC: &str = "shard-k4-g4+win8";

#[test]
fn a_prefill_gives_finite_logits_near_the_plain_pass_and_counts_bytes() {
    let m = model();
    let toks = tokens(120);
    let mut plain = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    let want = m.forward(&toks, &mut plain, 0).unwrap();
    let mut cache = KvCache::new(CacheMode::form(SPEC.parse().unwrap()), None, 0).unwrap();
    let got = m.forward(&toks, &mut cache, 0).unwrap();
    assert!(got.iter().all(|x| x.is_finite()));
    let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(worst < 0.5 * scale, "{worst} of {scale}");
    let s = cache.stats();
    // Two layers, keys and values of 120 tokens × 16 channels.
    assert_eq!(
        s.stored_values,
        2 * 2 * 120 * (KV_HEADS * DIM / HEADS) as u64
    );
    assert!(
        s.stored_bytes > 0 && s.stored_bytes < s.stored_values * 2,
        "{s:?}"
    );
    assert_eq!(s.part_bytes[0] + s.part_bytes[1], s.stored_bytes);
}

#[test]
fn decode_steps_go_to_the_stream_of_the_prefilled_layer() {
    let m = model();
    let toks = tokens(110);
    let form: CacheForm = SPEC.parse().unwrap();
    let mut cache = KvCache::new(CacheMode::form(form), None, 0).unwrap();
    m.forward(&toks[..100], &mut cache, 99).unwrap();
    for &t in &toks[100..] {
        let logits = m.forward(&[t], &mut cache, 0).unwrap();
        assert_eq!(logits.len(), VOCAB);
        assert!(logits.iter().all(|x| x.is_finite()));
    }
    assert_eq!(cache.tokens(), 110);
    // The statistics count every step's stored bytes: the prefill's
    // layers, then ten steps each holding them plus their stream.
    let per_call = cache.stats().stored_bytes;
    assert!(per_call > 0);
}

#[test]
fn folded_decode_steps_hold_fewer_bytes_than_the_stream() {
    let m = model();
    let toks = tokens(140);
    let mut bytes = Vec::new();
    for spec in ["shard-k4-g4+win8", "shard-k4-g4-f16+win8"] {
        let mut cache = KvCache::new(CacheMode::form(spec.parse().unwrap()), None, 0).unwrap();
        m.forward(&toks[..100], &mut cache, 99).unwrap();
        for &t in &toks[100..] {
            let logits = m.forward(&[t], &mut cache, 0).unwrap();
            assert!(logits.iter().all(|x| x.is_finite()), "{spec}");
        }
        bytes.push(cache.stats().stored_bytes);
    }
    // Forty steps: from the 17th on, 16 or 32 generated tokens are folded.
    assert!(bytes[1] < bytes[0], "{bytes:?}");
}

#[test]
fn faults_are_injected_through_the_code_and_accounted() {
    let m = model();
    let toks = tokens(120);
    let faults = FaultSpec {
        channel: ChannelKind::Bsc,
        ber: 1e-3,
        seed: 5,
        target: FaultTarget::Values,
        hot: None,
    };
    let run = |spec: &str| {
        let mut cache =
            KvCache::new(CacheMode::form(spec.parse().unwrap()), Some(faults), 0).unwrap();
        let logits = m.forward(&toks, &mut cache, 0).unwrap();
        (logits, cache.stats().clone())
    };
    let (a, sa) = run("shard-k4-g4+win8+secded84");
    let (b, sb) = run("shard-k4-g4+win8+secded84");
    assert_eq!(a, b, "a seed gives the same run");
    assert_eq!(sa, sb);
    assert!(sa.injected_flips > 0);
    let mut w = sa.keys.values;
    w += sa.values.values;
    assert!(w.corrected > 0, "{w:?}");
    assert!(w.corrected + w.detected + w.miscorrected <= sa.injected_flips);
    let (_, plain) = run("shard-k4-g4+win8");
    let mut p = plain.keys.values;
    p += plain.values.values;
    assert!(p.silent > 0 && p.corrected == 0, "{p:?}");
    // Under `metadata` the codes are left; the scales and the fitted tables
    // are hit, under RM(2,5) beside SECDED codes, bare without a code.
    let on_at = |spec: &str, target, ber| {
        let faults = FaultSpec {
            target,
            ber,
            ..faults
        };
        let mut cache =
            KvCache::new(CacheMode::form(spec.parse().unwrap()), Some(faults), 0).unwrap();
        m.forward(&toks, &mut cache, 0).unwrap();
        cache.stats().clone()
    };
    let on = |spec: &str, target| on_at(spec, target, 1e-2);
    let meta = on("shard-k4-g4+win8+secded84", FaultTarget::Metadata);
    assert_eq!(meta.keys.values.words + meta.values.values.words, 0);
    assert!(meta.keys.metadata.words > 0 && meta.values.metadata.words > 0);
    assert!(meta.tables.corrected > 0, "{:?}", meta.tables);
    let bare = on("shard-k4-g4+win8", FaultTarget::Metadata);
    assert!(
        bare.tables.silent > 0 && bare.tables.corrected == 0,
        "{:?}",
        bare.tables
    );
    let all = on("shard-k4-g4+win8+secded84", FaultTarget::Everything);
    assert!(all.keys.values.words > 0 && all.keys.metadata.words > 0);
    assert_eq!(all.tables, meta.tables);
    // Bare scales and tables under a high rate: the non-finite rows the
    // faults make in later layers are clamped, and the run ends with its
    // measurement, not an error.
    let wrecked = on_at("shard-k4-g4+win8", FaultTarget::Everything, 0.2);
    assert!(wrecked.tables.silent > 0);
}

#[test]
fn bad_input_is_a_typed_error() {
    let m = model();
    let toks = tokens(120);
    let faults = FaultSpec {
        channel: ChannelKind::Bsc,
        ber: 1e-3,
        seed: 0,
        target: FaultTarget::Values,
        hot: None,
    };
    let shard = CacheMode::form(SPEC.parse().unwrap());
    // NF4 values take no faults.
    let mut nf4 = KvCache::new(
        CacheMode::form("shard-k4-g4-vnf4+win8".parse().unwrap()),
        Some(faults),
        0,
    )
    .unwrap();
    let e = m.forward(&toks, &mut nf4, 0).unwrap_err().to_string();
    assert!(e.contains("NF4"), "{e}");
    let mixed = CacheMode::key_value(SPEC.parse().unwrap(), "int4".parse().unwrap());
    let mut cache = KvCache::new(mixed, None, 0).unwrap();
    let e = m.forward(&toks, &mut cache, 0).unwrap_err().to_string();
    assert!(e.contains("one shard form"), "{e}");
    let e = shard.check_context(12).unwrap_err().to_string();
    assert!(e.contains("cover the whole context"), "{e}");
    // The paged cache holds the form (each sequence fits its tables) and
    // its coded spelling, but not its folded one nor coded NF4 values.
    let paged = BackendKind::Paged { block_size: 16 };
    assert!(paged.check(&shard, None).is_ok());
    let coded = CacheMode::form("shard-k4-g4+win8+secded84".parse().unwrap());
    assert!(paged.check(&coded, None).is_ok());
    for spelling in ["shard-k4-g4-vnf4+win8+secded84", "shard-k4-g4-f16+win8"] {
        let e = paged
            .check(&CacheMode::form(spelling.parse().unwrap()), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shard"), "{spelling}: {e}");
    }
}

/// `shard-stream`'s sizes near `usize::MAX` are refused (they wrapped
/// around once: a slice panic, or a stride of 0 looping without end).
#[test]
fn drift_sizes_that_overflow_are_refused() {
    use kv_eval::stream_drift::{DriftConfig, run};
    let m = model();
    let toks = tokens(256);
    let reference: CacheForm = "fp16".parse().unwrap();
    let form: CacheForm = SPEC.parse().unwrap();
    for (prompts, prefix, new_tokens) in [
        (1, usize::MAX, 4),
        (usize::MAX, 32, 4),
        (1, 32, usize::MAX),
        (usize::MAX - 10, 20, 4),
    ] {
        let config = DriftConfig {
            prompts,
            prefix,
            new_tokens,
            checkpoints: vec![4],
            fold: None,
        };
        let err = run(&m, &toks, reference, &form, &config, |_| {}).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("context") || msg.contains("cannot give"),
            "{prompts} {prefix} {new_tokens}: {msg}"
        );
    }
}

/// A shard cache cannot be cut back: a verification step that keeps fewer
/// rows than it ran is refused and rolled back, and a whole one commits.
#[test]
fn shard_caches_refuse_to_keep_part_of_a_step() {
    use kv_model::model::CausalLm;
    let m = model();
    let toks = tokens(104);
    let mut cache = KvCache::new(CacheMode::form(SPEC.parse().unwrap()), None, 0).unwrap();
    m.forward(&toks[..100], &mut cache, 99).unwrap();
    let refused = m.forward_keeping(&toks[100..104], &mut cache, 0, &mut |_| 2);
    assert!(
        matches!(
            refused,
            Err(ModelError::External(_) | ModelError::InvalidParameter { .. })
        ),
        "{refused:?}"
    );
    let err = kv_eval::EvalError::from(refused.unwrap_err());
    assert!(err.to_string().contains("cannot be cut back"), "{err}");
    assert_eq!(cache.tokens(), 100);
    m.forward_keeping(&toks[100..104], &mut cache, 0, &mut |_| 4)
        .unwrap();
    assert_eq!(cache.tokens(), 104);
}
