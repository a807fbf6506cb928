//! A GGUF reader (versions 2 and 3): metadata of every type, tensor infos,
//! alignment, and dequantisation of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
//! Q5_1 and the k-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K exactly as
//! ggml defines them.
//!
//! The file format follows ggml's `docs/gguf.md`: magic `GGUF`, a `u32`
//! version, `u64` tensor and metadata counts, the metadata key/value pairs,
//! the tensor infos, padding to `general.alignment` (32 when absent), then the
//! tensor data, each tensor at an aligned offset from the data section's start.
//! The cursor lives in `read.rs`, the bridge to kv-model's weights (whose
//! dequantisers follow ggml's block layouts) in `dequant.rs`, and the
//! writer in `write.rs`.
//!
//! Every length, count and offset read from the file is checked against what
//! is left of the file before anything is allocated, so a malformed or hostile
//! file gives [`ModelError::Gguf`], never a panic or a huge allocation.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{ModelError, Result};

mod dequant;
mod read;
mod write;

use read::Reader;
pub use write::GgufWriter;

/// GGUF magic: the bytes `GGUF`.
const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of the data section when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// UTF-8 `string`.
    String(String),
    /// `array` of one element type.
    Array(Vec<MetaValue>),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A ggml tensor element type, with its block geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType {
    id: u32,
    name: &'static str,
    block_elems: u64,
    block_bytes: u64,
}

/// The ggml types this reader knows (`ggml.h`'s `ggml_type` ids and block
/// sizes). Tensors of any of them can be listed; [`Tensor::to_f32`] handles
/// all but Q8_1 and the integer types.
const GGML_TYPES: &[GgmlType] = &[
    GgmlType::new(0, "F32", 1, 4),
    GgmlType::new(1, "F16", 1, 2),
    GgmlType::new(2, "Q4_0", 32, 18),
    GgmlType::new(3, "Q4_1", 32, 20),
    GgmlType::new(6, "Q5_0", 32, 22),
    GgmlType::new(7, "Q5_1", 32, 24),
    GgmlType::new(8, "Q8_0", 32, 34),
    GgmlType::new(9, "Q8_1", 32, 36),
    GgmlType::new(10, "Q2_K", 256, 84),
    GgmlType::new(11, "Q3_K", 256, 110),
    GgmlType::new(12, "Q4_K", 256, 144),
    GgmlType::new(13, "Q5_K", 256, 176),
    GgmlType::new(14, "Q6_K", 256, 210),
    GgmlType::new(15, "Q8_K", 256, 292),
    GgmlType::new(24, "I8", 1, 1),
    GgmlType::new(25, "I16", 1, 2),
    GgmlType::new(26, "I32", 1, 4),
    GgmlType::new(27, "I64", 1, 8),
    GgmlType::new(28, "F64", 1, 8),
    GgmlType::new(30, "BF16", 1, 2),
];

impl GgmlType {
    const fn new(id: u32, name: &'static str, block_elems: u64, block_bytes: u64) -> Self {
        Self {
            id,
            name,
            block_elems,
            block_bytes,
        }
    }

    /// The type with ggml id `id`, if known.
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES.iter().copied().find(|t| t.id == id)
    }

    /// The type named `name` (`"Q4_1"`), if known.
    pub fn from_name(name: &str) -> Option<Self> {
        GGML_TYPES.iter().copied().find(|t| t.name == name)
    }

    /// ggml's id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// ggml's name (`"Q4_1"`).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Elements per block.
    pub fn block_elems(&self) -> u64 {
        self.block_elems
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }
}

/// One tensor's description from the header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Name (`blk.0.attn_q.weight`).
    pub name: String,
    /// ggml's `ne`: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset from the data section's start.
    pub offset: u64,
    /// Size in bytes.
    pub bytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row length (`dims[0]`).
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }

    /// Number of rows (product of the other dims).
    pub fn rows(&self) -> usize {
        (self.elements() / self.dims[0]) as usize
    }
}

/// The bytes behind a [`GgufFile`]: a memory map or an owned buffer.
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file, its bytes memory-mapped.
pub struct GgufFile {
    bytes: Bytes,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    data_start: u64,
    alignment: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("data_start", &self.data_start)
            .finish()
    }
}

/// Refuses tensors whose bytes are not laid out as GGUF writers lay them
/// out: one after another from offset 0, each padded to `alignment`, none
/// overlapping another. A tensor whose type byte or offset was changed
/// breaks that layout (its size or start no longer meets its neighbours).
fn check_layout(infos: &[TensorInfo], alignment: u64) -> Result<()> {
    let mut by_offset: Vec<&TensorInfo> = infos.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    let mut expected = 0u64;
    let mut previous: Option<&str> = None;
    for t in by_offset {
        if t.offset != expected {
            let after = previous.map_or("the data section's start".to_string(), |p| {
                format!("the end of {p}")
            });
            return Err(ModelError::Gguf(format!(
                "tensor {} starts at offset {}, but {after} puts the next tensor at {expected} \
                 (a changed type or offset?)",
                t.name, t.offset
            )));
        }
        // Offsets and sizes are inside the file (checked above), so this
        // neither overflows nor passes the data section.
        expected = (t.offset + t.bytes).div_ceil(alignment) * alignment;
        previous = Some(&t.name);
    }
    Ok(())
}

