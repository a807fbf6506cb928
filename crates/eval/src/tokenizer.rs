//! The byte-level BPE tokenizer of a GGUF file, built with the `tokenizers`
//! crate from the file's vocabulary and merges.
//!
//! GGUF stores a GPT-2-style tokenizer as `tokenizer.ggml.tokens` (the
//! byte-level strings, `Ġthe`), `tokenizer.ggml.merges` (`"Ġ t"`, in rank
//! order) and `tokenizer.ggml.pre` naming llama.cpp's pre-tokenizer. For
//! `smollm` that pre-tokenizer splits every digit on its own and then applies
//! the GPT-2 regex, which is `Digits(individual) → ByteLevel(regex)` here,
//! the pre-tokenizer of SmolLM2's own `tokenizer.json`. Special tokens are
//! not parsed from text, matching `llama-perplexity`, which tokenizes with
//! `parse_special = false`.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

use crate::error::{EvalError, Result};
use crate::load::gguf::{GgufFile, MetaValue};

/// A text tokenizer with the vocabulary of a model.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    vocab: usize,
    bos: Option<u32>,
    add_bos: bool,
    /// Let the tokenizer's own post-processor add special tokens (Hugging
    /// Face `tokenizer.json` files) instead of `add_bos`.
    post_process: bool,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab", &self.vocab)
            .field("bos", &self.bos)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> EvalError {
    EvalError::Tokenizer(e.to_string())
}

impl TextTokenizer {
    /// Builds the tokenizer stored in a GGUF file (`tokenizer.ggml.model`
    /// must be `gpt2`, the byte-level BPE).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.meta_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(EvalError::Tokenizer(format!(
                "tokenizer model {model:?} (only the byte-level BPE \"gpt2\" is supported)"
            )));
        }
        let strings = |key: &str| -> Result<Vec<&str>> {
            file.meta(key)
                .and_then(MetaValue::as_array)
                .ok_or_else(|| EvalError::Tokenizer(format!("missing array {key}")))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| EvalError::Tokenizer(format!("{key} holds a non-string")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| EvalError::Tokenizer(format!("merge {m:?} has no space")))
            })
            .collect::<Result<Vec<_>>>()?;
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let pre = file.meta("tokenizer.ggml.pre").and_then(MetaValue::as_str);
        let byte_level = ByteLevel::new(false, true, true);
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            // llama.cpp's SMOLLM (and STARCODER, REFACT) pre-tokenizer: single
            // digits, then the GPT-2 split.
            Some("smollm" | "starcoder" | "refact") => {
                Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
            }
            Some("gpt-2" | "default") | None => byte_level.into(),
            Some(other) => {
                return Err(EvalError::Tokenizer(format!(
                    "pre-tokenizer {other:?} is not supported (smollm, starcoder, refact, gpt-2 are)"
                )));
            }
        };
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .with_pre_tokenizer(Some(pre_tokenizer))
            .with_decoder(Some(ByteLevelDecoder::default()));
        let bos = file
            .meta("tokenizer.ggml.bos_token_id")
            .and_then(MetaValue::as_u64)
            .map(|b| b as u32);
        let add_bos = matches!(
            file.meta("tokenizer.ggml.add_bos_token"),
            Some(MetaValue::Bool(true))
        );
        Ok(Self {
            inner,
            vocab: tokens.len(),
            bos,
            add_bos,
            post_process: false,
        })
    }

    /// Reads a Hugging Face `tokenizer.json`; its post-processor decides
    /// which special tokens `encode` adds.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| EvalError::Tokenizer(format!("{}: {e}", path.display())))?;
        let vocab = inner.get_vocab_size(true);
        Ok(Self {
            inner,
            vocab,
            bos: None,
            add_bos: false,
            post_process: true,
        })
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Whether the model expects a BOS token first (GGUF `add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The BOS id, if the file names one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Token ids of `text`, with the BOS token first when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, self.post_process)
            .map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos
            && let Some(b) = self.bos
        {
            ids.push(b);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }
}
