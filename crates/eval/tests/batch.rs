//! Continuous batching of the tiny random Qwen2 on the paged cache: every
//! request's greedy output in a batch equals its output generated alone
//! (kv-eval's single-sequence `generate` on a `PagedBackend`, a different
//! code path), with prefix hits, and under preemption by recompute and by
//! swap in a pool too small for the batch; sampled requests are
//! independent of their batch; and the errors bad requests get.

mod common;

use attention::KvBackend;
use common::qwen2::tiny_qwen2_gguf;
use kv_eval::EvalError;
use kv_eval::backend::BackendKind;
use kv_eval::batch::{
    BatchConfig, BatchReport, PrefixKind, parse_requests, run_batch, run_batch_with,
};
use kv_eval::cache::{CacheMode, KvCache};
use kv_eval::generate::{GenerateConfig, generate};
use kv_model::gguf::GgufFile;
use kv_model::model::Sampling;
use kv_model::model::batch::BatchRequest;
use kv_model::model::{BatchItem, CausalLm, LlamaModel};
use paged_cache::CacheConfig;
use paged_cache::scheduler::{Preemption, SchedulerConfig};

const BS: usize = 4;
/// Token ids the prompts use (the tiny Qwen2's bytes).
const VOCAB: usize = 256;

/// The tiny random Qwen2: unlike the tiny Llama, its greedy outputs depend
/// on the prompt, so equal outputs mean something.
fn model() -> LlamaModel {
    LlamaModel::from_gguf(&GgufFile::from_bytes(tiny_qwen2_gguf()).unwrap()).unwrap()
}
const FORM: &str = "int4+secded84";

/// Requests with shared prefixes, staggered arrivals and mixed priorities.
fn requests() -> Vec<BatchRequest> {
    let shared: Vec<u32> = (0..24).map(|i| (i * 5 + 3) % VOCAB as u32).collect();
    (0..10)
        .map(|r| {
            let mut prompt = if r % 2 == 0 {
                shared.clone()
            } else {
                Vec::new()
            };
            prompt.extend((0..9 + 5 * r).map(|i| ((i * 7 + r * 13 + 1) % VOCAB) as u32));
            BatchRequest {
                prompt,
                max_new_tokens: 6 + 3 * (r % 4),
                arrival_step: (r / 3) as u64,
                priority: (r % 3) as u32,
                sampling: Sampling::default(),
            }
        })
        .collect()
}

fn config(blocks: usize, prefix: PrefixKind, preemption: Preemption) -> BatchConfig {
    let cache = CacheConfig {
        num_blocks: blocks,
        block_size: BS,
        host_blocks: 256,
    };
    BatchConfig {
        mode: CacheMode::parse(FORM).unwrap(),
        cache,
        prefix,
        scheduler: SchedulerConfig {
            cache,
            watermark: 0.0,
            max_prefill_tokens: 64,
            max_running: 16,
            preemption,
        },
    }
}

fn alone(model: &LlamaModel, q: &BatchRequest) -> Vec<u32> {
    let config = GenerateConfig {
        mode: CacheMode::parse(FORM).unwrap(),
        backend: BackendKind::Paged { block_size: BS },
        context: 512,
        max_new: q.max_new_tokens,
        sampling: q.sampling,
        faults: None,
        prefill_step: None,
        eviction: None,
    };
    generate(model, &q.prompt, &config, |_| Ok(()))
        .unwrap()
        .tokens
}

fn alone_outputs(model: &LlamaModel, requests: &[BatchRequest]) -> Vec<Vec<u32>> {
    requests.iter().map(|q| alone(model, q)).collect()
}

fn check_against_alone(model: &LlamaModel, requests: &[BatchRequest], report: &BatchReport) {
    assert_eq!(report.outputs.len(), requests.len());
    for (i, (q, out)) in requests.iter().zip(&report.outputs).enumerate() {
        assert_eq!(out.tokens.len(), q.max_new_tokens, "request {i}");
        assert_eq!(out.tokens, alone(model, q), "request {i}");
        assert_eq!(out.token_times.len(), out.tokens.len());
        assert!(out.ttft() >= 0.0);
    }
    assert_eq!(
        report.generated,
        requests
            .iter()
            .map(|q| q.max_new_tokens as u64)
            .sum::<u64>()
    );
}

