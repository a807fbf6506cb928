//! Fuzzes the GGUF reader: any bytes parse to a file or a typed error, and
//! every tensor of a parsed file dequantises or errors, without panicking.
//! Run with `cargo +nightly fuzz run gguf_reader` from `crates/eval`, or on a
//! stable toolchain with `RUSTC_BOOTSTRAP=1 cargo fuzz run gguf_reader`.

#![no_main]

use kv_model::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = GgufFile::from_bytes(data.to_vec()) {
        for info in file.tensors() {
            if info.elements() <= 1 << 20 {
                let _ = file.tensor(&info.name).map(|t| t.to_f32());
            }
        }
    }
});
