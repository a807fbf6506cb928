//! Fuzzes the Hugging Face loader (`config.json`, `model.safetensors`,
//! `tokenizer.json`): the input is split into the three files by two
//! little-endian u16 lengths at its start; any bytes load to a model or a
//! typed error, without panicking. Run with `cargo +nightly fuzz run
//! hf_checkpoint` from `crates/eval`.

#![no_main]

use kv_model::hf::load_hf_bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((head, rest)) = data.split_first_chunk::<4>() else {
        return;
    };
    let a = usize::from(u16::from_le_bytes([head[0], head[1]])).min(rest.len());
    let b = usize::from(u16::from_le_bytes([head[2], head[3]])).min(rest.len() - a);
    let (config, rest) = rest.split_at(a);
    let (weights, tokenizer) = rest.split_at(b);
    if let Ok((model, _)) = load_hf_bytes(config, weights, tokenizer) {
        let _ = model.describe();
    }
});
