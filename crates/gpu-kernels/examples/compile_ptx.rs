//! Compiles every embedded CUDA source with NVRTC (no GPU needed) and writes
//! the PTX to a folder: `cargo run -p gpu-kernels --features cuda --example
//! compile_ptx -- OUT [compute_90]` (what `cargo xtask ptx` runs where there
//! is no nvcc). Prints each module's size and exits with an error, not a
//! panic, when NVRTC is missing or a source does not compile.
//!
//! `-- OUT --sources` writes only each module's full source (`common.cuh`,
//! then the module's files) as `OUT/<module>.full.cu`, the text nvcc is
//! given by `cargo xtask ptx` and by the device bundle's `run.sh`, so every
//! compiler reads what NVRTC reads.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sources_only = args.iter().any(|a| a == "--sources");
    let mut positional = args.iter().filter(|a| !a.starts_with("--"));
    let out = std::path::PathBuf::from(positional.next().map_or("target/ptx", String::as_str));
    let arch = positional.next().map_or("compute_90", String::as_str);
    std::fs::create_dir_all(&out)?;
    for module in gpu_kernels::sources::MODULES {
        if sources_only {
            let path = out.join(format!("{}.full.cu", module.name));
            std::fs::write(&path, module.full_source())?;
            println!("{}: source -> {}", module.name, path.display());
            continue;
        }
        let ptx = gpu_kernels::Gpu::compile(&module, arch)?.to_src();
        let path = out.join(format!("{}.ptx", module.name));
        std::fs::write(&path, &ptx)?;
        println!("{}: {} bytes -> {}", module.name, ptx.len(), path.display());
    }
    Ok(())
}
