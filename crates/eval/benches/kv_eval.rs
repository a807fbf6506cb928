//! `cargo xtask bench kv-eval`: clean evaluation throughput of the default
//! model at n_ctx 256 on every thread (tokens per second of one window of
//! 255 tokens, logits for its scored half as the llama.cpp method needs),
//! for the plain pass (the baseline) and for caches stored in each form.
//! Needs the model of `cargo xtask fetch-model`; without it nothing runs and
//! the reason is printed.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kv_eval::cache::{CacheMode, ChannelKind, FaultSpec, KvCache};
use kv_eval::paths;
use kv_model::gguf::GgufFile;
use kv_model::model::LlamaModel;
use kv_model::tokenizer::TextTokenizer;
use kv_quant::FaultTarget;

fn bench(c: &mut Criterion) {
    let path = paths::default_model();
    let Ok(file) = GgufFile::open(&path) else {
        eprintln!(
            "kv-eval bench skipped: {} is missing (run `cargo xtask fetch-model`)",
            path.display()
        );
        return;
    };
    let model = LlamaModel::from_gguf(&file).unwrap();
    let tok = TextTokenizer::from_gguf(&file).unwrap();
    let text = std::fs::read_to_string(paths::default_text())
        .unwrap_or_else(|_| "The capital of France is Paris. ".repeat(64));
    let ids = tok.encode(&text).unwrap();
    let window = &ids[..255];
    let mut g = c.benchmark_group("kv-eval/clean-eval-ctx256");
    g.sample_size(10)
        .throughput(Throughput::Elements(window.len() as u64));
    let faults = |ber| FaultSpec {
        channel: ChannelKind::Bsc,
        ber,
        seed: 0,
        target: FaultTarget::Values,
        hot: None,
    };
    let mut cases = vec![("baseline-plain".to_string(), CacheMode::Plain, None)];
    for form in [
        "fp32",
        "fp16",
        "int4",
        "int4+secded84",
        "int4+secded84+interp",
        "int4+golay24",
    ] {
        cases.push((
            form.to_string(),
            CacheMode::form(form.parse().unwrap()),
            None,
        ));
    }
    cases.push((
        "int4+secded84@1e-3".into(),
        CacheMode::form("int4+secded84".parse().unwrap()),
        Some(faults(1e-3)),
    ));
    for (name, mode, f) in cases {
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut cache = KvCache::new(mode.clone(), f, 0).unwrap();
                black_box(model.forward(window, &mut cache, 128).unwrap())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