#[test]
fn a_roomy_batch_equals_each_request_alone_and_hits_the_prefix_cache() {
    let model = model();
    let requests = requests();
    for prefix in [PrefixKind::Hash, PrefixKind::Radix] {
        let report = run_batch(
            &model,
            &requests,
            &config(256, prefix, Preemption::Recompute),
        )
        .unwrap();
        check_against_alone(&model, &requests, &report);
        let s = &report.scheduler;
        assert_eq!(s.preempted_recompute + s.preempted_swap, 0);
        assert!(s.prefix_hit_rate > 0.1, "{prefix:?}: {}", s.prefix_hit_rate);
        assert!(
            s.mean_running > 1.5,
            "requests ran together: {}",
            s.mean_running
        );
    }
    // The outputs depend on the prompts, so equal outputs are a real check.
    let distinct: std::collections::HashSet<_> =
        alone_outputs(&model, &requests).into_iter().collect();
    assert_eq!(distinct.len(), requests.len());
    let none = run_batch(
        &model,
        &requests,
        &config(256, PrefixKind::None, Preemption::Recompute),
    )
    .unwrap();
    assert_eq!(none.scheduler.prefix_hit_rate, 0.0);
    check_against_alone(&model, &requests, &none);
}

#[test]
fn preemption_by_recompute_and_by_swap_keeps_every_output() {
    let model = model();
    let requests = requests();
    for (preemption, prefix) in [
        (Preemption::Recompute, PrefixKind::Hash),
        (Preemption::Recompute, PrefixKind::None),
        (Preemption::Swap, PrefixKind::Hash),
        (Preemption::Swap, PrefixKind::Radix),
    ] {
        let report = run_batch(&model, &requests, &config(30, prefix, preemption)).unwrap();
        let s = &report.scheduler;
        let preempted = match preemption {
            Preemption::Recompute => s.preempted_recompute,
            Preemption::Swap => s.preempted_swap,
        };
        assert!(
            preempted > 0,
            "{preemption:?}/{prefix:?}: the pool is tight enough to preempt"
        );
        check_against_alone(&model, &requests, &report);
    }
}

/// Speculation in the batch (prompt lookup on the protected int4 form; the
/// model drafting for itself through an int8h cache's upper plane) keeps
/// every greedy output, with prefix hits and under preemption, and the
/// report counts the drafts.
#[test]
fn a_speculating_batch_keeps_every_output() {
    use kv_model::model::batch::{BatchDrafters, BatchSpeculation};
    use kv_model::model::{Drafter, PromptLookup, SelfDrafter};
    let model = model();
    let requests = requests();
    for (form, blocks, preemption, own) in [
        (FORM, 256, Preemption::Recompute, false),
        (FORM, 30, Preemption::Swap, false),
        ("int8h", 30, Preemption::Recompute, true),
    ] {
        let mut config = config(blocks, PrefixKind::Hash, preemption);
        config.mode = CacheMode::parse(form).unwrap();
        let drafters = requests
            .iter()
            .map(|_| -> Box<dyn Drafter + '_> {
                match own {
                    true => Box::new(SelfDrafter::new(&model, Sampling::default()).unwrap()),
                    false => Box::new(PromptLookup::new(1, 3).unwrap()),
                }
            })
            .collect();
        let speculation = BatchSpeculation {
            k: 3,
            drafters: BatchDrafters::PerRequest(drafters),
        };
        let report = kv_eval::batch::run_batch_speculative(
            &model,
            &requests,
            &config,
            speculation,
            &mut |_, _| Ok(()),
        )
        .unwrap();
        let plain = run_batch(&model, &requests, &config).unwrap();
        for (i, (a, b)) in report.outputs.iter().zip(&plain.outputs).enumerate() {
            assert_eq!(a.tokens, b.tokens, "{form}, {blocks} blocks: request {i}");
        }
        if form == FORM {
            check_against_alone(&model, &requests, &report);
        }
        let stats = report.speculation.expect("a speculating batch reports");
        assert!(
            stats.drafted > 0 && stats.accepted <= stats.drafted,
            "{stats:?}"
        );
        assert!(
            report.markdown().contains("Speculation:"),
            "{}",
            report.markdown()
        );
        if own {
            assert!(stats.accepted * 2 > stats.drafted, "{form}: {stats:?}");
        }
        if blocks == 30 {
            let s = &report.scheduler;
            assert!(s.preempted_recompute + s.preempted_swap > 0, "{s:?}");
        }
    }
}

