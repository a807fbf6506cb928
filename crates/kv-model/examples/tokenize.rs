//! Tokenizes a file with a GGUF model's tokenizer and prints the ids as JSON:
//! `cargo run --release -p kv-model --example tokenize -- MODEL TEXT`.

use kv_model::gguf::GgufFile;
use kv_model::tokenizer::TextTokenizer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, text] = args.as_slice() else {
        return Err("usage: tokenize MODEL TEXT".into());
    };
    let tok = TextTokenizer::from_gguf(&GgufFile::open(model.as_ref())?)?;
    let ids = tok.encode(&std::fs::read_to_string(text)?)?;
    eprintln!("{} tokens", ids.len());
    // A JSON array of integers.
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    println!("[{}]", ids.join(","));
    Ok(())
}