/// A tensor's info and its bytes.
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a> {
    /// The header entry.
    pub info: &'a TensorInfo,
    /// The raw bytes (`info.bytes` of them).
    pub data: &'a [u8],
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; the model
        // cache is written once by `cargo xtask fetch-model` and never
        // modified in place, so the bytes do not change under the map.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Bytes::Mapped(map))
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Bytes::Owned(bytes))
    }

    fn parse(bytes: Bytes) -> Result<Self> {
        let mut r = Reader {
            buf: &bytes,
            pos: 0,
        };
        if r.take(4, "magic")? != MAGIC {
            return Err(ModelError::Gguf("bad magic (not a GGUF file)".into()));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::GgufVersion(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Each metadata pair takes at least 12 bytes, each tensor info 24.
        r.check_count(n_kv, 12, "metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata type")?;
            let value = r.value(ty, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(ModelError::Gguf(format!("duplicate metadata key {key}")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(ModelError::Gguf(format!(
                        "general.alignment {v:?} is not a positive power of two"
                    )));
                }
            },
        };
        r.check_count(n_tensors, 24, "tensor count")?;
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            infos.push(r.tensor_info(alignment)?);
        }
        let header_end = r.pos as u64;
        let data_start = header_end
            .div_ceil(alignment)
            .checked_mul(alignment)
            .ok_or_else(|| ModelError::Gguf("data section offset overflows".into()))?;
        let data_len = (bytes.len() as u64).saturating_sub(data_start);
        if n_tensors > 0 && data_start > bytes.len() as u64 {
            return Err(ModelError::Gguf("file ends before its data section".into()));
        }
        let mut seen = std::collections::HashSet::new();
        for t in &infos {
            if !seen.insert(t.name.as_str()) {
                return Err(ModelError::Gguf(format!("duplicate tensor {}", t.name)));
            }
            let end = t.offset.checked_add(t.bytes);
            if end.is_none_or(|e| e > data_len) {
                return Err(ModelError::Gguf(format!(
                    "tensor {} ({} bytes at offset {}) lies outside the {} data bytes (truncated file?)",
                    t.name, t.bytes, t.offset, data_len
                )));
            }
        }
        check_layout(&infos, alignment)?;
        Ok(Self {
            bytes,
            version,
            metadata,
            tensors: infos,
            data_start,
            alignment,
        })
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A required unsigned metadata value.
    pub fn meta_u64(&self, key: &str) -> Result<u64> {
        self.meta(key)
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| ModelError::ModelFile(format!("missing or non-integer metadata {key}")))
    }

    /// A required float metadata value.
    pub fn meta_f64(&self, key: &str) -> Result<f64> {
        self.meta(key)
            .and_then(MetaValue::as_f64)
            .ok_or_else(|| ModelError::ModelFile(format!("missing or non-numeric metadata {key}")))
    }

    /// A required string metadata value.
    pub fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta(key)
            .and_then(MetaValue::as_str)
            .ok_or_else(|| ModelError::ModelFile(format!("missing or non-string metadata {key}")))
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_>> {
        let info = self
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| ModelError::ModelFile(format!("missing tensor {name}")))?;
        let start = (self.data_start + info.offset) as usize;
        Ok(Tensor {
            info,
            data: &self.bytes[start..start + info.bytes as usize],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn round_trip_through_writer() {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", MetaValue::String("llama".into()))
            .meta("a.u8", MetaValue::U8(7))
            .meta("a.i64", MetaValue::I64(-3))
            .meta("a.f64", MetaValue::F64(0.5))
            .meta("a.bool", MetaValue::Bool(true))
            .meta(
                "a.arr",
                MetaValue::Array(vec![
                    MetaValue::String("x".into()),
                    MetaValue::String("yz".into()),
                ]),
            )
            .tensor_f32("t", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .tensor(
                "h",
                &[2],
                GgmlType::from_name("BF16").unwrap(),
                [
                    bf16::from_f32(1.5).to_le_bytes(),
                    bf16::from_f32(-2.0).to_le_bytes(),
                ]
                .concat(),
            );
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.meta_str("general.architecture").unwrap(), "llama");
        assert_eq!(f.meta_u64("a.u8").unwrap(), 7);
        assert_eq!(f.meta("a.i64"), Some(&MetaValue::I64(-3)));
        assert_eq!(f.meta_f64("a.f64").unwrap(), 0.5);
        assert_eq!(f.meta("a.arr").unwrap().as_array().unwrap().len(), 2);
        let t = f.tensor("t").unwrap();
        assert_eq!((t.info.rows(), t.info.row_len()), (2, 3));
        assert_eq!(t.to_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let mut row = [0.0; 3];
        t.row_to_f32(1, &mut row).unwrap();
        assert_eq!(row, [4.0, 5.0, 6.0]);
        assert_eq!(f.tensor("h").unwrap().to_f32().unwrap(), vec![1.5, -2.0]);
        assert!(matches!(f.tensor("nope"), Err(ModelError::ModelFile(_))));
        assert!(matches!(
            t.row_to_f32(2, &mut row),
            Err(ModelError::OutOfRange {
                index: 2,
                len: 2,
                ..
            })
        ));
    }
}
