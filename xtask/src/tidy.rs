//! Repository checks as ordinary tests (run by `cargo test -p xtask`, in
//! the style of rust-analyzer's `tidy`): rules a reviewer would otherwise
//! have to remember, each one a test that names what breaks it.

use std::path::{Path, PathBuf};

use crate::CUDA_MODULES;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Files under `dir` (recursively) whose name ends with `suffix`.
fn files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                out.extend(files(&path, suffix));
            }
        } else if name.ends_with(suffix) {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The workspace's own crates, by package name.
fn workspace_crates() -> Vec<String> {
    files(&root().join("crates"), "Cargo.toml")
        .iter()
        .filter(|p| !p.components().any(|c| c.as_os_str() == "fuzz"))
        .filter_map(|p| {
            let text = std::fs::read_to_string(p).ok()?;
            let line = text.lines().find(|l| l.starts_with("name = "))?;
            Some(
                line.trim_start_matches("name = ")
                    .trim_matches('"')
                    .to_string(),
            )
        })
        .collect()
}

/// Every public error enum is `#[non_exhaustive]`, so a crate can add a
/// variant without breaking the callers that match on it.
#[test]
fn error_enums_are_non_exhaustive() {
    let mut missing = Vec::new();
    for path in files(&root().join("crates"), ".rs") {
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some(rest) = line.strip_prefix("pub enum ") else {
                continue;
            };
            let name = rest.split([' ', '{', '<']).next().unwrap_or("");
            if !name.ends_with("Error") {
                continue;
            }
            // The attributes directly above the enum.
            let attrs = lines[..i].iter().rev().take_while(|l| {
                l.trim_start().starts_with("#[") || l.trim_start().starts_with("///")
            });
            if !attrs.into_iter().any(|l| l.contains("non_exhaustive")) {
                missing.push(format!("{}: {name}", path.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "error enums without #[non_exhaustive]: {missing:#?}"
    );
}

/// Crates depend on each other through `workspace = true`, so one version
/// and path is named once, in the root manifest.
#[test]
fn internal_dependencies_go_through_the_workspace() {
    let crates = workspace_crates();
    assert!(crates.len() >= 8, "found only {crates:?}");
    let mut bad = Vec::new();
    for manifest in files(&root().join("crates"), "Cargo.toml") {
        if manifest.components().any(|c| c.as_os_str() == "fuzz") {
            continue;
        }
        let text = std::fs::read_to_string(&manifest).unwrap();
        for line in text.lines() {
            let key = line.split(['=', '.', ' ']).next().unwrap_or("");
            if crates.iter().any(|c| c == key)
                && !line.starts_with("name")
                && !line.contains("workspace = true")
            {
                bad.push(format!("{}: {line}", manifest.display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "dependencies not through the workspace: {bad:#?}"
    );
}

/// `cargo xtask ptx` builds exactly the CUDA modules gpu-kernels compiles.
#[test]
fn ptx_builds_every_cuda_module() {
    let kernels = root().join("crates/gpu-kernels/kernels");
    let mut on_disk: Vec<String> = files(&kernels, ".cu")
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    let sources =
        std::fs::read_to_string(root().join("crates/gpu-kernels/src/sources.rs")).unwrap();
    let mut compiled: Vec<String> = sources
        .split("include_str!(\"../kernels/")
        .skip(1)
        .filter_map(|s| {
            s.split("\")")
                .next()?
                .strip_suffix(".cu")
                .map(str::to_string)
        })
        .collect();
    // Module names (`name: "…"` of each `KernelModule`); a module may
    // embed several files (paged_decode: paged_decode.cu and paged_mma.cu).
    let mut modules: Vec<String> = sources
        .split("name: \"")
        .skip(1)
        .filter_map(|s| s.split('"').next().map(str::to_string))
        .collect();
    let mut listed: Vec<String> = CUDA_MODULES.iter().map(|s| s.to_string()).collect();
    for v in [&mut on_disk, &mut compiled, &mut listed, &mut modules] {
        v.sort();
    }
    assert_eq!(
        compiled, on_disk,
        "kernels/*.cu against the files sources.rs embeds"
    );
    assert_eq!(
        listed, modules,
        "xtask's CUDA_MODULES against sources.rs's modules"
    );
    assert!(
        listed.iter().all(|m| on_disk.contains(m)),
        "a module without its file"
    );
}

/// No committed file names a path of the machine it was written on.
#[test]
fn no_machine_specific_paths() {
    let out = std::process::Command::new("git")
        .args(["ls-files"])
        .current_dir(root())
        .output();
    let Some(out) = out.ok().filter(|o| o.status.success()) else {
        // Not a git checkout (a packaged crate): nothing to check.
        return;
    };
    let needles = ["/root/", "/home/", "/work/main", "/Users/", "C:\\\\Users"];
    let mut bad = Vec::new();
    for file in String::from_utf8_lossy(&out.stdout).lines() {
        if file == "xtask/src/tidy.rs" {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(root().join(file)) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            if let Some(needle) = needles.iter().find(|s| line.contains(**s)) {
                bad.push(format!("{file}:{}: {needle}", n + 1));
            }
        }
    }
    assert!(bad.is_empty(), "machine-specific paths: {bad:#?}");
}

/// The crates' manifests (fuzz crates aside): `(crate folder, text)`.
fn manifests() -> Vec<(PathBuf, String)> {
    files(&root().join("crates"), "Cargo.toml")
        .into_iter()
        .filter(|p| !p.components().any(|c| c.as_os_str() == "fuzz"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p.parent().unwrap().to_path_buf(), text)
        })
        .collect()
}

/// The value of `key = ...` in a manifest's `[package]` table, if present.
fn package_key<'t>(text: &'t str, key: &str) -> Option<&'t str> {
    let package = text.split("\n[").next()?;
    package
        .lines()
        .find(|l| l.starts_with(&format!("{key} ")) || l.starts_with(&format!("{key}.")))
}

/// A user who depends on a library crate does not compile a command line:
/// clap and indicatif are optional everywhere, switched on by a `cli`
/// feature. Only kv-eval, whose binary is the crate's main product (the
/// README's main job), turns `cli` on by default.
#[test]
fn command_line_dependencies_stay_behind_cli() {
    let mut bad = Vec::new();
    for (dir, text) in manifests() {
        for line in text.lines() {
            let key = line.split(['=', '.', ' ']).next().unwrap_or("");
            if ["clap", "indicatif"].contains(&key) && !line.contains("optional = true") {
                bad.push(format!("{}: {line}", dir.display()));
            }
        }
        let default_cli = text
            .lines()
            .any(|l| l.starts_with("default = ") && l.contains("\"cli\""));
        if default_cli && !dir.ends_with("crates/eval") {
            bad.push(format!("{}: `cli` on by default", dir.display()));
        }
    }
    assert!(bad.is_empty(), "command-line dependencies: {bad:#?}");
}

/// kv-model is what a program depends on to run a model on this
/// workspace's caches: it pulls in no experiment (kv-eval), no command
/// line and no report or plotting crate, not even optionally (serde_json
/// reads a checkpoint's `config.json`, which is loading, not reporting). (abft-gemm
/// is allowed: its `Matrix` and plain linear layer are the dense f32
/// product; the checks built on them stay in kv-eval, plugged in through
/// kv-model's `ProjectionHook`.)
#[test]
fn the_model_runner_depends_on_nothing_experimental() {
    let text = std::fs::read_to_string(root().join("crates/kv-model/Cargo.toml")).unwrap();
    let deps = text
        .split("\n[")
        .find(|t| t.starts_with("dependencies]"))
        .unwrap_or("");
    let forbidden = ["kv-eval", "clap", "indicatif", "plotters", "statrs"];
    let bad: Vec<&str> = deps
        .lines()
        .filter(|l| {
            let key = l.split(['=', '.', ' ']).next().unwrap_or("");
            forbidden.contains(&key)
        })
        .collect();
    assert!(bad.is_empty(), "kv-model's dependencies: {bad:?}");
}

/// No source file grows past this many lines; a file that does is split by
/// concept (as kv-quant's `store/levels.rs` was out of `store/encode.rs`).
const LINE_BUDGET: usize = 900;

#[test]
fn source_files_stay_within_the_line_budget() {
    let mut over = Vec::new();
    for dir in ["crates", "xtask"] {
        for path in files(&root().join(dir), ".rs") {
            let lines = std::fs::read_to_string(&path).unwrap().lines().count();
            if lines > LINE_BUDGET {
                over.push(format!("{}: {lines} lines", path.display()));
            }
        }
    }
    assert!(over.is_empty(), "files over {LINE_BUDGET} lines: {over:#?}");
}

/// Every crate has a README with a Rust example, and lib.rs includes the
/// README as a doc comment (`#[doc = include_str!("../README.md")]` on a
/// `#[cfg(doctest)]` item), so `cargo test` runs the example as a doctest.
#[test]
fn every_crate_has_a_doctested_readme() {
    let mut bad = Vec::new();
    for (dir, _) in manifests() {
        let Ok(readme) = std::fs::read_to_string(dir.join("README.md")) else {
            bad.push(format!("{}: no README.md", dir.display()));
            continue;
        };
        if !readme.contains("```rust\n") && !readme.contains("```rust,") {
            bad.push(format!("{}: README has no ```rust example", dir.display()));
        }
        let lib = std::fs::read_to_string(dir.join("src/lib.rs")).unwrap_or_default();
        if !lib.contains("doc = include_str!(\"../README.md\")") {
            bad.push(format!(
                "{}: lib.rs does not include the README",
                dir.display()
            ));
        }
    }
    assert!(bad.is_empty(), "READMEs: {bad:#?}");
}

/// Every publishable crate carries what crates.io shows and its license
/// needs: description, license (with both license files in the crate
/// folder), readme, keywords and categories; and no URL that points nowhere.
#[test]
fn publishable_crates_carry_package_metadata() {
    let mut bad = Vec::new();
    for (dir, text) in manifests() {
        if text.contains("publish = false") {
            continue;
        }
        for key in ["description", "license", "readme", "keywords", "categories"] {
            if package_key(&text, key).is_none() {
                bad.push(format!("{}: no {key}", dir.display()));
            }
        }
        for file in ["LICENSE-MIT", "LICENSE-APACHE"] {
            if !dir.join(file).is_file() {
                bad.push(format!("{}: no {file}", dir.display()));
            }
        }
        if text.contains(".invalid") || text.contains("example.com") {
            bad.push(format!("{}: a placeholder URL", dir.display()));
        }
    }
    let root_manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    assert!(
        root_manifest.contains("license = \"MIT OR Apache-2.0\""),
        "the workspace license changed: update the license files and this check"
    );
    assert!(bad.is_empty(), "package metadata: {bad:#?}");
}
