//! Times single-query decode attention through a page table at 32/8/128
//! (Llama-3-8B's shape): `FORM` rows of `TOKENS` tokens written into
//! shuffled blocks of `BLOCK` tokens (staged forms sealed as their steps
//! would have), then `REPS` decodes with one kept workspace, printing the
//! median and fastest milliseconds. The low-setup target for `perf` on
//! paged reads (`paged-cache/decode-*` in `cargo xtask bench` is the
//! measured figure). `NUMERICS=exact|int8|auto` picks attention's
//! numerics (default `auto`); `FRESH=1` calls `decode` (fresh buffers
//! each call, as the bench does) instead of `decode_into` with one kept
//! workspace; `VALUE_FORM` stores the values in another form than the
//! keys; threads follow `RAYON_NUM_THREADS`.
//!
//! `cargo run --release -p paged-cache --example paged_decode_timing -- int4-ch 64 65536 20`

use attention::{Attention, AttentionConfig, HeadShape, Mask, Numerics, Workspace};
use kv_quant::CacheForm;
use paged_cache::{BlockId, BlockStorage, KvPart, LayerSpec, PageTable, PagedKv};
use rayon::prelude::*;
use std::time::Instant;
use test_support::rows::{shuffled, smooth_rows};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let form: CacheForm = args.first().map_or("int4-ch", String::as_str).parse()?;
    let bs: usize = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let tokens: usize = args.get(2).map_or(Ok(65536), |s| s.parse())?;
    let reps: usize = args.get(3).map_or(Ok(20), |s| s.parse())?;
    let numerics = match std::env::var("NUMERICS").as_deref() {
        Ok("int8") => Numerics::Int8Query,
        Ok("exact") => Numerics::Exact,
        Ok("auto") | Err(_) => Numerics::Auto,
        Ok(other) => return Err(format!("NUMERICS={other}: expected exact, int8 or auto").into()),
    };
    if bs == 0 || tokens == 0 || reps == 0 || !tokens.is_multiple_of(bs) {
        return Err(format!("{tokens} tokens, blocks of {bs}, {reps} reps: expected positive counts, the tokens whole blocks").into());
    }
    let shape = HeadShape::new(32, 8, 128)?;
    let ch = shape.kv_channels();
    let attn = Attention::with_config(
        shape,
        AttentionConfig {
            numerics,
            ..AttentionConfig::default()
        },
    )?;
    let q = smooth_rows(1, shape.q_len(), 0.3);
    let (k, v) = (smooth_rows(tokens, ch, 0.0), smooth_rows(tokens, ch, 1.0));
    let blocks = tokens / bs;
    let value: CacheForm = match std::env::var("VALUE_FORM") {
        Ok(v) => v.parse()?,
        Err(_) => form,
    };
    let spec = LayerSpec {
        key: form,
        value,
        channels: ch,
    };
    let storage = BlockStorage::new(blocks, bs, &[spec])?;
    // Shuffled physical order, as a long-running pool hands blocks out.
    let order = shuffled(blocks as u32);
    let tb: Vec<BlockId> = order.iter().map(|&b| BlockId(b)).collect();
    (0..tokens).into_par_iter().for_each(|t| {
        let r = t * ch..(t + 1) * ch;
        storage
            .write(tb[t / bs], t % bs, 0, &k[r.clone()], &v[r])
            .expect("write");
    });
    storage.seal_blocks(&tb, 0, tokens, &mut paged_cache::SeqTables::default())?;
    let table = PageTable::from_tables(&[(&tb, tokens)], bs)?;
    let keys = PagedKv::new(&storage, &table, 0, 0, KvPart::Keys)?;
    let values = PagedKv::new(&storage, &table, 0, 0, KvPart::Values)?;
    let (mut out, mut lse) = (vec![0.0f32; shape.q_len()], vec![0.0f32; shape.q_heads()]);
    let mut ws = Workspace::new();
    let fresh = std::env::var("FRESH").is_ok_and(|v| v == "1");
    let mut times = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        if fresh {
            out = attn
                .decode(&q, tokens - 1, &keys, &values, &Mask::Causal)?
                .out;
        } else {
            attn.decode_into(
                &q,
                tokens - 1,
                &keys,
                &values,
                &Mask::Causal,
                &mut out,
                &mut lse,
                &mut ws,
            )?;
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{form}, blocks of {bs}, {tokens} tokens: median {:.3} ms, fastest {:.3} ms (out[0] = {})",
        times[reps / 2],
        times[0],
        out[0]
    );
    Ok(())
}
