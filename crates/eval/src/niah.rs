//! Needle in a haystack: can the model still find a fact far back in its
//! context when its KV cache is compressed or protected?
//!
//! A prompt of a given length holds an instruction, filler text (the
//! haystack: any long text, by default the Jargon File), a needle at a
//! given depth (`The pass key is 71432. Remember it. 71432 is the pass key.`)
//! and a question (`What is the pass key? The pass key is`). The model
//! answers by greedy generation through the cache form under test; a cell
//! is found when the first run of digits in the answer is the passkey. The
//! grid is every length × every depth; each cell has its own seeded passkey.
//!
//! The prompt is assembled from token ids (instruction, filler, needle,
//! question tokenized apart), so its length is exact; the needle is placed
//! after the filler token nearest the requested depth that ends a sentence
//! or a line, so it never splits a word.

use kv_model::model::Sampling;
use std::path::{Path, PathBuf};

use gf2_codes::channel::FaultRng;
use serde::Serialize;

use crate::cache::CacheMode;
use crate::error::{EvalError, Result};
use crate::generate::{GenerateConfig, generate};
use kv_model::model::CausalLm;
use kv_model::tokenizer::{ReadLimits, TextTokenizer};

/// The instruction before the haystack.
pub const INSTRUCTION: &str = "There is an important piece of information hidden inside a lot of \
     irrelevant text. Find it and memorize it. I will quiz you about it.\n\n";
/// The question after the haystack.
pub const QUESTION: &str = "\n\nWhat is the pass key? The pass key is";

/// The needle sentence for `key`.
pub fn needle(key: &str) -> String {
    format!(" The pass key is {key}. Remember it. {key} is the pass key. ")
}

/// The grid and the passkeys.
#[derive(Clone, Debug, PartialEq)]
pub struct NiahConfig {
    /// Prompt lengths in tokens (instruction, haystack, needle and question).
    pub lengths: Vec<usize>,
    /// Needle depths as fractions of the haystack, in [0, 1].
    pub depths: Vec<f64>,
    /// Digits of each passkey.
    pub digits: u32,
    /// Seed of the passkeys (cell `i` draws from stream `i`).
    pub seed: u64,
}

impl Default for NiahConfig {
    /// Lengths 1K, 2K, 4K and 8K tokens; depths 0, ¼, ½, ¾ and 1; 5 digits.
    fn default() -> Self {
        Self {
            lengths: vec![1024, 2048, 4096, 8192],
            depths: vec![0.0, 0.25, 0.5, 0.75, 1.0],
            digits: 5,
            seed: 0,
        }
    }
}

impl NiahConfig {
    /// Refuses an empty grid, depths outside [0, 1] and passkeys of 0 or
    /// more than 9 digits.
    pub fn check(&self) -> Result<()> {
        let bad = |name, reason: String| Err(EvalError::InvalidParameter { name, reason });
        if self.lengths.is_empty() || self.depths.is_empty() {
            return bad("grid", "at least one length and one depth".into());
        }
        if let Some(d) = self.depths.iter().find(|d| !(0.0..=1.0).contains(*d)) {
            return bad("depth", format!("{d} is not in [0, 1]"));
        }
        if !(1..=9).contains(&self.digits) {
            return bad("digits", format!("{} is not in 1..=9", self.digits));
        }
        Ok(())
    }

    /// The passkey of cell `index`: `digits` decimal digits, the first not 0.
    pub fn passkey(&self, index: usize) -> String {
        let mut rng = FaultRng::with_stream(self.seed, index as u64);
        let low = 10u64.pow(self.digits - 1);
        let span = 9 * low;
        (low + rng.below(span)).to_string()
    }
}

/// A long text as haystack: whitespace reflowed (a run holding a blank line
/// becomes a paragraph break, any other run one space), starting at
/// `start` when the text holds it (past the Jargon File's front matter).
#[derive(Clone, Debug, PartialEq)]
pub struct Haystack {
    text: String,
}

impl Haystack {
    /// Where the Jargon File's prose begins.
    pub const JARGON_START: &'static str = "Chapter 1. Hacker Slang and Hacker Culture";

