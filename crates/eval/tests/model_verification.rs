//! A model file that parses but is wrong is refused at load, each case on
//! the tiny Llama written as GGUF and then damaged: a block count lowered
//! (the last block's tensors unused), a tensor no Llama uses, a type byte
//! or an offset changed (the tensors' layout no longer tiles the data
//! section), a norm stored as F16, a NaN in a norm weight or a block
//! scale (refused unless the load allows it, as a fault experiment does).

mod common;

use common::tiny::{LAYERS, tiny_gguf, tiny_gguf_with};
use kv_model::ModelError;
use kv_model::gguf::{GgmlType, GgufFile, GgufWriter};
use kv_model::model::{LlamaModel, LoadOptions};

/// The header bytes of tensor `name`'s info: the offset of its type (u32)
/// and of its data offset (u64) in the image.
fn info_at(bytes: &[u8], name: &str) -> (usize, usize) {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    let at = bytes
        .windows(key.len())
        .position(|w| w == key.as_slice())
        .expect("the tensor's name is in the header");
    let dims_at = at + key.len();
    let n_dims = u32::from_le_bytes(bytes[dims_at..dims_at + 4].try_into().unwrap()) as usize;
    let ty = dims_at + 4 + 8 * n_dims;
    (ty, ty + 4)
}

/// How a test damages one tensor: from its name, type and bytes to the
/// type and bytes written.
type Edit<'a> = &'a dyn Fn(&str, GgmlType, Vec<u8>) -> (GgmlType, Vec<u8>);

/// The tiny model written again, each tensor through `edit`.
fn rewrite(edit: Edit<'_>) -> GgufWriter {
    let file = GgufFile::from_bytes(tiny_gguf()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        w.meta(k, v.clone());
    }
    for t in file.tensors() {
        let data = file.tensor(&t.name).unwrap().data.to_vec();
        let (ty, data) = edit(&t.name, t.ty, data);
        w.tensor(&t.name, &t.dims, ty, data);
    }
    w
}

fn load(bytes: Vec<u8>) -> Result<LlamaModel, ModelError> {
    LlamaModel::from_gguf(&GgufFile::from_bytes(bytes)?)
}

fn refusal(bytes: Vec<u8>) -> String {
    match load(bytes) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a damaged file loaded"),
    }
}

#[test]
fn the_undamaged_file_loads() {
    load(tiny_gguf()).unwrap();
}

#[test]
fn tensors_the_model_does_not_use_are_refused() {
    // The header says one block fewer: the last block's tensors are left.
    let m = refusal(tiny_gguf_with(1e-5, LAYERS as u32 - 1));
    assert!(
        m.contains(&format!("blk.{}.", LAYERS - 1)) && m.contains("not used"),
        "{m}"
    );
    // A tensor no Llama has.
    let mut w = rewrite(&|_, ty, data| (ty, data));
    w.tensor_f32("blk.0.attn_q_norm.weight", &[4], &[1.0; 4]);
    let m = refusal(w.to_bytes());
    assert!(m.contains("blk.0.attn_q_norm.weight"), "{m}");
}

#[test]
fn a_changed_type_or_offset_breaks_the_layout_and_is_refused() {
    // F32 to F16: the tensor's bytes shrink, the next tensor no longer
    // starts where it ends.
    let mut bytes = tiny_gguf();
    let (ty, _) = info_at(&bytes, "blk.0.attn_q.weight");
    bytes[ty..ty + 4].copy_from_slice(&1u32.to_le_bytes());
    let m = refusal(bytes);
    assert!(m.contains("offset") && m.contains("malformed GGUF"), "{m}");
    // An offset moved by one alignment unit (still aligned).
    let mut bytes = tiny_gguf();
    let (_, off) = info_at(&bytes, "blk.0.attn_k.weight");
    let o = u64::from_le_bytes(bytes[off..off + 8].try_into().unwrap());
    bytes[off..off + 8].copy_from_slice(&(o + 32).to_le_bytes());
    let m = refusal(bytes);
    assert!(
        m.contains("blk.0.attn_k.weight") || m.contains("offset"),
        "{m}"
    );
}

#[test]
fn norms_are_f32_and_finite_unless_allowed() {
    let rebuild = |edit: Edit<'_>| rewrite(edit).to_bytes();
    let f16 = GgmlType::from_name("F16").unwrap();
    let norm_as_f16 = rebuild(&|name, ty, data| {
        if name == "output_norm.weight" {
            let halves = data
                .chunks_exact(4)
                .flat_map(|b| {
                    let v = f32::from_le_bytes(b.try_into().unwrap());
                    half::f16::from_f32(v).to_le_bytes()
                })
                .collect();
            (f16, halves)
        } else {
            (ty, data)
        }
    });
    let m = refusal(norm_as_f16);
    assert!(m.contains("output_norm.weight") && m.contains("F32"), "{m}");

    // A NaN in a norm, and a NaN scale in a Q8_0 block of the embedding.
    for (tensor, at) in [("blk.1.ffn_norm.weight", 8), ("token_embd.weight", 34 * 5)] {
        let nan = rebuild(&|name, ty, mut data| {
            if name == tensor {
                if ty.name() == "F32" {
                    data[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
                } else {
                    data[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
                }
            }
            (ty, data)
        });
        let m = refusal(nan.clone());
        assert!(m.contains(tensor) && m.contains("NaN"), "{m}");
        let file = GgufFile::from_bytes(nan).unwrap();
        let allow = LoadOptions {
            allow_non_finite: true,
        };
        LlamaModel::from_gguf_with(&file, &allow).unwrap();
    }
}
