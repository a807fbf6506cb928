//! Faults in the stored weights of the tiny GGUF model and their checks
//! (`kv_eval::weight_faults`): without flips the hook's products are the
//! model's bits; checked before every pass, every flip is corrected and
//! the logits are the clean ones; never checked, the flips stay and the
//! logits move; every flipped bit is accounted once; the same seed gives
//! the same run.

mod common;

use std::sync::Arc;

use kv_eval::EvalError;
use kv_eval::cache::{CacheMode, KvCache};
use kv_eval::weight_faults::{WeightFaultConfig, WeightFaultStats, WeightFaults};
use kv_model::model::{CausalLm, LlamaModel};
use kv_model::weights::Isa;

use common::tiny::{model, tokens};

fn config(rate: f64, check_every: Option<u64>) -> WeightFaultConfig {
    WeightFaultConfig {
        rate,
        seed: 5,
        check_every,
        rows_per_group: 4,
    }
}

/// Logits of `passes` forward passes over the same tokens (each on a fresh
/// cache) through the hook, and its statistics.
fn faulty_run(config: WeightFaultConfig, passes: usize) -> (Vec<Vec<f32>>, WeightFaultStats) {
    let mut m = model();
    let faults = Arc::new(WeightFaults::new(config, Isa::detect()).unwrap());
    m.set_projection_hook(Some(faults.clone()));
    let logits = (0..passes).map(|_| clean_pass(&m)).collect();
    (logits, faults.stats())
}

fn clean_pass(m: &LlamaModel) -> Vec<f32> {
    let mut cache = KvCache::new(CacheMode::Plain, None, 0).unwrap();
    CausalLm::forward(m, &tokens(24), &mut cache, 0).unwrap()
}

fn accounted(s: &WeightFaultStats) -> u64 {
    s.corrected + s.miscorrected + s.detected + s.silent + s.cancelled + s.pending
}

#[test]
fn without_flips_the_products_are_the_models_bits() {
    let clean = clean_pass(&model());
    let (logits, stats) = faulty_run(config(0.0, Some(1)), 3);
    assert!(logits.iter().all(|l| l == &clean));
    assert_eq!((stats.passes, stats.checks, stats.flips), (3, 3, 0));
    assert!(stats.weight_bytes > 0 && stats.guard_bytes > 0);
}

#[test]
fn checked_before_every_pass_every_flip_is_corrected() {
    let clean = clean_pass(&model());
    let (logits, stats) = faulty_run(config(2e-4, Some(1)), 4);
    assert!(stats.flips >= 20, "{stats:?}");
    assert_eq!(stats.corrected, stats.flips, "{stats:?}");
    assert_eq!(accounted(&stats), stats.flips);
    assert!(logits.iter().all(|l| l == &clean));
}

#[test]
fn never_checked_the_flips_stay_and_move_the_logits() {
    let clean = clean_pass(&model());
    let (logits, stats) = faulty_run(config(2e-4, None), 4);
    assert!(stats.flips >= 20);
    assert_eq!(
        (stats.checks, stats.pending),
        (0, stats.flips - stats.cancelled)
    );
    assert_eq!(accounted(&stats), stats.flips);
    assert_ne!(logits.last().unwrap(), &clean);
}

#[test]
fn flips_between_checks_are_read_until_the_check() {
    // Checked every 2 passes: the first pass reads its flips, the second
    // is checked first and reads clean weights.
    let clean = clean_pass(&model());
    let (logits, stats) = faulty_run(config(3e-5, Some(2)), 2);
    assert!(stats.flips >= 5, "{stats:?}");
    assert!(logits[0] != clean, "the first pass reads its flips");
    assert!(logits[1] == clean, "the second pass reads repaired weights");
    assert_eq!(stats.checks, 1);
    assert_eq!(stats.corrected + stats.cancelled, stats.flips, "{stats:?}");
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let a = faulty_run(config(1e-3, Some(3)), 4);
    let b = faulty_run(config(1e-3, Some(3)), 4);
    assert_eq!(a.1.flips, b.1.flips);
    assert_eq!(
        (a.1.corrected, a.1.detected, a.1.rows_repaired_by_crc),
        (b.1.corrected, b.1.detected, b.1.rows_repaired_by_crc)
    );
    for (x, y) in a.0.iter().zip(&b.0) {
        assert_eq!(
            x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
    // A rate high enough for several flips per row: parity and leftovers.
    assert!(
        a.1.rows_repaired > a.1.rows_repaired_by_crc || a.1.detected > 0,
        "{:?}",
        a.1
    );
    assert_eq!(accounted(&a.1), a.1.flips);
}

#[test]
fn bad_settings_are_refused() {
    for (c, name) in [
        (config(1.5, None), "weight-flips"),
        (config(f64::NAN, None), "weight-flips"),
        (config(1e-6, Some(0)), "weight-check"),
        (
            WeightFaultConfig {
                rows_per_group: 0,
                ..config(1e-6, None)
            },
            "weight-group",
        ),
    ] {
        match WeightFaults::new(c, Isa::detect()) {
            Err(EvalError::InvalidParameter { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{c:?}: {other:?}"),
        }
    }
}

#[test]
fn the_memory_needed_is_what_the_hook_holds() {
    let m = model();
    let (_, stats) = faulty_run(config(0.0, Some(1)), 1);
    let need = WeightFaults::memory_needed(&m, 4);
    assert_eq!(need, stats.weight_bytes + stats.guard_bytes);
    // Groups of one row: parity as large as the weights.
    assert!(WeightFaults::memory_needed(&m, 1) >= 2 * stats.weight_bytes);
}