    /// The largest haystack file read (the Jargon File is 1.4 MB).
    pub const MAX_BYTES: u64 = 256 << 20;

    /// Reflows `raw` from the first `start` on (the whole text when absent).
    pub fn from_text(raw: &str, start: Option<&str>) -> Self {
        let from = start.and_then(|s| raw.find(s)).unwrap_or(0);
        let mut text = String::with_capacity(raw.len() - from);
        for para in raw[from..].split("\n\n").map(str::trim) {
            if para.is_empty() {
                continue;
            }
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            let mut words = para.split_whitespace();
            if let Some(w) = words.next() {
                text.push_str(w);
            }
            for w in words {
                text.push(' ');
                text.push_str(w);
            }
        }
        Self { text }
    }

    /// Reads and reflows a file; a missing file names what to fetch.
    pub fn open(path: &Path) -> Result<Self> {
        let raw = crate::paths::read_text_at_most(path, Self::MAX_BYTES).map_err(|e| {
            let hint = if path.exists() {
                format!(
                    "pass --haystack with a UTF-8 text of at most {} bytes",
                    Self::MAX_BYTES
                )
            } else {
                "run `cargo xtask fetch-model` (it fetches the Jargon File from Debian's \
                 jargon-text) or pass --haystack with a long UTF-8 text"
                    .into()
            };
            EvalError::InvalidParameter {
                name: "haystack",
                reason: format!("cannot read {} ({e}): {hint}", path.display()),
            }
        })?;
        Ok(Self::from_text(&raw, Some(Self::JARGON_START)))
    }

    /// The reflowed text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The first `n` token ids of the haystack; a haystack too short for
    /// `n` is refused, naming the shortfall.
    pub fn tokens(&self, tokenizer: &TextTokenizer, n: usize) -> Result<Vec<u32>> {
        // Small blocks: a few thousand tokens are read, not the whole text.
        let limits = ReadLimits {
            max_tokens: Some(n),
            block_bytes: 64 << 10,
            ..ReadLimits::default()
        };
        let ids = tokenizer.encode_reader_plain(self.text.as_bytes(), limits)?;
        if ids.len() < n {
            return Err(EvalError::InvalidParameter {
                name: "haystack",
                reason: format!(
                    "{} tokens of haystack, {n} needed: pass --haystack with a longer text \
                     (the Jargon File from `cargo xtask fetch-model` holds about 400K tokens)",
                    ids.len()
                ),
            });
        }
        Ok(ids)
    }
}

/// One prompt of the grid.
#[derive(Clone, Debug, PartialEq)]
pub struct NiahPrompt {
    /// The token ids.
    pub ids: Vec<u32>,
    /// The passkey.
    pub passkey: String,
    /// Index of the needle's first token.
    pub needle_at: usize,
}

/// Builds the prompt of `length` tokens with the needle for `passkey` at
/// `depth` of the filler `haystack` (which must hold enough tokens).
pub fn build_prompt(
    tokenizer: &TextTokenizer,
    haystack: &[u32],
    length: usize,
    depth: f64,
    passkey: &str,
) -> Result<NiahPrompt> {
    let intro = tokenizer.encode(INSTRUCTION)?;
    let needle = tokenizer.encode_plain(&needle(passkey))?;
    let question = tokenizer.encode_plain(QUESTION)?;
    let fixed = intro.len() + needle.len() + question.len();
    let filler = length
        .checked_sub(fixed)
        .filter(|&f| f > 0)
        .ok_or_else(|| EvalError::InvalidParameter {
            name: "length",
            reason: format!("{length} tokens leave no room for a haystack ({fixed} are fixed)"),
        })?;
    if haystack.len() < filler {
        return Err(EvalError::InvalidParameter {
            name: "haystack",
            reason: format!("{} tokens of haystack, {filler} needed", haystack.len()),
        });
    }
    let filler = &haystack[..filler];
    let cut = sentence_cut(tokenizer, filler, depth)?;
    let mut ids = Vec::with_capacity(length);
    ids.extend_from_slice(&intro);
    ids.extend_from_slice(&filler[..cut]);
    let needle_at = ids.len();
    ids.extend_from_slice(&needle);
    ids.extend_from_slice(&filler[cut..]);
    ids.extend_from_slice(&question);
    debug_assert_eq!(ids.len(), length);
    Ok(NiahPrompt {
        ids,
        passkey: passkey.to_string(),
        needle_at,
    })
}

