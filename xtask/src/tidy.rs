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
    let mut listed: Vec<String> = CUDA_MODULES.iter().map(|s| s.to_string()).collect();
    for v in [&mut on_disk, &mut compiled, &mut listed] {
        v.sort();
    }
    assert_eq!(listed, on_disk, "xtask's CUDA_MODULES against kernels/*.cu");
    assert_eq!(listed, compiled, "xtask's CUDA_MODULES against sources.rs");
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
