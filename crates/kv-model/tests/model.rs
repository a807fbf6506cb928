//! The forward pass's contract with what plugs into it: a projection hook
//! sees every projection once per pass, in `projections()` order, and a
//! hook computing the plain product leaves the logits' bits unchanged; an
//! error of a hook or backend defined elsewhere comes back whole and
//! leaves the cache as it was before the step; bad input gets typed errors;
//! weight guards over `projections_mut()` repair flipped weights to the
//! model's bits.

mod common;

use std::sync::{Arc, Mutex};

use attention::{DenseBackend, KvBackend};
use kv_model::ModelError;
use kv_model::model::{
    Adapted, CausalLm, LlamaModel, Projection, ProjectionHook, ProjectionId, RowRepair, WeightGuard,
};
use kv_model::weights::Isa;

use common::{LAYERS, VOCAB, model};

/// Computes the plain product and records which projection it was; fails
/// the call numbered `fail_at` (counting from 0) if set.
#[derive(Debug, Default)]
struct Recorder {
    seen: Mutex<Vec<ProjectionId>>,
    fail_at: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
#[error("refused by the test's hook")]
struct Refused;

impl ProjectionHook for Recorder {
    fn project(
        &self,
        id: ProjectionId,
        weights: &Projection,
        x: &[f32],
        out: &mut [f32],
        accumulate: bool,
    ) -> Result<(), ModelError> {
        let mut seen = self.seen.lock().unwrap();
        if self.fail_at == Some(seen.len()) {
            return Err(ModelError::External(Box::new(Refused)));
        }
        seen.push(id);
        weights.product_into(out, x, accumulate, Isa::detect())
    }
}

fn logits(m: &LlamaModel, tokens: &[u32]) -> Vec<f32> {
    let mut cache = Adapted(DenseBackend::new());
    m.forward(tokens, &mut cache, 0).unwrap()
}

#[test]
fn a_hook_sees_every_projection_once_per_pass_and_changes_no_bit() {
    let tokens: Vec<u32> = (0..9).map(|i| (i * 7 % VOCAB) as u32).collect();
    let plain = model();
    let want = logits(&plain, &tokens);
    let mut hooked = model();
    let hook = Arc::new(Recorder::default());
    hooked.set_projection_hook(Some(hook.clone()));
    let got = logits(&hooked, &tokens);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want));
    let order: Vec<ProjectionId> = hooked.projections().iter().map(|p| p.0).collect();
    assert_eq!(order.len(), 4 * LAYERS + 1);
    assert_eq!(*hook.seen.lock().unwrap(), order);
    // A clone starts without the hook: its pass adds nothing.
    let _ = logits(&hooked.clone(), &tokens);
    assert_eq!(hook.seen.lock().unwrap().len(), order.len());
}

#[test]
fn guards_over_projections_mut_repair_flipped_weights_to_the_models_bits() {
    let tokens: Vec<u32> = (0..9).map(|i| (i * 5 % VOCAB) as u32).collect();
    let mut m = model();
    let want = logits(&m, &tokens);
    let ids: Vec<ProjectionId> = m.projections().iter().map(|p| p.0).collect();
    let ids_mut: Vec<ProjectionId> = m.projections_mut().iter().map(|p| p.0).collect();
    assert_eq!(ids, ids_mut);
    let mut guards: Vec<WeightGuard> = m
        .projections()
        .iter()
        .map(|(_, p)| WeightGuard::new(p, 4).unwrap())
        .collect();
    // One sign bit in every projection, two bits of one row in the first.
    for (i, (_, p)) in m.projections_mut().into_iter().enumerate() {
        let (bytes, row_bytes) = &mut p.byte_rows_mut()[0];
        bytes[(i % 3) * *row_bytes + 3] ^= 0x80;
        if i == 0 {
            bytes[*row_bytes + 7] ^= 0x80;
            bytes[*row_bytes + 11] ^= 0x01;
        }
    }
    assert_ne!(logits(&m, &tokens), want);
    let mut repairs = Vec::new();
    for (guard, (_, p)) in guards.iter_mut().zip(m.projections_mut()) {
        let (report, fates) = guard.check(p).unwrap();
        assert_eq!(report.unrepaired, 0);
        repairs.extend(fates.into_iter().map(|f| f.repair));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&logits(&m, &tokens)), bits(&want));
    assert_eq!(repairs.len(), ids.len() + 1);
    assert_eq!(
        repairs
            .iter()
            .filter(|r| **r == Some(RowRepair::Parity))
            .count(),
        1
    );
}

#[test]
fn a_failing_hook_comes_back_whole_and_the_step_is_rolled_back() {
    let mut m = model();
    let mut cache = Adapted(DenseBackend::new());
    m.forward(&[1, 2, 3], &mut cache, 0).unwrap();
    let hook = Arc::new(Recorder {
        fail_at: Some(5),
        ..Recorder::default()
    });
    m.set_projection_hook(Some(hook));
    match m.forward(&[4, 5], &mut cache, 0) {
        Err(ModelError::External(e)) => assert!(e.downcast_ref::<Refused>().is_some(), "{e}"),
        other => panic!("expected the hook's error, got {other:?}"),
    }
    assert_eq!(cache.tokens(), 3, "the failed step left rows behind");
}