/// The cut of `filler` nearest `depth` that follows a token ending a
/// sentence or a line (within 64 tokens), else the exact position; 0 and
/// the end stay exact.
fn sentence_cut(tokenizer: &TextTokenizer, filler: &[u32], depth: f64) -> Result<usize> {
    let n = filler.len();
    let target = (depth * n as f64).round() as usize;
    if target == 0 || target >= n {
        return Ok(target.min(n));
    }
    let ends_sentence = |i: usize| -> Result<bool> {
        let t = tokenizer.decode(&filler[i - 1..i])?;
        Ok(t.ends_with(['.', '!', '?', '\n']))
    };
    for offset in 0..=64usize {
        for i in [target.checked_sub(offset), target.checked_add(offset)]
            .into_iter()
            .flatten()
        {
            if (1..n).contains(&i) && ends_sentence(i)? {
                return Ok(i);
            }
        }
    }
    Ok(target)
}

/// The first run of ASCII digits in `answer`, if any.
pub fn first_number(answer: &str) -> Option<&str> {
    let start = answer.find(|c: char| c.is_ascii_digit())?;
    let rest = &answer[start..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

/// One cell's outcome.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NiahCell {
    /// Prompt tokens.
    pub length: usize,
    /// Needle depth.
    pub depth: f64,
    /// Token index of the needle.
    pub needle_at: usize,
    /// The passkey.
    pub passkey: String,
    /// The model's answer (decoded continuation).
    pub answer: String,
    /// Whether the answer's first number is the passkey.
    pub found: bool,
}

/// The grid of one cache form.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NiahGrid {
    /// The form (`plain`, `int4+secded84`, ...).
    pub form: String,
    /// Cells, length-major.
    pub cells: Vec<NiahCell>,
    /// Cells found.
    pub found: usize,
    /// Seconds the grid took.
    pub seconds: f64,
}

impl NiahGrid {
    /// Fraction of cells found.
    pub fn recall(&self) -> f64 {
        if self.cells.is_empty() {
            0.0
        } else {
            self.found as f64 / self.cells.len() as f64
        }
    }
}

