//! `paged-cache simulate` refuses sizes that cannot fit with one clear
//! error before allocating, never a panic or an allocation abort.

use std::process::Command;

#[test]
fn hostile_sizes_get_one_clear_error() {
    for (args, says) in [
        (
            &[
                "--requests",
                "20",
                "--prompt-len",
                "1..18446744073709551615",
            ][..],
            "budget",
        ),
        (&["--requests", "1000000000000"], "budget"),
        (&["--watermark", "7"], "watermark"),
        (&["--host-blocks", "4294967296"], "host_blocks"),
        (&["--host-blocks", "4000000000"], "token slots"),
        (&["--blocks", "4000000000"], "token slots"),
        (&["--prompt-len", "5..2"], "prompt_len"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_paged-cache"))
            .arg("simulate")
            .args(args)
            .output()
            .expect("run paged-cache");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
