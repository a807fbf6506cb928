//! Text generation on any KV backend: the prompt in one step (or in steps
//! of a given size), then one token per step, greedy or sampled
//! (temperature and nucleus, from a seeded stream). What happens between
//! steps (faults accumulating in a paged cache, scrubbing) is the caller's,
//! through a callback that gets the cache.

use std::time::Instant;

use attention::KvBackend;
use gf2_codes::channel::FaultRng;

use super::CausalLm;
use crate::error::{ModelError, Result};

/// How tokens are picked from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Nucleus: sample among the most likely tokens whose probabilities sum
    /// to at least this, in (0, 1].
    pub top_p: f64,
    /// Seed of the sampling stream.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Refuses a negative or non-finite temperature and a top-p outside (0, 1].
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::InvalidParameter {
                name: "temperature",
                reason: format!("{} is not a finite value ≥ 0", self.temperature),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidParameter {
                name: "top-p",
                reason: format!("{} is not in (0, 1]", self.top_p),
            });
        }
        Ok(())
    }

    /// The sampling stream of a generation: stream 1 of the seed (a batch
    /// gives request token `i` stream `1 + i` of its own seed).
    pub fn stream(&self) -> FaultRng {
        FaultRng::with_stream(self.seed, 1)
    }

    /// Picks the next token from one row of logits: the most likely (the
    /// lowest id among equals) at temperature 0 or when the probabilities
    /// are not finite, else a draw from the nucleus.
    pub fn pick(&self, logits: &[f32], rng: &mut FaultRng) -> u32 {
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .map_or(0, |(i, _)| i as u32)
        };
        let Some(Nucleus { probs, n, mass }) = self.nucleus(logits) else {
            return argmax();
        };
        let nucleus = &probs[..n];
        let mut u = rng.next_f64() * mass;
        for &(id, p) in nucleus {
            if u < p {
                return id;
            }
            u -= p;
        }
        nucleus[n - 1].0
    }

    /// The distribution [`pick`](Self::pick) draws from, over the whole
    /// vocabulary (zero outside the nucleus), or `None` where it takes the
    /// argmax (temperature 0, or no finite probability).
    pub fn distribution(&self, logits: &[f32]) -> Option<Vec<f64>> {
        let Nucleus { probs, n, mass } = self.nucleus(logits)?;
        let mut dense = vec![0.0; logits.len()];
        for &(id, p) in &probs[..n] {
            dense[id as usize] = p / mass;
        }
        Some(dense)
    }

    /// The unnormalised probabilities `exp((x − max)/T)` sorted by
    /// decreasing probability (ties by id), the nucleus' length and mass;
    /// `None` where sampling takes the argmax.
    fn nucleus(&self, logits: &[f32]) -> Option<Nucleus> {
        if self.temperature == 0.0 {
            return None;
        }
        let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, ((f64::from(x) - max) / self.temperature).exp()))
            .collect();
        let total: f64 = probs.iter().map(|p| p.1).sum();
        if !(total.is_finite() && total > 0.0) {
            return None;
        }
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut kept = 0.0;
        let mut n = 0;
        for &(_, p) in &probs {
            kept += p / total;
            n += 1;
            if kept >= self.top_p {
                break;
            }
        }
        let mass = probs[..n].iter().map(|p| p.1).sum();
        Some(Nucleus { probs, n, mass })
    }
}

/// What [`Sampling::pick`] draws from: `(id, exp((x − max)/T))` sorted by
/// decreasing probability (ties by id), the first `n` of them the nucleus
/// of unnormalised mass `mass`.
struct Nucleus {
    probs: Vec<(u32, f64)>,
    n: usize,
    mass: f64,
}

/// What to generate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Tokens the cache may hold at most (prompt and continuation).
    pub context: usize,
    /// Tokens to generate at most.
    pub max_new: usize,
    /// How tokens are picked.
    pub sampling: Sampling,
    /// Prompt tokens per step: `None` runs the prompt in one step (a
    /// server's prefill, which reads a staged form's own rows exact);
    /// `Some(n)` runs it `n` tokens at a time (a paged cache's block size:
    /// each block's queries then read the blocks before it sealed, as
    /// decoding does).
    pub prefill_step: Option<usize>,
}

/// The tokens a generation picked and how long it took.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generated {
    /// The generated token ids (without the prompt).
    pub tokens: Vec<u32>,
    /// Seconds of the prompt's steps.
    pub prefill_seconds: f64,
    /// Seconds of the decode steps (the callbacks' work included).
    pub decode_seconds: f64,
}

impl Generated {
    /// Decode steps per second (the prompt's steps excluded).
    pub fn tokens_per_second(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        if self.decode_seconds > 0.0 {
            steps as f64 / self.decode_seconds
        } else {
            0.0
        }
    }
}

