//! Fuzzes `kv-eval batch`'s requests-file reader: any text parses to
//! requests that pass its promises (a prompt, at least one new token, all
//! within the context, a valid sampling) or to an error naming a line,
//! without panicking. Run with `cargo +nightly fuzz run requests_file` from
//! `crates/eval`.

#![no_main]

use kv_eval::batch::parse_requests;
use libfuzzer_sys::fuzz_target;

const CONTEXT: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let encode = |s: &str| Ok(s.bytes().map(u32::from).collect());
    match parse_requests(text, CONTEXT, encode) {
        Ok(requests) => {
            for q in requests {
                assert!(!q.prompt.is_empty() && q.max_new_tokens > 0);
                assert!(q.prompt.len() + q.max_new_tokens <= CONTEXT);
                assert!(q.sampling.check().is_ok());
            }
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("line ") || msg.contains("no request"), "{msg}");
        }
    }
});
