//! Times single-query decode attention over one stored form (or `dense`
//! f32 rows; `KEY/VALUE` stores keys and values in two forms, as
//! `int4-ch64/lm4`) at one shape and context, printing milliseconds and
//! stored bytes read per second of each repetition, then their median; `REPS` sets the repetitions (default 20),
//! `NUMERICS=exact|int8|int16|auto` picks `Numerics::Exact`, `Int8Query`
//! (integer keys scored with int8-quantized queries), `Int16Query` or
//! `Auto` (the default),
//! `TILE` sets the rows of every tile (default: up to 256, fewer where a
//! tile would hold more than 128 KiB of stored K and V rows),
//! `ISA=scalar|avx2|avx512|avx512-vnni` pins the instruction set (default:
//! the best this CPU has),
//! `FRESH=1` calls `decode` (fresh buffers each call) instead of
//! `decode_into` with one kept workspace. Threads follow
//! `RAYON_NUM_THREADS`.
//!
//! `cargo run --release -p attention --example decode_timing -- int4+secded84 32 8 128 65536`

use std::time::Instant;

use attention::{Attention, AttentionConfig, DenseKv, HeadShape, Mask, Numerics, Workspace};
use kv_quant::KvStore;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let form = args.first().map_or("int4", String::as_str);
    let num = |i: usize, default: usize| args.get(i).map_or(Ok(default), |s| s.parse());
    let shape = HeadShape::new(num(1, 32)?, num(2, 8)?, num(3, 128)?)?;
    let tokens = num(4, 65536)?;
    let ch = shape.kv_channels();
    let data = |phase: f32| -> Vec<f32> {
        (0..tokens * ch)
            .map(|i| ((i / ch) as f32 * 0.013 + (i % ch) as f32 * 0.37 + phase).sin())
            .collect()
    };
    let (k, v) = (data(0.0), data(1.0));
    let q: Vec<f32> = (0..shape.q_len()).map(|i| (i as f32 * 0.3).sin()).collect();
    let numerics = match std::env::var("NUMERICS").as_deref() {
        Ok("int8") => Numerics::Int8Query,
        Ok("int16") => Numerics::Int16Query,
        Ok("exact") => Numerics::Exact,
        Ok("auto") | Err(_) => Numerics::Auto,
        Ok(other) => {
            return Err(format!("NUMERICS={other}: expected exact, int8, int16 or auto").into());
        }
    };
    let mut config = AttentionConfig {
        numerics,
        ..AttentionConfig::default()
    };
    if let Ok(isa) = std::env::var("ISA") {
        config.isa = isa.parse()?;
    }
    if let Some(tile) = std::env::var("TILE").ok().and_then(|s| s.parse().ok()) {
        config.tile_tokens = tile;
        config.tile_bytes = None;
    }
    let attn = Attention::with_config(shape, config)?;
    let spelling = if form == "dense" { "fp32" } else { form };
    let (key_form, value_form) = spelling.split_once('/').unwrap_or((spelling, spelling));
    let (ks, vs) = (
        KvStore::quantize(key_form.parse()?, &k, tokens, ch)?,
        KvStore::quantize(value_form.parse()?, &v, tokens, ch)?,
    );
    let bytes = (ks.stored_bytes() + vs.stored_bytes()) as f64;
    let dense = (DenseKv::new(&k, tokens, ch)?, DenseKv::new(&v, tokens, ch)?);
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let fresh = std::env::var("FRESH").is_ok_and(|v| v == "1");
    let (mut out, mut lse) = (vec![0.0f32; shape.q_len()], vec![0.0f32; shape.q_heads()]);
    let (mut ws_dense, mut ws_store) = (Workspace::new(), Workspace::new());
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        let p = tokens - 1;
        match (form == "dense", fresh) {
            (true, true) => out = attn.decode(&q, p, &dense.0, &dense.1, &Mask::Causal)?.out,
            (false, true) => out = attn.decode(&q, p, &ks, &vs, &Mask::Causal)?.out,
            (true, false) => {
                let m = &Mask::Causal;
                attn.decode_into(
                    &q,
                    p,
                    &dense.0,
                    &dense.1,
                    m,
                    &mut out,
                    &mut lse,
                    &mut ws_dense,
                )?;
            }
            (false, false) => {
                let m = &Mask::Causal;
                attn.decode_into(&q, p, &ks, &vs, m, &mut out, &mut lse, &mut ws_store)?;
            }
        }
        let s = t.elapsed().as_secs_f64();
        times.push(s);
        println!(
            "{form}: {:.2} ms, {:.2} GB/s (out[0] = {})",
            s * 1e3,
            bytes / s / 1e9,
            out[0]
        );
    }
    times.sort_by(f64::total_cmp);
    if let Some(&median) = times.get(times.len() / 2) {
        println!(
            "{form}: median {:.2} ms, {:.2} GB/s",
            median * 1e3,
            bytes / median / 1e9
        );
    }
    Ok(())
}
