//! The byte-level BPE tokenizer of a GGUF file, built with the `tokenizers`
//! crate from the file's vocabulary and merges.
//!
//! GGUF stores a GPT-2-style tokenizer as `tokenizer.ggml.tokens` (the
//! byte-level strings, `Ġthe`), `tokenizer.ggml.merges` (`"Ġ t"`, in rank
//! order) and `tokenizer.ggml.pre` naming llama.cpp's pre-tokenizer. For
//! `smollm` that pre-tokenizer splits every digit on its own and then applies
//! the GPT-2 regex, which is `Digits(individual) → ByteLevel(regex)` here,
//! the pre-tokenizer of SmolLM2's own `tokenizer.json`; `qwen2` splits with
//! llama.cpp's Qwen2 regex ([`QWEN2_REGEX`]) and maps the pieces to bytes,
//! as Qwen2's `tokenizer.json` does. Special tokens are
//! not parsed from text, matching `llama-perplexity`, which tokenizes with
//! `parse_special = false`.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::tokenizer::SplitDelimiterBehavior;

use std::io::Read;

use crate::error::{ModelError, Result};
use crate::gguf::{GgufFile, MetaValue};

/// llama.cpp's pre-tokenizer regex for `tokenizer.ggml.pre = "qwen2"`
/// (`llama-vocab.cpp`): English contractions, letter runs with one leading
/// non-letter, single digits, punctuation runs with their line breaks,
/// line-break runs, and whitespace.
pub const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

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

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl TextTokenizer {
    /// Builds the tokenizer stored in a GGUF file (`tokenizer.ggml.model`
    /// must be `gpt2`, the byte-level BPE).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.meta_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(ModelError::Tokenizer(format!(
                "tokenizer model {model:?} (only the byte-level BPE \"gpt2\" is supported)"
            )));
        }
        let strings = |key: &str| -> Result<Vec<&str>> {
            file.meta(key)
                .and_then(MetaValue::as_array)
                .ok_or_else(|| ModelError::Tokenizer(format!("missing array {key}")))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| ModelError::Tokenizer(format!("{key} holds a non-string")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| ModelError::Tokenizer(format!("merge {m:?} has no space")))
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
            // The regex does the splitting; the byte-level step only maps bytes.
            Some("qwen2") => Sequence::new(vec![
                Split::new(
                    SplitPattern::Regex(QWEN2_REGEX.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(tok_err)?
                .into(),
                ByteLevel::new(false, true, false).into(),
            ])
            .into(),
            Some(other) => {
                return Err(ModelError::Tokenizer(format!(
                    "pre-tokenizer {other:?} is not supported (smollm, starcoder, refact, gpt-2, qwen2 are)"
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
        let bytes = std::fs::read(path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        Self::from_json(&bytes, &path.display().to_string())
    }

    /// [`from_file`](Self::from_file) over the file's bytes; `name` (a
    /// path) names them in errors.
    pub fn from_json(bytes: &[u8], name: &str) -> Result<Self> {
        // tokenizers 0.22 unwraps some nested deserialisation errors (a cut
        // `decoder` object panics in `decoders/mod.rs`): a malformed file
        // must be an error, so such a panic becomes one.
        let parsed = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes))
            .map_err(|_| ModelError::Tokenizer(format!("{name}: malformed tokenizer JSON")))?;
        let inner = parsed.map_err(|e| ModelError::Tokenizer(format!("{name}: {e}")))?;
        let vocab = inner.get_vocab_size(true);
        Ok(Self {
            inner,
            vocab,
            bos: None,
            add_bos: false,
            post_process: true,
        })
    }

    /// Token `id` as the vocabulary spells it (its byte-level form, not
    /// decoded text), or `None` past the vocabulary: two tokenizers share
    /// their tokens when every id spells the same.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
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

    /// Token ids of the text `reader` yields, read and tokenized a block at
    /// a time, so memory stays bounded by the tokens kept: reading stops
    /// once `limits.max_tokens` ids are held (and truncates to them), and
    /// more than `limits.max_bytes` of text is refused (`/dev/zero` without
    /// a token limit). The ids equal [`encode`](Self::encode) of the whole
    /// text: blocks end at a line break between two visible ASCII characters
    /// (`x\ny`), where the byte-level pre-tokenizers built from GGUF (GPT-2,
    /// smollm, Llama-3 and Qwen2 regexes) end a pre-token anyway. A Hugging
    /// Face tokenizer (any normaliser or pre-tokenizer) reads the whole text
    /// up to `max_bytes` and encodes it once.
    pub fn encode_reader(
        &self,
        reader: impl std::io::Read,
        limits: ReadLimits,
    ) -> Result<Vec<u32>> {
        self.read_ids(reader, limits, true)
    }

    /// [`encode_reader`](Self::encode_reader) without special tokens (no
    /// BOS): the ids of a text that continues a prompt.
    pub fn encode_reader_plain(
        &self,
        reader: impl std::io::Read,
        limits: ReadLimits,
    ) -> Result<Vec<u32>> {
        self.read_ids(reader, limits, false)
    }

    /// Ids of `text` without special tokens (no BOS): a text that continues
    /// a prompt.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_part(text, false)
    }

    fn read_ids(
        &self,
        mut reader: impl std::io::Read,
        limits: ReadLimits,
        special: bool,
    ) -> Result<Vec<u32>> {
        let io = |e: std::io::Error| ModelError::Tokenizer(format!("reading the text: {e}"));
        let block = if self.post_process {
            limits.max_bytes.saturating_add(1)
        } else {
            limits.block_bytes.max(1)
        };
        let mut pending: Vec<u8> = Vec::new();
        let mut ids: Vec<u32> = Vec::new();
        let (mut read, mut eof, mut first) = (0usize, false, special);
        // Bytes of `pending` known to hold no split point (all but the last two).
        let mut scanned = 0usize;
        loop {
            if !eof {
                let n = (&mut reader)
                    .take(block as u64)
                    .read_to_end(&mut pending)
                    .map_err(io)?;
                read += n;
                eof = n == 0;
                if read > limits.max_bytes {
                    let reason = match limits.max_tokens {
                        Some(t) => format!(
                            "{} bytes read without reaching {t} tokens (is it text? the limit \
                             on bytes read is {})",
                            read, limits.max_bytes
                        ),
                        None => format!(
                            "more than {} bytes of text; pass a token limit (--max-tokens) or a \
                             smaller file",
                            limits.max_bytes
                        ),
                    };
                    return Err(ModelError::InvalidParameter {
                        name: "text",
                        reason,
                    });
                }
            }
            let split = if eof {
                Some(pending.len())
            } else if self.post_process {
                None
            } else {
                let from = scanned.saturating_sub(2);
                scanned = pending.len();
                line_split(&pending[from..]).map(|s| s + from)
            };
            let Some(split) = split.filter(|&s| s > 0) else {
                if eof {
                    break;
                }
                continue;
            };
            let text = std::str::from_utf8(&pending[..split]).map_err(|e| {
                ModelError::Tokenizer(format!(
                    "the text is not UTF-8 near byte {}: {e}",
                    read - pending.len() + e.valid_up_to()
                ))
            })?;
            ids.extend(self.encode_part(text, first)?);
            first = false;
            pending.drain(..split);
            scanned = 0;
            if let Some(m) = limits.max_tokens
                && ids.len() >= m
            {
                ids.truncate(m);
                break;
            }
            if eof && pending.is_empty() {
                break;
            }
        }
        Ok(ids)
    }

    /// Ids of `text`; special tokens (BOS) only for the first part of a text.
    fn encode_part(&self, text: &str, first: bool) -> Result<Vec<u32>> {
        if first {
            return self.encode(text);
        }
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }
}

/// Limits of [`TextTokenizer::encode_reader`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadLimits {
    /// Stop once this many ids are held (`None`: read to the end).
    pub max_tokens: Option<usize>,
    /// Refuse more text than this many bytes.
    pub max_bytes: usize,
    /// Bytes read per tokenizer call (a block grows to the next safe split).
    pub block_bytes: usize,
}

impl Default for ReadLimits {
    /// No token limit, at most 256 MiB of text, 1 MiB blocks.
    fn default() -> Self {
        Self {
            max_tokens: None,
            max_bytes: 256 << 20,
            block_bytes: 1 << 20,
        }
    }
}

/// The end of the longest prefix of `bytes` that ends with a line break
/// between two visible ASCII characters (`x\ny`, the break kept), if any.
fn line_split(bytes: &[u8]) -> Option<usize> {
    let visible = |b: u8| (0x21..=0x7e).contains(&b);
    (1..bytes.len().saturating_sub(1))
        .rev()
        .find(|&i| bytes[i] == b'\n' && visible(bytes[i - 1]) && visible(bytes[i + 1]))
        .map(|i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::line_split;

    #[test]
    fn blocks_split_only_between_visible_characters() {
        assert_eq!(line_split(b"ab\ncd\nef"), Some(6));
        assert_eq!(line_split(b"ab \ncd"), None);
        assert_eq!(line_split(b"ab\n cd"), None);
        assert_eq!(line_split(b"ab\n\ncd"), None);
        assert_eq!(line_split(b"ab\n"), None);
        assert_eq!(line_split(b"\ncd"), None);
        assert_eq!(line_split(b""), None);
    }
}