#[test]
fn bad_input_gets_typed_errors() {
    let m = model();
    let mut cache = Adapted(DenseBackend::new());
    assert!(matches!(
        m.forward(&[VOCAB as u32], &mut cache, 0),
        Err(ModelError::TokenId { id, vocab: VOCAB }) if id == VOCAB as u32
    ));
    assert!(matches!(
        m.forward(&[], &mut cache, 0),
        Err(ModelError::EmptyForward { tokens: 0, .. })
    ));
    assert!(matches!(
        m.forward(&[1, 2], &mut cache, 3),
        Err(ModelError::EmptyForward {
            tokens: 2,
            logits_from: 3
        })
    ));
    assert_eq!(cache.tokens(), 0);
}

#[test]
fn generation_is_the_greedy_loop_and_refuses_bad_input_before_any_work() {
    use kv_model::model::{GenerateOptions, Sampling, generate};
    let m = model();
    let prompt = [3, 1, 4, 1, 5];
    let options = GenerateOptions {
        context: 32,
        max_new: 6,
        sampling: Sampling::default(),
        prefill_step: Some(2),
    };
    let mut steps = Vec::new();
    let mut seen = Vec::new();
    let mut cache = Adapted(DenseBackend::new());
    let got = generate(
        &m,
        &mut cache,
        &prompt,
        &options,
        |step, _: &mut Adapted<DenseBackend>| {
            steps.push(step);
            Ok::<(), ModelError>(())
        },
        |t| {
            seen.push(t);
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(got.tokens, seen);
    assert_eq!(steps, (0..5).collect::<Vec<_>>());
    assert_eq!(cache.tokens(), prompt.len() + 5);
    // The same tokens by hand: the whole prompt, then argmax after argmax.
    let mut hand = Adapted(DenseBackend::new());
    let mut logits = m.forward(&prompt, &mut hand, prompt.len() - 1).unwrap();
    let mut want = Vec::new();
    for _ in 0..6 {
        let next = (0..VOCAB)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        want.push(next);
        logits = m.forward(&[next], &mut hand, 0).unwrap();
    }
    assert_eq!(got.tokens, want);
    // An over-long prompt: refused, no callback, nothing cached.
    let mut fresh = Adapted(DenseBackend::new());
    let long = vec![1; 33];
    let refused = generate(
        &m,
        &mut fresh,
        &long,
        &options,
        |_, _: &mut Adapted<DenseBackend>| Ok::<(), ModelError>(()),
        |_| panic!("a token from a refused generation"),
    );
    assert!(matches!(
        refused,
        Err(ModelError::InvalidParameter { name: "prompt", .. })
    ));
    assert_eq!(fresh.tokens(), 0);
}

/// A greedy request served in a batch (with others, on the paged cache)
/// generates what it generates alone.
#[test]
fn a_batched_request_generates_what_it_generates_alone() {
    use kv_model::model::batch::{BatchRequest, serve_batch};
    use kv_model::model::{GenerateOptions, Sampling, generate};
    use paged_cache::scheduler::SchedulerConfig;
    use paged_cache::{BlockStorage, CacheConfig, KvCacheManager, LayerSpec, NoPrefixCache};

    let m = model();
    let prompts: [&[u32]; 3] = [&[3, 1, 4, 1, 5], &[9, 2, 6], &[5, 3, 5, 8, 9, 7, 9]];
    let requests: Vec<BatchRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| BatchRequest {
            prompt: p.to_vec(),
            max_new_tokens: 4 + i,
            arrival_step: i as u64,
            priority: 0,
            sampling: Sampling::default(),
        })
        .collect();
    let config = CacheConfig {
        num_blocks: 16,
        block_size: 4,
        host_blocks: 0,
    };
    let form = "fp32".parse::<kv_quant::CacheForm>().unwrap();
    let layers = vec![LayerSpec::uniform(form, m.kv_channels()); LAYERS];
    let storage = BlockStorage::new(config.num_blocks, config.block_size, &layers).unwrap();
    let mut cache = KvCacheManager::with_storage(config, NoPrefixCache, Arc::new(storage)).unwrap();
    let mut finished = Vec::new();
    let served = serve_batch(
        &m,
        &requests,
        &mut cache,
        &SchedulerConfig::default(),
        &mut |i, _| {
            finished.push(i);
            Ok(())
        },
    )
    .unwrap();
    finished.sort_unstable();
    assert_eq!(finished, [0, 1, 2]);
    for (q, out) in requests.iter().zip(&served.outputs) {
        let options = GenerateOptions {
            context: 64,
            max_new: q.max_new_tokens,
            sampling: q.sampling,
            prefill_step: None,
        };
        let mut alone = Adapted(DenseBackend::new());
        let want = generate(
            &m,
            &mut alone,
            &q.prompt,
            &options,
            |_, _: &mut Adapted<DenseBackend>| Ok::<(), ModelError>(()),
            |_| Ok(()),
        )
        .unwrap();
        assert_eq!(out.tokens, want.tokens);
    }
}
