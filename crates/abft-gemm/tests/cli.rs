//! `abft-study` refuses hostile arguments with one clear error before any
//! work: sizes that cannot be allocated, zero trials, unknown or repeated
//! precisions, an output path that is a file.

use std::process::Command;

/// Runs `abft-study` with `args`; returns (success, stderr).
fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_abft-study"))
        .args(args)
        .output()
        .expect("run abft-study");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn hostile_arguments_get_one_clear_error() {
    let file = std::env::temp_dir().join(format!("abft-study-cli-{}", std::process::id()));
    std::fs::write(&file, b"a file, not a folder").unwrap();
    let out = file.to_str().unwrap();
    for (args, says) in [
        (
            &[
                "calibrate",
                "--trials",
                "1",
                "--dims",
                "4294967296,4294967296,4294967296",
            ][..],
            "invalid dims",
        ),
        (
            &["calibrate", "--dims", "1000000,1000000,1000000"],
            "invalid dims",
        ),
        (
            &["calibrate", "--dims", "0,4,4"],
            "--dims needs three positive sizes",
        ),
        (&["calibrate", "--trials", "0"], "at least one product"),
        (&["run", "--fp-precisions", "fp64,int3"], "\"fp64\""),
        (&["run", "--fp-precisions", "bf16,bf16"], "twice"),
        (&["run", "--fp-trials", "0"], "at least one product"),
        (
            &["run", "--fp-trials", "18446744073709551615"],
            "at most 10000000 products",
        ),
        (
            &["run", "--det-trials", "10000001", "--tables", "detection"],
            "at most 10000000 products",
        ),
        (
            &["run", "--det-trials", "0", "--tables", "detection"],
            "at least one product",
        ),
        (&["run", "--out", out], out),
    ] {
        let (ok, stderr) = run(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    std::fs::remove_file(&file).unwrap();
}
