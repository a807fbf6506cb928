//! Records three skips into a log, as `cargo xtask test` does, and prints the
//! summary it would show.
//!
//! ```sh
//! cargo run -p test-support --example skip_summary
//! ```

use test_support::{Requirement, skip, summarize};

fn main() -> std::io::Result<()> {
    let log = std::env::temp_dir().join(format!("rkv-skips-{}.log", std::process::id()));
    // SAFETY: single-threaded here; no other thread reads the environment.
    unsafe { std::env::set_var("RKV_SKIP_LOG", &log) };
    for variable in ["REQUIRE_GPU", "REQUIRE_ISA"] {
        if std::env::var(variable).as_deref() == Ok("1") {
            eprintln!("{variable}=1 would turn these example skips into failures; unset it");
            return Ok(());
        }
    }
    skip(
        Requirement::Gpu,
        "example",
        "decode_on_device",
        "no CUDA device",
    );
    skip(
        Requirement::Gpu,
        "example",
        "gemm_on_device",
        "no CUDA device",
    );
    skip(
        Requirement::Isa,
        "example",
        "avx512_matches_scalar",
        "no AVX-512",
    );
    let text = std::fs::read_to_string(&log)?;
    std::fs::remove_file(&log)?;
    for line in summarize(&text) {
        println!("{line}");
    }
    Ok(())
}