/// Generates up to `options.max_new` tokens after `prompt` on `cache`
/// (empty, or holding what the prompt follows), calling `before_step` with
/// the step's index and the cache before each decode step after the first
/// token, and `on_token` with each token as soon as it is picked. An
/// empty or too long prompt and bad sampling parameters are refused before
/// any work. The callbacks' errors, and the model's as `E`, end the
/// generation.
pub fn generate<C, E>(
    model: &dyn CausalLm,
    cache: &mut C,
    prompt: &[u32],
    options: &GenerateOptions,
    mut before_step: impl FnMut(usize, &mut C) -> std::result::Result<(), E>,
    mut on_token: impl FnMut(u32) -> std::result::Result<(), E>,
) -> std::result::Result<Generated, E>
where
    C: KvBackend<Error = ModelError> + 'static,
    E: From<ModelError>,
{
    options.sampling.check()?;
    check_prompt(prompt, options)?;
    let mut rng = options.sampling.stream();
    let mut out = Generated::default();
    let started = Instant::now();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(options.prefill_step.unwrap_or(prompt.len())) {
        logits = model.forward(chunk, cache, chunk.len() - 1)?;
    }
    out.prefill_seconds = started.elapsed().as_secs_f64();
    if options.max_new == 0 {
        return Ok(out);
    }
    let mut next = options.sampling.pick(&logits[..model.vocab()], &mut rng);
    on_token(next)?;
    out.tokens.push(next);
    let started = Instant::now();
    // The picked token enters the cache with the next step.
    while out.tokens.len() < options.max_new && prompt.len() + out.tokens.len() <= options.context {
        before_step(out.tokens.len() - 1, cache)?;
        let logits = model.forward(&[next], cache, 0)?;
        next = options.sampling.pick(&logits, &mut rng);
        on_token(next)?;
        out.tokens.push(next);
    }
    out.decode_seconds = started.elapsed().as_secs_f64();
    Ok(out)
}

/// Refuses an empty prompt, one longer than the context, and prompt steps
/// of no token.
pub fn check_prompt(prompt: &[u32], options: &GenerateOptions) -> Result<()> {
    if prompt.is_empty() {
        return Err(ModelError::InvalidParameter {
            name: "prompt",
            reason: "the prompt has no token".into(),
        });
    }
    if prompt.len() > options.context {
        return Err(ModelError::InvalidParameter {
            name: "prompt",
            reason: format!(
                "{} tokens do not fit a context of {}",
                prompt.len(),
                options.context
            ),
        });
    }
    if options.prefill_step == Some(0) {
        return Err(ModelError::InvalidParameter {
            name: "prefill-step",
            reason: "a prefill step holds at least one token".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled(temperature: f64, top_p: f64) -> Sampling {
        Sampling {
            temperature,
            top_p,
            seed: 7,
        }
    }

    #[test]
    fn greedy_picks_the_largest_logit_and_the_lowest_id_among_equals() {
        let mut rng = Sampling::default().stream();
        let greedy = Sampling::default();
        assert_eq!(greedy.pick(&[0.1, 2.0, -1.0, 2.0], &mut rng), 1);
        // Non-finite probabilities fall back to the argmax.
        assert_eq!(sampled(1.0, 1.0).pick(&[f32::NAN; 3], &mut rng), 0);
    }

    #[test]
    fn draws_follow_the_softmax_within_its_nucleus() {
        // Probabilities 1/6, 2/6, 3/6 at temperature 1.
        let logits = [0.0, 2f32.ln(), 3f32.ln()];
        let s = sampled(1.0, 1.0);
        let mut rng = s.stream();
        let n = 60_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[s.pick(&logits, &mut rng) as usize] += 1;
        }
        for (c, p) in counts.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
            // Six standard deviations of a binomial count.
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            assert!((*c as f64 - n as f64 * p).abs() < 6.0 * sd, "{counts:?}");
        }
        // A nucleus of 0.5 keeps the most likely token alone.
        let top = sampled(1.0, 0.5);
        let mut rng = top.stream();
        assert!((0..100).all(|_| top.pick(&logits, &mut rng) == 2));
    }

    #[test]
    fn bad_parameters_are_refused() {
        for s in [
            sampled(-0.1, 1.0),
            sampled(f64::NAN, 1.0),
            sampled(f64::INFINITY, 1.0),
            sampled(1.0, 0.0),
            sampled(1.0, 1.5),
        ] {
            assert!(matches!(
                s.check(),
                Err(ModelError::InvalidParameter { .. })
            ));
        }
        let options = GenerateOptions {
            context: 4,
            max_new: 2,
            sampling: Sampling::default(),
            prefill_step: None,
        };
        assert!(check_prompt(&[], &options).is_err());
        assert!(check_prompt(&[1; 5], &options).is_err());
        let zero = GenerateOptions {
            prefill_step: Some(0),
            ..options
        };
        assert!(check_prompt(&[1], &zero).is_err());
        assert!(check_prompt(&[1; 4], &options).is_ok());
    }
}
