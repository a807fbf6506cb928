//! Fuzzes the cache-form grammar: any spelling parses to a form (whose
//! label parses back to the same mode) or is refused with a bounded
//! message, without panicking. Run with `cargo +nightly fuzz run
//! cache_form` from `crates/eval`.

#![no_main]

use kv_eval::cache::CacheMode;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = text.parse::<kv_quant::CacheForm>();
    match CacheMode::parse(text) {
        Ok(mode) => {
            let again = CacheMode::parse(&mode.label()).expect("a label parses");
            assert_eq!(again.label(), mode.label());
        }
        Err(e) => assert!(e.to_string().len() < 4096),
    }
});