#[test]
fn sampled_requests_do_not_depend_on_their_batch() {
    let model = model();
    let mut requests = requests();
    for (r, q) in requests.iter_mut().enumerate() {
        q.sampling = Sampling {
            temperature: 0.9,
            top_p: 1.0,
            seed: r as u64,
        };
    }
    let roomy = run_batch(
        &model,
        &requests,
        &config(256, PrefixKind::Hash, Preemption::Swap),
    )
    .unwrap();
    let tight = run_batch(
        &model,
        &requests,
        &config(30, PrefixKind::None, Preemption::Recompute),
    )
    .unwrap();
    assert!(tight.scheduler.preempted_recompute > 0);
    let tokens = |r: &BatchReport| {
        r.outputs
            .iter()
            .map(|o| o.tokens.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(tokens(&roomy), tokens(&tight));
    for (r, q) in requests.iter().enumerate() {
        let mut single = vec![q.clone()];
        single[0].arrival_step = 0;
        let one = run_batch(
            &model,
            &single,
            &config(256, PrefixKind::None, Preemption::Swap),
        )
        .unwrap();
        assert_eq!(
            one.outputs[0].tokens, roomy.outputs[r].tokens,
            "request {r}"
        );
    }
    // Not greedy: some request picked a token other than the most likely one.
    let greedy = run_batch(
        &model,
        &self::requests(),
        &config(256, PrefixKind::Hash, Preemption::Swap),
    )
    .unwrap();
    assert_ne!(tokens(&greedy), tokens(&roomy));
}

#[test]
fn bad_requests_are_refused_naming_the_line() {
    let encode = |s: &str| Ok(s.bytes().map(|b| u32::from(b) % VOCAB as u32).collect());
    let good = r#"{"prompt": "hello", "max_new_tokens": 4}"#;
    let parsed = parse_requests(&format!("{good}\n\n{good}\n"), 64, encode).unwrap();
    assert_eq!(parsed.len(), 2);
    assert_eq!(parsed[0].max_new_tokens, 4);
    assert_eq!(parsed[0].sampling, Sampling::default());
    let full = r#"{"prompt": "a", "max_new_tokens": 2, "arrival_step": 3, "priority": 1, "temperature": 0.5, "top_p": 0.9, "seed": 9}"#;
    let q = &parse_requests(full, 64, encode).unwrap()[0];
    assert_eq!((q.arrival_step, q.priority), (3, 1));
    assert_eq!(
        q.sampling,
        Sampling {
            temperature: 0.5,
            top_p: 0.9,
            seed: 9
        }
    );
    for (text, line, what) in [
        (format!("{good}\nnot json"), 2, "expected"),
        (
            format!("{good}\n{{\"prompt\": \"x\"}}"),
            2,
            "max_new_tokens",
        ),
        (
            format!("{good}\n{good}\n{{\"prompt\": \"x\", \"max_new_tokens\": 0}}"),
            3,
            "max_new_tokens is 0",
        ),
        (
            r#"{"prompt": "", "max_new_tokens": 3}"#.to_string(),
            1,
            "no token",
        ),
        (
            r#"{"prompt": "x", "max_new_tokens": 3, "arrival_step": 18446744073709551615}"#
                .to_string(),
            1,
            "arrival_step 18446744073709551615 is past",
        ),
        (
            r#"{"prompt": "x", "max_new_tokens": 3, "temprature": 1}"#.to_string(),
            1,
            "unknown field",
        ),
        (
            r#"{"prompt": "x", "max_new_tokens": 3, "temperature": -1}"#.to_string(),
            1,
            "temperature",
        ),
        (
            r#"{"prompt": "x", "max_new_tokens": -3}"#.to_string(),
            1,
            "invalid value",
        ),
        (
            format!("{good}\n{{\"prompt\": \"x\", \"max_new_tokens\": 18446744073709551615}}"),
            2,
            "exceed the context of 64",
        ),
        (
            format!(
                "{good}\n{{\"prompt\": \"{}\", \"max_new_tokens\": 1}}",
                "y".repeat(64)
            ),
            2,
            "exceed the context",
        ),
        (
            r#"{"prompt": "x", "max_new_tokens": 3, "top_p": 0}"#.to_string(),
            1,
            "top",
        ),
        (
            r#"{"prompt": "x", "max_new_tokens": 3, "top_p": 1.5}"#.to_string(),
            1,
            "top",
        ),
    ] {
        let err = parse_requests(&text, 64, encode).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                EvalError::InvalidParameter {
                    name: "requests",
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("line {line}:")) && msg.contains(what),
            "{msg}"
        );
    }
    assert!(parse_requests("\n\n", 64, encode).is_err());

    let model = model();
    let mut long = requests();
    long[3].max_new_tokens = model.context().expect("the tiny model states its context");
    let err = run_batch(
        &model,
        &long,
        &config(256, PrefixKind::Hash, Preemption::Swap),
    )
    .unwrap_err();
    assert!(err.to_string().contains("request 3"), "{err}");
    assert!(
        run_batch(
            &model,
            &[],
            &config(256, PrefixKind::Hash, Preemption::Swap)
        )
        .is_err()
    );
    // A pool that cannot hold one request is refused, not looped on.
    let err = run_batch(
        &model,
        &requests(),
        &config(4, PrefixKind::Hash, Preemption::Swap),
    )
    .unwrap_err();
    assert!(err.to_string().contains("blocks"), "{err}");
}

#[test]
fn a_batched_pass_equals_each_sequence_passed_alone() {
    let model = model();
    let mode = CacheMode::parse(FORM).unwrap();
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|r| {
            (0..3 + 7 * r)
                .map(|i| ((i * 11 + r * 5) % VOCAB) as u32)
                .collect()
        })
        .collect();
    // Alone: each prompt, then one token.
    let mut alone = Vec::new();
    for p in &prompts {
        let mut cache = KvCache::new(mode.clone(), None, 0).unwrap();
        let first = model.forward(p, &mut cache, 0).unwrap();
        let next = model.forward(&[7], &mut cache, 0).unwrap();
        alone.push((first, next));
    }
    // Batched: the prompts as one batch (items of different lengths), then
    // a decode step over all of them.
    let mut caches: Vec<KvCache> = (0..prompts.len())
        .map(|_| KvCache::new(mode.clone(), None, 0).unwrap())
        .collect();
    let mut items: Vec<BatchItem<'_>> = caches
        .iter_mut()
        .zip(&prompts)
        .map(|(cache, p)| BatchItem {
            tokens: p,
            cache,
            logits_from: 0,
        })
        .collect();
    let firsts = model.forward_batch(&mut items).unwrap();
    drop(items);
    let step = [7u32];
    let mut items: Vec<BatchItem<'_>> = caches
        .iter_mut()
        .map(|cache| BatchItem {
            tokens: &step,
            cache,
            logits_from: 0,
        })
        .collect();
    let nexts = model.forward_batch(&mut items).unwrap();
    drop(items);
    for (r, ((first, next), (a_first, a_next))) in firsts.iter().zip(&nexts).zip(&alone).enumerate()
    {
        // A GEMM over several rows blocks its sums differently from one
        // over a single row: the logits agree to rounding (about 1e-6 here;
        // the bound leaves room for other instruction sets), not bit for bit.
        for (what, a, b) in [("prompt", first, a_first), ("step", next, a_next)] {
            assert_eq!(a.len(), b.len());
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(worst <= 1e-4, "{what} {r}: {worst}");
        }
    }
    // A bad item fails the whole step and leaves every cache as it was.
    let bad = [VOCAB as u32 + 100];
    let mut items: Vec<BatchItem<'_>> = caches
        .iter_mut()
        .enumerate()
        .map(|(r, cache)| BatchItem {
            tokens: if r == 3 { &bad[..] } else { &step[..] },
            cache,
            logits_from: 0,
        })
        .collect();
    assert!(matches!(
        model.forward_batch(&mut items),
        Err(kv_model::ModelError::TokenId { .. })
    ));
    drop(items);
    for (cache, p) in caches.iter().zip(&prompts) {
        assert_eq!(cache.tokens(), p.len() + 1);
    }
}

