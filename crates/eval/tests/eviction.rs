//! Token eviction in the perplexity protocol, on the tiny random Llama:
//! keeping every token reproduces the run without eviction bit for bit on
//! the paged and dense backends; keeping part stores fewer bits and still
//! scores every prediction; the re-encode protocol and forms that read
//! rows at their stored positions are refused before any work.

mod common;

use attention::SnapKv;
use kv_eval::backend::{BackendKind, check_eviction};
use kv_eval::cache::CacheMode;
use kv_eval::metrics::{PplMethod, RunConfig, evaluate};

use common::tiny::{model, tokens};

fn runs(spec: &str, backend: BackendKind, keeps: &[Option<f64>]) -> Vec<RunConfig> {
    let mode = CacheMode::parse(spec).unwrap();
    keeps
        .iter()
        .map(|keep| RunConfig {
            backend,
            eviction: keep.map(|k| SnapKv::new(k, 8, 3).unwrap()),
            ..RunConfig::new(mode.clone(), None)
        })
        .collect()
}

#[test]
fn keeping_every_token_reproduces_the_run_without_eviction() {
    let m = model();
    let toks = tokens(260);
    for (spec, backend) in [
        ("plain", BackendKind::Dense),
        ("int4", BackendKind::Paged { block_size: 16 }),
        (
            "int4-ch+sink4/lm4+rot8",
            BackendKind::Paged { block_size: 16 },
        ),
    ] {
        for method in [PplMethod::LlamaCpp, PplMethod::Sliding { stride: 24 }] {
            let got = evaluate(
                &m,
                &toks,
                64,
                method,
                &runs(spec, backend, &[None, Some(1.0)]),
                |_, _| {},
            )
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
            assert_eq!(got[0].nll_mean, got[1].nll_mean, "{spec} {method:?}");
            assert_eq!(
                got[0].stats.bits_per_value, got[1].stats.bits_per_value,
                "{spec}"
            );
        }
    }
}

#[test]
fn evicting_stores_fewer_bits_and_scores_every_prediction() {
    let m = model();
    let toks = tokens(260);
    let method = PplMethod::Sliding { stride: 16 };
    let got = evaluate(
        &m,
        &toks,
        64,
        method,
        &runs(
            "int8",
            BackendKind::Paged { block_size: 16 },
            &[None, Some(0.25)],
        ),
        |_, _| {},
    )
    .unwrap();
    let (all, evicted) = (&got[0], &got[1]);
    assert_eq!(all.tokens_scored, evicted.tokens_scored);
    assert!(evicted.nll_mean.is_finite());
    assert_ne!(all.nll_mean, evicted.nll_mean);
    // Windows of 64 scoring 16: 47 prefix tokens keep 12 (the window of 8
    // and 4 voted), so a window holds 12 + 17 rows, not 64.
    assert!(
        evicted.stats.bits_per_value < 0.6 * all.stats.bits_per_value,
        "{} against {}",
        evicted.stats.bits_per_value,
        all.stats.bits_per_value
    );
    // The plain form evicts too (not the clean pass's logits): f32 rows.
    let plain = evaluate(
        &m,
        &toks,
        64,
        method,
        &runs("plain", BackendKind::Dense, &[Some(0.25)]),
        |_, _| {},
    )
    .unwrap();
    assert!(plain[0].kl_mean > 0.0, "{:?}", plain[0]);
    let bits = plain[0].stats.bits_per_value;
    assert!(bits > 8.0 && bits < 0.6 * 32.0, "{bits}");
}

#[test]
fn what_eviction_cannot_run_is_refused_before_any_work() {
    let paged = BackendKind::Paged { block_size: 16 };
    for (spec, backend, what) in [
        ("int4", BackendKind::Reencode, "re-encode"),
        ("int2-ch+sink4+out1+clip+pre/lm2", paged, "position"),
        ("shard-k3", paged, "position"),
    ] {
        let mode = CacheMode::parse(spec).unwrap();
        let e = check_eviction(&mode, backend).unwrap_err().to_string();
        assert!(e.contains(what), "{spec}: {e}");
        // And through the protocol itself.
        let m = model();
        let run = &runs(spec, backend, &[Some(0.5)]);
        let e = evaluate(&m, &tokens(130), 64, PplMethod::LlamaCpp, run, |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("evict") && e.contains(what), "{spec}: {e}");
    }
    assert!(check_eviction(&CacheMode::parse("int4-ch+sink4/lm4+rot8").unwrap(), paged).is_ok());
}

#[test]
fn generation_evicts_the_prompt_once_before_decoding() {
    use kv_eval::generate::{GenerateConfig, generate};
    use kv_model::model::Sampling;
    let m = model();
    let prompt = tokens(100);
    for backend in [BackendKind::Dense, BackendKind::Paged { block_size: 16 }] {
        let config = |keep: Option<f64>| GenerateConfig {
            mode: CacheMode::parse(if backend == BackendKind::Dense {
                "plain"
            } else {
                "int8"
            })
            .unwrap(),
            backend,
            context: 160,
            max_new: 12,
            sampling: Sampling::default(),
            faults: None,
            prefill_step: None,
            eviction: keep.map(|k| SnapKv::new(k, 8, 3).unwrap()),
        };
        let plain = generate(&m, &prompt, &config(None), |_| Ok(())).unwrap();
        let all = generate(&m, &prompt, &config(Some(1.0)), |_| Ok(())).unwrap();
        assert_eq!(plain.tokens, all.tokens, "{backend:?}");
        assert_eq!(plain.cache_bytes, all.cache_bytes, "{backend:?}");
        let part = generate(&m, &prompt, &config(Some(0.3)), |_| Ok(())).unwrap();
        assert_eq!(part.tokens.len(), 12);
        assert_eq!(
            part.eviction,
            Some(attention::Eviction {
                prefill: 100,
                kept: 30
            })
        );
        assert_eq!(plain.eviction, None);
        // The first token comes from the whole prompt.
        assert_eq!(part.tokens[0], plain.tokens[0]);
        assert!(part.cache_bytes < plain.cache_bytes, "{backend:?}");
    }
    // Refused before any work on the re-encode backend.
    let reencode = GenerateConfig {
        mode: CacheMode::parse("int8").unwrap(),
        backend: BackendKind::Reencode,
        context: 160,
        max_new: 4,
        sampling: Sampling::default(),
        faults: None,
        prefill_step: None,
        eviction: Some(SnapKv::default()),
    };
    assert!(generate(&m, &prompt, &reencode, |_| Ok(())).is_err());
}