/// Runs the grid for one cache `mode` (generation settings from `base`:
/// backend and context; greedy), calling `on_cell` after each cell.
pub fn run_grid(
    model: &dyn CausalLm,
    tokenizer: &TextTokenizer,
    haystack: &[u32],
    config: &NiahConfig,
    mode: &CacheMode,
    base: &GenerateConfig,
    mut on_cell: impl FnMut(&NiahCell),
) -> Result<NiahGrid> {
    config.check()?;
    let started = std::time::Instant::now();
    let mut cells = Vec::new();
    for (li, &length) in config.lengths.iter().enumerate() {
        for (di, &depth) in config.depths.iter().enumerate() {
            let passkey = config.passkey(li * config.depths.len() + di);
            let prompt = build_prompt(tokenizer, haystack, length, depth, &passkey)?;
            let gen_config = GenerateConfig {
                mode: mode.clone(),
                context: length + config.digits as usize + 4,
                max_new: config.digits as usize + 3,
                sampling: Sampling::default(),
                faults: None,
                ..base.clone()
            };
            let out = generate(model, &prompt.ids, &gen_config, |_| Ok(()))?;
            let answer = tokenizer.decode(&out.tokens)?;
            let found = first_number(&answer) == Some(passkey.as_str());
            let cell = NiahCell {
                length,
                depth,
                needle_at: prompt.needle_at,
                passkey,
                answer,
                found,
            };
            on_cell(&cell);
            cells.push(cell);
        }
    }
    Ok(NiahGrid {
        form: match base.eviction {
            Some(e) => format!("{} {}", mode.label(), crate::metrics::eviction_label(&e)),
            None => mode.label(),
        },
        found: cells.iter().filter(|c| c.found).count(),
        cells,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The grids of several forms on one model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NiahReport {
    /// The model file.
    pub model: String,
    /// The haystack file.
    pub haystack: String,
    /// Prompt lengths.
    pub lengths: Vec<usize>,
    /// Needle depths.
    pub depths: Vec<f64>,
    /// Passkey seed.
    pub seed: u64,
    /// One grid per form.
    pub grids: Vec<NiahGrid>,
}

impl NiahReport {
    /// The recall grids as Markdown: one table per form (✓ found, · missed).
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "# Needle in a haystack\n\nModel `{}`, haystack `{}`, passkey seed {}. \
             Rows: prompt tokens; columns: needle depth.\n\n",
            self.model, self.haystack, self.seed
        );
        s.push_str("| form | found | recall |\n|---|---|---|\n");
        for g in &self.grids {
            s.push_str(&format!(
                "| `{}` | {} of {} | {:.3} |\n",
                g.form,
                g.found,
                g.cells.len(),
                g.recall()
            ));
        }
        for g in &self.grids {
            s.push_str(&format!("\n## `{}`\n\n| tokens |", g.form));
            for d in &self.depths {
                s.push_str(&format!(" {d} |"));
            }
            s.push_str("\n|---|");
            s.push_str(&"---|".repeat(self.depths.len()));
            s.push('\n');
            for (row, length) in g.cells.chunks(self.depths.len()).zip(&self.lengths) {
                s.push_str(&format!("| {length} |"));
                for c in row {
                    s.push_str(if c.found { " ✓ |" } else { " · |" });
                }
                s.push('\n');
            }
        }
        s
    }

    /// Writes `niah.md`, `niah.json` and `niah.svg` (a heat map per form)
    /// into `dir`; returns their paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let plot = |path: &Path| crate::niah_plot::heat_maps(self, path);
        crate::report_files::write(dir, "niah", &self.markdown(), Some(self), Some(&plot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_number_reads_the_first_digit_run() {
        assert_eq!(first_number(" 71432. Remember"), Some("71432"));
        assert_eq!(first_number(" is 7 1432"), Some("7"));
        assert_eq!(first_number("no digits"), None);
        assert_eq!(first_number("9"), Some("9"));
    }

    #[test]
    fn passkeys_have_their_digits_and_depend_on_seed_and_cell() {
        let c = NiahConfig::default();
        let keys: Vec<String> = (0..20).map(|i| c.passkey(i)).collect();
        assert!(keys.iter().all(|k| k.len() == 5 && !k.starts_with('0')));
        assert_eq!(keys[3], c.passkey(3));
        assert!(keys.iter().collect::<std::collections::HashSet<_>>().len() > 15);
        let other = NiahConfig { seed: 1, ..c };
        assert_ne!(other.passkey(3), keys[3]);
    }

    #[test]
    fn bad_grids_are_refused() {
        let ok = NiahConfig::default();
        ok.check().unwrap();
        for bad in [
            NiahConfig {
                lengths: vec![],
                ..ok.clone()
            },
            NiahConfig {
                depths: vec![1.5],
                ..ok.clone()
            },
            NiahConfig {
                depths: vec![f64::NAN],
                ..ok.clone()
            },
            NiahConfig {
                digits: 0,
                ..ok.clone()
            },
            NiahConfig {
                digits: 12,
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.check(), Err(EvalError::InvalidParameter { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn haystacks_are_reflowed_from_their_start() {
        let raw = "front matter\n\nChapter 1. Hacker Slang and Hacker Culture\n\n   This  is\n   a para.\n\n\n\n  Next\tone.\n";
        let h = Haystack::from_text(raw, Some(Haystack::JARGON_START));
        assert_eq!(
            h.text(),
            "Chapter 1. Hacker Slang and Hacker Culture\n\nThis is a para.\n\nNext one."
        );
        let whole = Haystack::from_text("a  b", Some("missing"));
        assert_eq!(whole.text(), "a b");
    }
}
