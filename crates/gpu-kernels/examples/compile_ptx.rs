//! Compiles every embedded CUDA source with NVRTC (no GPU needed) and writes
//! the PTX to a folder: `cargo run -p gpu-kernels --features cuda --example
//! compile_ptx -- OUT [compute_90]` (what `cargo xtask ptx` runs where there
//! is no nvcc). Prints each module's size and exits with an error, not a
//! panic, when NVRTC is missing or a source does not compile.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = std::path::PathBuf::from(args.next().unwrap_or_else(|| "target/ptx".into()));
    let arch = args.next().unwrap_or_else(|| "compute_90".into());
    std::fs::create_dir_all(&out)?;
    for module in gpu_kernels::sources::MODULES {
        let ptx = gpu_kernels::Gpu::compile(&module, &arch)?.to_src();
        let path = out.join(format!("{}.ptx", module.name));
        std::fs::write(&path, &ptx)?;
        println!("{}: {} bytes -> {}", module.name, ptx.len(), path.display());
    }
    Ok(())
}
