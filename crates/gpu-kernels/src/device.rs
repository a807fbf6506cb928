//! [`Gpu`]: one CUDA device, its stream, and the kernel modules compiled for
//! it, loaded lazily and cached per module name (as candle does): the first
//! launch of any kernel of a module compiles the module's embedded source
//! with NVRTC for the device's architecture (or loads the PTX that `cargo
//! xtask ptx` wrote, when `RKV_PTX_DIR` names its folder), and every later
//! launch reuses it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};
use gf2_codes::Int4Code;

use crate::error::{GpuError, Result};
use crate::sources::KernelModule;
use crate::tables::{GolayTables, MetaColumns, nibble_table};

/// The decode tables on the device, uploaded once per [`Gpu`].
pub(crate) struct DeviceTables {
    pub(crate) secded: CudaSlice<u8>,
    pub(crate) hamming: CudaSlice<u8>,
    pub(crate) golay_parity: CudaSlice<u16>,
    pub(crate) golay_leader: CudaSlice<u32>,
    /// Metadata columns for f16 (index 0) and f32 (index 1) words.
    pub(crate) meta: [CudaSlice<u8>; 2],
}

/// What was found about the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Device memory in bytes.
    pub memory_bytes: usize,
}

/// One CUDA device with a stream and a module cache.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Kernel handles per module and name (looked up without allocating).
    functions: Mutex<HashMap<&'static str, HashMap<String, CudaFunction>>>,
    tables: OnceLock<DeviceTables>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("info", &self.info).finish()
    }
}

/// Maps a driver error of `call` into [`GpuError::Driver`].
pub(crate) fn driver(call: &'static str) -> impl Fn(DriverError) -> GpuError {
    move |e| GpuError::Driver {
        call,
        message: e.to_string(),
    }
}

impl Gpu {
    /// Opens device `ordinal`: [`GpuError::NoDevice`] when the driver
    /// library is missing or no device is present (a skip), and
    /// [`GpuError::Driver`] when a present driver fails to initialise or
    /// to open a present device (an error).
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: only tries to load the driver library; no symbol is called.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDevice(
                "the CUDA driver library (libcuda) was not found".into(),
            ));
        }
        // No device at all is a skip; a driver that fails otherwise (a
        // version mismatch, a broken install, a device it cannot open) is
        // an error on a machine that has a GPU.
        let count = match CudaContext::device_count() {
            Ok(n) => n,
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
            Err(e) => {
                return Err(GpuError::Driver {
                    call: "cuInit/cuDeviceGetCount",
                    message: e.to_string(),
                });
            }
        };
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::NoDevice(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("cuCtxCreate (a device is present)"))?;
        let attr = |a| ctx.attribute(a).map_err(driver("cuDeviceGetAttribute"));
        use cudarc::driver::sys::CUdevice_attribute as A;
        let info = DeviceInfo {
            name: ctx.name().map_err(driver("cuDeviceGetName"))?,
            compute_capability: ctx
                .compute_capability()
                .map_err(driver("compute capability"))?,
            multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            memory_bytes: ctx.total_mem().map_err(driver("cuDeviceTotalMem"))?,
        };
        let stream = ctx.default_stream();
        Ok(Self {
            ctx,
            stream,
            info,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            tables: OnceLock::new(),
        })
    }

    /// Opens device 0, or explains why not; tests use this to skip.
    pub fn open_default() -> Result<Self> {
        Self::new(0)
    }

    /// The device's properties.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The stream every kernel of this handle runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }

    /// Compiles `module` to PTX with NVRTC for `arch` (for example
    /// `"compute_90"`), with no device needed: what `cargo xtask ptx` does
    /// where there is no nvcc, and what the CPU-side tests use to check
    /// that every source compiles.
    pub fn compile(module: &KernelModule, arch: &str) -> Result<Ptx> {
        // SAFETY: only tries to load the NVRTC library; no symbol is called.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(GpuError::NoCompiler(
                "libnvrtc was not found on the library path".into(),
            ));
        }
        let opts = CompileOptions {
            name: Some(format!("{}.cu", module.name)),
            options: vec![
                format!("--gpu-architecture={arch}"),
                "--std=c++17".into(),
                "-lineinfo".into(),
            ],
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(module.full_source(), opts).map_err(|e| match e {
            CompileError::CompileError { log, .. } => GpuError::Compile {
                module: module.name,
                log: log.to_string_lossy().into_owned(),
            },
            other => GpuError::Compile {
                module: module.name,
                log: other.to_string(),
            },
        })
    }

    /// The module, compiled (or loaded from `RKV_PTX_DIR`) on first use.
    pub(crate) fn module(&self, module: &KernelModule) -> Result<Arc<CudaModule>> {
        let mut cache = self.modules.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = cache.get(module.name) {
            return Ok(m.clone());
        }
        let prebuilt = std::env::var_os("RKV_PTX_DIR")
            .map(|d| std::path::PathBuf::from(d).join(format!("{}.ptx", module.name)))
            .filter(|p| p.is_file());
        let ptx = match prebuilt {
            Some(path) => Ptx::from_file(path),
            None => {
                let (major, minor) = self.info.compute_capability;
                Self::compile(module, &format!("compute_{major}{minor}"))?
            }
        };
        let loaded = self
            .ctx
            .load_module(ptx)
            .map_err(driver("cuModuleLoadData"))?;
        cache.insert(module.name, loaded.clone());
        Ok(loaded)
    }

    /// Kernel `name` of `module`, looked up once and cached (a decode step
    /// launches the same two kernels every time).
    pub(crate) fn function(&self, module: &KernelModule, name: &str) -> Result<CudaFunction> {
        let cached = |functions: &HashMap<_, HashMap<String, CudaFunction>>| {
            functions.get(module.name)?.get(name).cloned()
        };
        let lock = || {
            self.functions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        if let Some(f) = cached(&lock()) {
            return Ok(f);
        }
        let f = self
            .module(module)?
            .load_function(name)
            .map_err(driver("cuModuleGetFunction"))?;
        lock()
            .entry(module.name)
            .or_default()
            .insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// The decode tables, uploaded on first use.
    pub(crate) fn tables(&self) -> Result<&DeviceTables> {
        if let Some(t) = self.tables.get() {
            return Ok(t);
        }
        let up = driver("cuMemcpyHtoD (tables)");
        let golay = GolayTables::build();
        let meta = |wide: bool| self.stream.clone_htod(&MetaColumns::secded(wide).columns);
        let t = DeviceTables {
            secded: self
                .stream
                .clone_htod(&nibble_table(Int4Code::Secded84))
                .map_err(&up)?,
            hamming: self
                .stream
                .clone_htod(&nibble_table(Int4Code::Hamming74))
                .map_err(&up)?,
            golay_parity: self.stream.clone_htod(&golay.parity).map_err(&up)?,
            golay_leader: self.stream.clone_htod(&golay.leader).map_err(&up)?,
            meta: [meta(false).map_err(&up)?, meta(true).map_err(&up)?],
        };
        Ok(self.tables.get_or_init(|| t))
    }

    /// Blocks for a grid-stride kernel over `units` work items of `threads` threads each.
    pub(crate) fn grid_for(&self, units: usize, threads: u32) -> u32 {
        let needed = units.div_ceil(threads as usize).max(1);
        needed.min(self.info.multiprocessors.max(1) as usize * 16) as u32
    }

    /// Modules compiled or loaded so far (the cache's keys).
    pub fn loaded_modules(&self) -> Vec<&'static str> {
        let cache = self.modules.lock().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<_> = cache.keys().copied().collect();
        names.sort_unstable();
        names
    }
}
