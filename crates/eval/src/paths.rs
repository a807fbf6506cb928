//! Where `cargo xtask fetch-model` puts the default model and corpus, and
//! where this crate looks for them: `$KV_EVAL_CACHE` when set, otherwise
//! `$XDG_CACHE_HOME/reliable-kv`, otherwise `$HOME/.cache/reliable-kv`.
//! The rule is mirrored in `xtask/src/fetch.rs` (which cannot depend on this
//! crate without compiling it); a test there checks both agree.

use std::path::PathBuf;

/// File name of the default model inside the cache folder.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of the second model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M)
/// inside the cache folder.
pub const QWEN_MODEL_FILE: &str = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
/// File name of Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) inside the cache folder.
pub const QWEN_1_5B_MODEL_FILE: &str = "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf";

/// The models `cargo xtask fetch-model --model NAME` fetches, by the name
/// `kv-eval --model NAME` also takes: `(name, file in the cache folder)`.
pub const NAMED_MODELS: [(&str, &str); 3] = [
    ("smollm2-135m", DEFAULT_MODEL_FILE),
    ("qwen2.5-0.5b", QWEN_MODEL_FILE),
    ("qwen2.5-1.5b", QWEN_1_5B_MODEL_FILE),
];
/// File name of the default corpus inside the cache folder.
pub const DEFAULT_TEXT_FILE: &str = "python3.11-tutorial.txt";
/// File name of the default calibration text (disjoint from the corpus:
/// the Python 3.11 HOWTOs of the same package) inside the cache folder.
pub const DEFAULT_CALIBRATION_FILE: &str = "python3.11-howto.txt";

/// File name of the needle test's haystack (the Jargon File 4.4.7, from
/// Debian's `jargon-text`) inside the cache folder.
pub const HAYSTACK_FILE: &str = "jargon-4.4.7.txt";

/// The cache folder.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KV_EVAL_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("reliable-kv");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("reliable-kv")
}

/// The default model file.
pub fn default_model() -> PathBuf {
    cache_dir().join(DEFAULT_MODEL_FILE)
}

/// The cache file of the model named `name` (one of [`NAMED_MODELS`]).
pub fn named_model(name: &str) -> Option<PathBuf> {
    NAMED_MODELS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, file)| cache_dir().join(file))
}

/// The default corpus file.
pub fn default_text() -> PathBuf {
    cache_dir().join(DEFAULT_TEXT_FILE)
}

/// The default calibration text.
pub fn default_calibration_text() -> PathBuf {
    cache_dir().join(DEFAULT_CALIBRATION_FILE)
}

/// The default haystack of the needle test.
pub fn default_haystack() -> PathBuf {
    cache_dir().join(HAYSTACK_FILE)
}

/// Reads a UTF-8 text file of at most `max_bytes` bytes (a requests file,
/// a haystack): a larger one, or a device that never ends (`/dev/zero`),
/// is refused after `max_bytes + 1` bytes instead of filling memory.
pub fn read_text_at_most(path: &std::path::Path, max_bytes: u64) -> std::io::Result<String> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("longer than {max_bytes} bytes"),
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::read_text_at_most;

    #[test]
    fn endless_and_oversized_files_are_refused() {
        let zero = read_text_at_most(std::path::Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(
            zero.to_string().contains("longer than 1048576 bytes"),
            "{zero}"
        );
        let file = std::env::temp_dir().join(format!("kv-eval-paths-{}", std::process::id()));
        std::fs::write(&file, "twelve bytes").unwrap();
        assert_eq!(read_text_at_most(&file, 12).unwrap(), "twelve bytes");
        assert!(read_text_at_most(&file, 11).is_err());
        std::fs::write(&file, [0xff, 0xfe]).unwrap();
        assert!(read_text_at_most(&file, 12).is_err());
        std::fs::remove_file(&file).unwrap();
    }
}
