//! The needle test's parts on the tiny random Qwen2 (a byte-level
//! tokenizer, so prompts are real token sequences): prompts of exactly the
//! asked length with the needle at the asked depth after a sentence end,
//! the grid run end to end and reproducibly, and the errors a bad haystack
//! or length gets. The real models' grids are in docs/niah.md.

mod common;

use common::qwen2::tiny_qwen2_gguf;
use kv_eval::EvalError;
use kv_eval::backend::BackendKind;
use kv_eval::cache::CacheMode;
use kv_eval::generate::GenerateConfig;
use kv_eval::niah::{Haystack, NiahConfig, build_prompt, needle, run_grid};
use kv_model::gguf::GgufFile;
use kv_model::model::LlamaModel;
use kv_model::model::Sampling;
use kv_model::tokenizer::TextTokenizer;

fn tiny() -> (LlamaModel, TextTokenizer) {
    let file = GgufFile::from_bytes(tiny_qwen2_gguf()).unwrap();
    (
        LlamaModel::from_gguf(&file).unwrap(),
        TextTokenizer::from_gguf(&file).unwrap(),
    )
}

fn haystack() -> Haystack {
    let para = "The hacker wrote code all night. Then the tests ran!\nSome of them failed, \
                and the build was red. Was it the cache? Nobody knew.\n\n";
    Haystack::from_text(&para.repeat(40), None)
}

#[test]
fn prompts_have_the_asked_length_and_the_needle_at_a_sentence_end() {
    let (_, tok) = tiny();
    let hay = haystack().tokens(&tok, 3000).unwrap();
    let needle_ids = tok.encode_plain(&needle("12345")).unwrap();
    for length in [400, 777, 1500] {
        for depth in [0.0, 0.3, 0.5, 1.0] {
            let p = build_prompt(&tok, &hay, length, depth, "12345").unwrap();
            assert_eq!(p.ids.len(), length);
            assert_eq!(
                &p.ids[p.needle_at..p.needle_at + needle_ids.len()],
                &needle_ids[..]
            );
            let text = tok.decode(&p.ids).unwrap();
            assert!(text.contains("The pass key is 12345. Remember it."));
            assert!(text.ends_with("What is the pass key? The pass key is"));
            let intro = tok.encode(kv_eval::niah::INSTRUCTION).unwrap().len();
            let filler = length
                - intro
                - needle_ids.len()
                - tok.encode_plain(kv_eval::niah::QUESTION).unwrap().len();
            let cut = p.needle_at - intro;
            // Within 64 tokens of the asked depth, after a sentence or line end.
            let target = (depth * filler as f64).round() as usize;
            assert!(cut.abs_diff(target) <= 64, "cut {cut}, target {target}");
            if cut > 0 && cut < filler {
                let before = tok.decode(&p.ids[p.needle_at - 1..p.needle_at]).unwrap();
                assert!(before.ends_with(['.', '!', '?', '\n']), "{before:?}");
            }
        }
    }
}

#[test]
fn bad_lengths_and_short_haystacks_are_refused() {
    let (_, tok) = tiny();
    let hay = haystack().tokens(&tok, 500).unwrap();
    assert!(matches!(
        build_prompt(&tok, &hay, 20, 0.5, "12345"),
        Err(EvalError::InvalidParameter { name: "length", .. })
    ));
    assert!(matches!(
        build_prompt(&tok, &hay, 2000, 0.5, "12345"),
        Err(EvalError::InvalidParameter {
            name: "haystack",
            ..
        })
    ));
    match haystack().tokens(&tok, 1_000_000) {
        Err(EvalError::InvalidParameter {
            name: "haystack",
            reason,
        }) => {
            assert!(reason.contains("--haystack"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    match Haystack::open(std::path::Path::new("/nonexistent/haystack.txt")) {
        Err(EvalError::InvalidParameter {
            name: "haystack",
            reason,
        }) => {
            assert!(reason.contains("cargo xtask fetch-model"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_grid_runs_end_to_end_and_reproducibly() {
    let (model, tok) = tiny();
    let hay = haystack().tokens(&tok, 600).unwrap();
    let config = NiahConfig {
        lengths: vec![300, 600],
        depths: vec![0.0, 0.5, 1.0],
        digits: 5,
        seed: 7,
    };
    let mode = CacheMode::parse("int4+secded84").unwrap();
    let base = GenerateConfig {
        mode: mode.clone(),
        backend: BackendKind::Paged { block_size: 16 },
        context: 600,
        max_new: 0,
        sampling: Sampling::default(),
        faults: None,
        prefill_step: None,
        eviction: None,
    };
    let mut seen = 0;
    let a = run_grid(&model, &tok, &hay, &config, &mode, &base, |_| seen += 1).unwrap();
    assert_eq!((a.cells.len(), seen), (6, 6));
    assert_eq!(a.form, "int4+secded84");
    for (i, c) in a.cells.iter().enumerate() {
        assert_eq!(c.passkey, config.passkey(i));
        assert_eq!(
            c.found,
            kv_eval::niah::first_number(&c.answer) == Some(c.passkey.as_str())
        );
    }
    assert_eq!(a.found, a.cells.iter().filter(|c| c.found).count());
    let b = run_grid(&model, &tok, &hay, &config, &mode, &base, |_| {}).unwrap();
    assert_eq!(
        a.cells.iter().map(|c| &c.answer).collect::<Vec<_>>(),
        b.cells.iter().map(|c| &c.answer).collect::<Vec<_>>()
    );
}
