//! `kv-eval` refuses hostile flags with one clear error before the model
//! loads or the corpus is read (these run without the model files).

use std::process::Command;

#[test]
fn hostile_flags_are_refused_before_any_work() {
    let file = std::env::temp_dir().join(format!("kv-eval-cli-{}", std::process::id()));
    std::fs::write(&file, b"a file, not a folder").unwrap();
    let out = file.to_str().unwrap();
    let tmp_dir = std::env::temp_dir();
    let tmp = tmp_dir.to_str().unwrap();
    // A path inside a file: no folder can be made there.
    let inside_file = format!("{out}/sub/out.json");
    let missing = "/nonexistent/model.gguf";
    for (args, says) in [
        (&["ppl", "--ctx", "2"][..], "--ctx 2"),
        (&["ppl", "--threads", "100000"], "--threads 100000"),
        (&["sweep", "--ctx", "0", "--out", "x"], "--ctx 0"),
        (
            &[
                "ppl",
                "--backend",
                "paged",
                "--block-size",
                "18446744073709551615",
            ],
            "invalid block-size: 18446744073709551615: a block holds at most",
        ),
        (
            &["ppl", "--method", "sliding", "--stride", "0"],
            "--stride 0",
        ),
        (
            &["ppl", "--method", "sliding", "--stride", "300"],
            "--stride 300",
        ),
        (&["ppl", "--max-tokens", "0"], "--max-tokens 0"),
        (&["ppl", "--evict", "1.5"], "not in (0, 1]"),
        (&["ppl", "--evict", "0.5", "--evict-pool", "4"], "not odd"),
        (&["ppl", "--evict", "0.5,0.3"], "one share here"),
        (
            &[
                "ppl",
                "--form",
                "int4",
                "--backend",
                "reencode",
                "--evict",
                "0.5",
            ],
            "re-encode protocol codes each window whole",
        ),
        (
            &["frontier", "--evict", "0.5", "--out", "x"],
            "--evict runs on paged backends",
        ),
        (
            &[
                "generate",
                "--prompt",
                "hi",
                "--key-form",
                "int2-ch+sink4+out1+clip+pre",
                "--value-form",
                "int4",
                "--evict",
                "0.5",
            ],
            "reads each row at the position it is stored at",
        ),
        (
            &["ppl", "--isa", "avx-512"],
            "not one of scalar, avx2, avx512",
        ),
        (
            &["generate", "--prompt", "hi", "--isa", "sse"],
            "not one of scalar, avx2, avx512",
        ),
        (&["ppl", "--memory-limit", "12X"], "memory-limit"),
        (
            &["top", "--model", "/dev/zero", "--prompt", "hi"],
            "neither a file nor a folder",
        ),
        // The form as spelled, not as a Rust structure.
        (
            &["shard-stream", "--fold", "0"],
            "\"shard-f0\": folding chunks",
        ),
        // Output paths are probed before the model loads.
        (&["ppl", "--json", tmp], "is a folder"),
        (&["ppl", "--json", &inside_file], "cannot create"),
        (
            &["accumulate", "--text", out, "--out", &inside_file],
            "cannot create the folder",
        ),
        (&["calibrate", "--out", tmp], "is a folder"),
        (&["ppl", "--weight-flips", "2"], "weight-flips"),
        (
            &["generate", "--prompt", "hi", "--speculate", "self"],
            "self-speculation",
        ),
        (
            &[
                "generate",
                "--prompt",
                "hi",
                "--key-form",
                "int8h-ch+sink4",
                "--value-form",
                "int8",
                "--speculate",
                "self",
            ],
            "int8 on the paged backend keeps no 4-bit view",
        ),
        (
            &[
                "generate",
                "--prompt",
                "hi",
                "--form",
                "int8h",
                "--backend",
                "reencode",
            ],
            "use --backend paged",
        ),
        (
            &["generate", "--prompt", "hi", "--speculate", "self:skip=5-2"],
            "the range runs backwards",
        ),
        (
            &["generate", "--prompt", "hi", "--speculate", "self:deep:k=3"],
            "self takes skip=LAYERS",
        ),
        (
            &["generate", "--prompt", "hi", "--speculate", "lookup:k=0"],
            "k=0",
        ),
        (
            &["generate", "--prompt", "hi", "--speculate", "draft:"],
            "is not lookup",
        ),
        (
            &["generate", "--prompt", "hi", "--speculate", "lookup:k=x"],
            "not a number of drafts",
        ),
        (
            &["ppl", "--weight-check", "0"],
            "neither `never` nor a number",
        ),
        (
            &["ppl", "--weight-check", "1", "--weight-group", "0"],
            "weight-group",
        ),
        (&["ppl", "--weight-flips", "1e-7", "--abft"], "use one"),
        (
            &["ppl", "--weight-flips", "1e-7", "--form", "int4"],
            "run on the plain cache",
        ),
        (
            &[
                "ppl",
                "--weight-check",
                "1",
                "--key-form",
                "int4",
                "--value-form",
                "lm4",
            ],
            "run on the plain cache",
        ),
        (
            &["generate", "--memory-limit", "0", "--prompt", "hi"],
            "memory-limit",
        ),
        (&["ppl", "--ber", "2"], "not in [0, 1]"),
        // Coupled Quantization: no rotation, whole codes per gain block, a
        // fitted codebook.
        (&["ppl", "--form", "cq+rot"], "takes no +rot"),
        (&["ppl", "--form", "cq-d4-g6"], "not whole codes of 4"),
        (&["ppl", "--form", "cq-d3"], "not supported"),
        // Keys before RoPE on pair codebooks: pairs (cq-d2), keys, paged.
        (&["ppl", "--key-form", "cq-d4-pre"], "spell it with cq-d2"),
        (&["ppl", "--key-form", "vq-d2-pre"], "unknown vq option"),
        (
            &[
                "ppl",
                "--key-form",
                "fp16",
                "--value-form",
                "cq-d2-k16-pre",
                "--backend",
                "paged",
            ],
            "values carry no RoPE",
        ),
        (
            &[
                "ppl",
                "--key-form",
                "cq-d2-k16-pre+win8",
                "--value-form",
                "fp16",
                "--backend",
                "paged",
            ],
            "window of exact tokens",
        ),
        (
            &[
                "ppl",
                "--key-form",
                "cq-d2-k16-pre+win8",
                "--value-form",
                "fp16",
            ],
            "window of exact tokens",
        ),
        // Sparse outliers: the share, the paged backend, keys before RoPE.
        (&["ppl", "--key-form", "int2-ch+out25"], "(0, 20]"),
        (&["ppl", "--key-form", "int2-ch+out0"], "(0, 20]"),
        (
            &["ppl", "--form", "int2-ch+out1", "--backend", "reencode"],
            "use --backend paged",
        ),
        (
            &[
                "ppl",
                "--key-form",
                "int2-ch32+out1",
                "--value-form",
                "fp16",
                "--backend",
                "paged",
            ],
            "not blocks of 16",
        ),
        (
            &[
                "ppl",
                "--key-form",
                "fp16",
                "--value-form",
                "int2+out1+pre",
                "--backend",
                "paged",
            ],
            "values carry no RoPE",
        ),
        // A negative number reaches the flag's own check.
        (&["ppl", "--ber", "-1"], "--ber -1"),
        (&["ppl", "--gemm-flips", "1e-6"], "need --abft"),
        (&["ppl", "--abft-correct"], "need --abft"),
        (&["ppl", "--abft", "--gemm-flips", "2"], "--gemm-flips 2"),
        (&["ppl", "--abft", "--abft-emax=-1"], "--abft-emax"),
        (
            &["ppl", "--abft", "fixed", "--abft-tau=-1"],
            "--abft-tau -1",
        ),
        (
            &["ppl", "--abft", "fixed", "--abft-tau", "inf"],
            "--abft-tau inf",
        ),
        (
            &["ppl", "--abft", "a-abft", "--abft-emax", "1e-6"],
            "--abft-emax goes with --abft v-abft",
        ),
        (
            &["ppl", "--abft", "--abft-tau", "1e-3"],
            "--abft-tau with --abft fixed",
        ),
        (
            &["ppl", "--abft-tau", "1e-3"],
            "--abft-tau with --abft fixed",
        ),
        (&["ppl", "--abft", "z-abft"], "z-abft"),
        (
            &[
                "adapt",
                "--hot-layers",
                "3",
                "--promote-at",
                "1e-6",
                "--demote-at",
                "1e-4",
            ],
            "demote-at",
        ),
        (&["adapt", "--hot-layers", "70"], "at most 64 layers"),
        (&["adapt", "--hot-layers", "0,0"], "names layer 0 twice"),
        (
            &["calibrate", "--calibration", "/dev/zero", "--out", out],
            "drop --calibration /dev/zero",
        ),
        (
            &["lowrank-report", "--calibration", out, "--out", tmp],
            "lowrank-report reads the calibration text",
        ),
        (&["--memory-limit", "0", "top"], "at least one byte"),
        (
            &[
                "batch",
                "--requests",
                out,
                "--blocks",
                "100000000",
                "--memory-limit",
                "1G",
                "--out",
                tmp,
            ],
            "block tables of --blocks 100000000",
        ),
        (
            &["adapt", "--hot-layers", "3", "--ber", "0"],
            "--ber 0 is not in (0, 1]",
        ),
        (
            &["adapt", "--hot-layers", "3", "--hot-ber", "2"],
            "--hot-ber 2 is not in (0, 1]",
        ),
        (&["adapt"], "exactly one of --hot-layers"),
        (
            &["adapt", "--hot-rows", "0.1", "--hot-blocks", "0.1"],
            "exactly one of --hot-layers",
        ),
        (
            &["adapt", "--hot-rows", "2"],
            "--hot-rows 2 is not in (0, 1]",
        ),
        (
            &["adapt", "--hot-blocks", "0"],
            "--hot-blocks 0 is not in (0, 1]",
        ),
        (
            &["adapt", "--hot-blocks", "0.1", "--block", "0"],
            "--block 0: a block holds 1 to --ctx",
        ),
        (
            &["adapt", "--hot-blocks", "0.1", "--block", "100000"],
            "--block 100000",
        ),
        (
            &["ppl", "--abft", "--gemm-flip-site", "weight"],
            "--gemm-flip-site goes with --gemm-flips",
        ),
        (
            &[
                "ppl",
                "--abft",
                "--gemm-flips",
                "1e-6",
                "--gemm-flip-site",
                "bus",
            ],
            "bus",
        ),
        (&["top", "-k", "0", "--prompt", "hi"], "-k 0"),
        (&["top", "--prompt", ""], "the prompt is empty"),
        (&["generate", "--prompt", ""], "the prompt is empty"),
        (
            &["generate", "--prompt", "hi", "--temperature=-1"],
            "temperature",
        ),
        (
            &["sweep", "--seeds", "1,1", "--out", "x"],
            "--seeds names 1 twice",
        ),
        (&["sweep", "--out", out], out),
        (&["ppl", "--model", missing], missing),
        (
            &["niah", "--depths", "0,2", "--out", "x"],
            "2 is not in [0, 1]",
        ),
        (&["niah", "--lengths", "0", "--out", "x"], "--lengths"),
        (&["niah", "--digits", "0", "--out", "x"], "digits"),
        (&["niah", "--forms", "int4+bogus", "--out", "x"], "bogus"),
        (
            &["niah", "--haystack", "/nonexistent/hay.txt", "--out", "x"],
            "cargo xtask fetch-model",
        ),
        (&["batch", "--out", "x"], "--requests"),
        (
            &["batch", "--workload", "--speculate", "self", "--out", "x"],
            "self-speculation",
        ),
        (
            &[
                "batch",
                "--workload",
                "--speculate",
                "lookup:k=0",
                "--out",
                "x",
            ],
            "k=0",
        ),
        (
            &["batch", "--requests", "/nonexistent/r.jsonl", "--out", "x"],
            "cannot read requests /nonexistent/r.jsonl",
        ),
        (
            &["batch", "--workload", "--watermark", "1", "--out", "x"],
            "watermark",
        ),
        (
            &["batch", "--workload", "--max-running", "0", "--out", "x"],
            "max_running",
        ),
        (
            &["batch", "--workload", "--block-size", "0", "--out", "x"],
            "block_size",
        ),
        (
            &[
                "batch",
                "--workload",
                "--prompt-len",
                "300,10",
                "--out",
                "x",
            ],
            "prompt_len",
        ),
        (
            &[
                "frontier-plot",
                "--inputs",
                "/nonexistent/frontier.json",
                "--goals",
                "2.5",
                "--out",
                tmp,
            ],
            "--goals \"2.5\" is not BITS:PERCENT",
        ),
        (
            &[
                "frontier-plot",
                "--inputs",
                "/nonexistent/frontier.json",
                "--goals",
                "2.5:-1",
                "--out",
                tmp,
            ],
            "both finite and positive",
        ),
        (
            &[
                "frontier-plot",
                "--inputs",
                "/nonexistent/frontier.json",
                "--out",
                tmp,
            ],
            "/nonexistent/frontier.json",
        ),
        (
            &["frontier-plot", "--inputs", out, "--out", tmp],
            "kv-eval-cli-",
        ),
        (
            &[
                "batch",
                "--workload",
                "--num-requests",
                "1000000000000",
                "--out",
                "x",
            ],
            "budget",
        ),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_kv-eval"))
            .args(args)
            .output()
            .expect("run kv-eval");
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("loaded "),
            "{args:?} loaded the model first: {stderr}"
        );
    }
    let long = format!("int4+{}", "x".repeat(100_000));
    let o = Command::new(env!("CARGO_BIN_EXE_kv-eval"))
        .args(["ppl", "--form", &long])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(o.stderr.len() < 4096, "{} bytes of error", o.stderr.len());
    std::fs::remove_file(&file).unwrap();
}

/// `--isa` naming a set this CPU lacks is refused before the model loads.
#[test]
fn an_instruction_set_this_cpu_lacks_is_refused() {
    let lacking: Vec<attention::Isa> = attention::Isa::ALL
        .into_iter()
        .filter(|isa| !isa.is_supported())
        .collect();
    if lacking.is_empty() {
        test_support::skip(
            test_support::Requirement::Isa,
            "kv-eval",
            "an_instruction_set_this_cpu_lacks_is_refused",
            "this CPU runs every set: no refusal to see",
        );
        return;
    }
    for isa in lacking {
        let o = Command::new(env!("CARGO_BIN_EXE_kv-eval"))
            .args(["ppl", "--isa", isa.name()])
            .output()
            .expect("run kv-eval");
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "--isa {isa} succeeded");
        assert!(stderr.contains("not supported by this CPU"), "{stderr}");
        assert!(
            !stderr.contains("loaded "),
            "--isa {isa} loaded the model first: {stderr}"
        );
    }
}
