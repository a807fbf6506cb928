//! Faults accumulating during generation, on the tiny random Qwen2: with
//! no faults the replay equals the clean run exactly; with faults every
//! flip is counted, scrubbing finds what the code corrects, the figures are
//! in range and a seed reproduces them; bad settings are refused.

mod common;

use common::qwen2::tiny_qwen2_gguf;
use kv_eval::EvalError;
use kv_eval::accumulate::{AccumulateConfig, run};
use kv_eval::cache::{CacheMode, ChannelKind};
use kv_model::gguf::GgufFile;
use kv_model::model::LlamaModel;
use kv_quant::FaultTarget;

fn model() -> LlamaModel {
    LlamaModel::from_gguf(&GgufFile::from_bytes(tiny_qwen2_gguf()).unwrap()).unwrap()
}

fn config(ber: f64) -> AccumulateConfig {
    AccumulateConfig {
        steps: 24,
        block_size: 8,
        ber_per_step: ber,
        channel: ChannelKind::Bsc,
        target: FaultTarget::Values,
        seed: 3,
    }
}

fn prompt() -> Vec<u32> {
    (0..40).map(|i| (i * 37 + 5) % 256).collect()
}

#[test]
fn without_faults_the_replay_is_the_clean_run() {
    let m = model();
    let forms = [CacheMode::parse("int4+secded84").unwrap()];
    let r = run(
        &m,
        &prompt(),
        &forms,
        &[None, Some(4)],
        &config(0.0),
        |_| {},
    )
    .unwrap();
    assert_eq!(r.rows.len(), 2);
    for row in &r.rows {
        assert_eq!(row.agreement, 1.0);
        assert!(
            row.kl_per_step.iter().all(|&k| k == 0.0),
            "{:?}",
            row.kl_per_step
        );
        assert_eq!(
            (row.injected_flips, row.read_corrected, row.read_detected),
            (0, 0, 0)
        );
    }
}

#[test]
fn faults_accumulate_are_counted_and_reproduce() {
    let m = model();
    let forms = [
        CacheMode::parse("int4+secded84").unwrap(),
        CacheMode::parse("int4+golay24").unwrap(),
    ];
    let scrubs = [None, Some(2)];
    let a = run(&m, &prompt(), &forms, &scrubs, &config(2e-3), |_| {}).unwrap();
    assert_eq!(a.rows.len(), 4);
    for row in &a.rows {
        assert!(row.injected_flips > 0, "{row:?}");
        assert!((0.0..=1.0).contains(&row.agreement));
        assert_eq!(row.kl_per_step.len(), 24);
        assert!(row.kl_per_step.iter().all(|&k| k >= 0.0));
        if row.scrub_every.is_some() {
            assert!(row.scrub_corrected > 0, "{row:?}");
        } else {
            assert_eq!((row.scrub_corrected, row.scrub_detected), (0, 0));
            assert!(row.read_corrected > 0, "{row:?}");
        }
    }
    // The same seed flips the same bits whatever the scrub interval.
    assert_eq!(a.rows[0].injected_flips, a.rows[1].injected_flips);
    let b = run(&m, &prompt(), &forms, &scrubs, &config(2e-3), |_| {}).unwrap();
    assert_eq!(a, b);
}

#[test]
fn bad_settings_are_refused() {
    let m = model();
    let forms = [CacheMode::parse("int4+secded84").unwrap()];
    let bad = |r: kv_eval::Result<_>| matches!(r, Err(EvalError::InvalidParameter { .. }));
    assert!(bad(run(
        &m,
        &prompt(),
        &forms,
        &[Some(0)],
        &config(0.0),
        |_| {}
    )));
    assert!(bad(run(
        &m,
        &prompt(),
        &forms,
        &[None],
        &config(2.0),
        |_| {}
    )));
    assert!(bad(run(&m, &[], &forms, &[None], &config(0.0), |_| {})));
    let zero = AccumulateConfig {
        steps: 0,
        ..config(0.0)
    };
    assert!(bad(run(&m, &prompt(), &forms, &[None], &zero, |_| {})));
    // A form a paged block cannot hold (a channel group of 7 tokens in
    // blocks of another size).
    let ch = [CacheMode::parse("int4-ch7").unwrap()];
    assert!(run(&m, &prompt(), &ch, &[None], &config(0.0), |_| {}).is_err());
}
