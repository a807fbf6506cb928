//! Prints a GGUF file's metadata (arrays abbreviated), its tensors, and the
//! token ids of a text: `cargo run --release -p kv-model --example inspect_gguf -- FILE [TEXT]`.

use kv_model::gguf::{GgufFile, MetaValue};
use kv_model::tokenizer::TextTokenizer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: inspect_gguf FILE [TEXT]")?;
    let text = args
        .next()
        .unwrap_or_else(|| "The capital of France is".into());
    let file = GgufFile::open(path.as_ref())?;
    println!("GGUF v{}, alignment {}", file.version(), file.alignment());
    for (k, v) in file.metadata() {
        match v {
            MetaValue::Array(a) => println!("{k}: array of {}", a.len()),
            v => println!("{k}: {v:?}"),
        }
    }
    for t in file.tensors().iter().take(12) {
        println!("{} {:?} {} {} bytes", t.name, t.dims, t.ty.name(), t.bytes);
    }
    println!("... {} tensors", file.tensors().len());
    let tok = TextTokenizer::from_gguf(&file)?;
    println!("{text:?} -> {:?}", tok.encode(&text)?);
    Ok(())
}