#[test]
fn each_output_is_delivered_as_its_request_finishes_and_a_delivery_error_stops_the_batch() {
    let model = model();
    let requests = requests();
    let config = config(256, PrefixKind::Hash, Preemption::Recompute);
    let mut delivered = Vec::new();
    let report = run_batch_with(&model, &requests, &config, &mut |r, out| {
        delivered.push((r, out.tokens.clone()));
        Ok(())
    })
    .unwrap();
    assert_eq!(delivered.len(), requests.len());
    let mut seen: Vec<usize> = delivered.iter().map(|(r, _)| *r).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..requests.len()).collect::<Vec<_>>());
    for (r, tokens) in &delivered {
        assert_eq!(tokens, &report.outputs[*r].tokens, "request {r}");
    }
    // The first request to finish is the shortest of those that came first.
    assert_eq!(delivered[0].1.len(), 6);
    let mut calls = 0;
    let err = run_batch_with(&model, &requests, &config, &mut |_, _| {
        calls += 1;
        Err(EvalError::InvalidParameter {
            name: "out",
            reason: "disk full".into(),
        })
    })
    .unwrap_err();
    assert!(err.to_string().contains("disk full"), "{err}");
    assert_eq!(calls, 1);
}

/// `kv-eval batch` on the tiny Qwen2 written to a file: every request's
/// text and line land in --out with the report; a bad line is refused
/// naming it, before anything runs.
#[test]
fn the_cli_writes_every_output_and_the_report_and_names_a_bad_line() {
    let dir = std::env::temp_dir().join(format!("kv-eval-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny-qwen2.gguf");
    std::fs::write(&model, tiny_qwen2_gguf()).unwrap();
    let requests = dir.join("requests.jsonl");
    std::fs::write(
        &requests,
        "{\"prompt\": \"hello world\", \"max_new_tokens\": 5}\n\
         \n\
         {\"prompt\": \"hello there, 12 cats\", \"max_new_tokens\": 3, \"arrival_step\": 2, \"temperature\": 0.7, \"seed\": 4}\n",
    )
    .unwrap();
    let out = dir.join("out");
    let run = |requests: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kv-eval"))
            .args([
                "batch",
                "--form",
                FORM,
                "--block-size",
                "4",
                "--blocks",
                "64",
            ])
            .arg("--model")
            .arg(&model)
            .arg("--requests")
            .arg(requests)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap()
    };
    let o = run(&requests);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let lines = std::fs::read_to_string(out.join("outputs.jsonl")).unwrap();
    let mut seen: Vec<(u64, usize)> = lines
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let r = v["request"].as_u64().unwrap();
            let text = v["text"].as_str().unwrap();
            assert_eq!(
                std::fs::read_to_string(out.join(format!("request-{r}.txt"))).unwrap(),
                text
            );
            (r, v["tokens"].as_array().unwrap().len())
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, [(0, 5), (1, 3)]);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["generated"], 8);
    assert!(
        std::fs::read_to_string(out.join("report.md"))
            .unwrap()
            .contains("tokens/s")
    );
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"prompt\": \"hi\", \"max_new_tokens\": 2}\n{\"prompt\": \"hi\", \"max_new_tokens\": 2, \"top_p\": 2}\n",
    )
    .unwrap();
    let o = run(&bad);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("line 2:") && stderr.contains("top-p"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One requests-file line: valid JSON objects with fields of any value
/// (some out of range, some misspelt), or arbitrary text.
fn request_line() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let field = prop_oneof![
        "[a-z ]{0,12}".prop_map(|s| format!("\"prompt\": \"{s}\"")),
        any::<i64>().prop_map(|n| format!("\"max_new_tokens\": {n}")),
        (0u64..100).prop_map(|n| format!("\"max_new_tokens\": {n}")),
        any::<i64>().prop_map(|n| format!("\"arrival_step\": {n}")),
        any::<u32>().prop_map(|n| format!("\"priority\": {n}")),
        any::<f64>().prop_map(|x| format!("\"temperature\": {x:e}")),
        (-1.0f64..2.0).prop_map(|x| format!("\"top_p\": {x}")),
        any::<u64>().prop_map(|n| format!("\"seed\": {n}")),
        Just("\"temprature\": 1".to_string()),
    ];
    prop_oneof![
        3 => proptest::collection::vec(field, 0..6).prop_map(|f| format!("{{{}}}", f.join(", "))),
        1 => ".{0,40}",
    ]
}

proptest::proptest! {
    /// Whatever a requests file holds, reading it never panics: it gives
    /// requests that keep every promise, or an error naming a line.
    #[test]
    fn reading_any_requests_file_never_panics(
        lines in proptest::collection::vec(request_line(), 0..6),
    ) {
        let text = lines.join("\n");
        let encode = |s: &str| Ok(s.bytes().map(u32::from).collect());
        match parse_requests(&text, 64, encode) {
            Ok(requests) => {
                for q in requests {
                    proptest::prop_assert!(!q.prompt.is_empty() && q.max_new_tokens > 0);
                    proptest::prop_assert!(q.prompt.len() + q.max_new_tokens <= 64);
                    proptest::prop_assert!(q.sampling.check().is_ok());
                }
            }
            Err(e) => {
                let msg = e.to_string();
                proptest::prop_assert!(msg.contains("line ") || msg.contains("no request"), "{}", msg);
            }
        }
    }
}
