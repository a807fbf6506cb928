#!/usr/bin/env bash
# hostile-probe.sh: a hostile-input probe of the `kv-eval` command line.
#
# Runs a table of deliberately bad invocations of every kv-eval command
# (nonsense and boundary numbers, malformed form spellings, block sizes a
# form cannot use, directories / devices / missing files / unwritable paths
# as inputs and outputs, corrupted copies of the GGUF model, malformed
# `batch` requests files, huge sizes) and classifies each outcome:
#
#   panic               exit 101 or "panicked at" on stderr
#   abort               killed by a signal (exit >= 128 other than the
#                       timeout's 124), or "memory allocation of" / "Aborted"
#   timeout             ran past the per-case limit (possible unbounded work)
#   exit0-on-bad-input  exit 0 where the input should have been refused
#   error-on-valid      a case marked valid (expected ok) was refused
#   clean-error         non-zero exit with a message
#   ok                  exit 0 where exit 0 is acceptable
#
# Clean errors are also checked for unhelpful messages: Rust debug dumps
# (`Foo { `, `Some(`, `Err(`, `Ok(`), fewer than 16 characters, or not
# naming the offending input (each case lists a regex the message should
# match). Any hostile case whose peak RSS passes PROBE_RSS_FLAG_KB is flagged
# too: under the virtual-memory cap an unbounded read ends as a clean "out
# of memory" error, without the cap it would take the machine's memory.
#
# Usage:  scripts/hostile-probe.sh [path-to-kv-eval] [out-dir]
#   path-to-kv-eval  default target/release/kv-eval (built beforehand; this
#                    script never builds)
#   out-dir          default target/hostile-probe/ ; receives results.tsv,
#                    summary.md and the stdout/stderr of every case (logs/)
# Environment: PROBE_TIMEOUT (seconds per case, default 60),
#              PROBE_VMEM_KB (virtual-memory cap per case, default 8 GiB),
#              PROBE_ONLY (regex: rerun only the cases whose id matches,
#                keeping the other rows of an earlier results.tsv),
#              PROBE_RSS_FLAG_KB (flag hostile cases whose peak RSS is over
#                this, default 3.5 GiB: unbounded reads caught by the cap).
#
# The models and texts come from ~/.cache/reliable-kv/ (what
# `cargo xtask fetch-model` fetched). Needs bash, coreutils and python3
# (for the corrupted GGUF copies); /usr/bin/time is used for peak RSS when
# present. It takes roughly 5-10 minutes on 2 cores.
#
# CI does NOT run this script: it is a manual robustness probe, and its
# findings are turned into ordinary tests where they reveal defects.

set -u

KV=${1:-target/release/kv-eval}
OUT=${2:-target/hostile-probe}
TIMEOUT=${PROBE_TIMEOUT:-60}
VMEM_KB=${PROBE_VMEM_KB:-8388608}
ONLY=${PROBE_ONLY:-}
RSS_FLAG_KB=${PROBE_RSS_FLAG_KB:-3670016}

[[ -x $KV ]] || { echo "no executable kv-eval at $KV (build it first)" >&2; exit 2; }
KV=$(cd "$(dirname "$KV")" && pwd)/$(basename "$KV")
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)

CACHE=$HOME/.cache/reliable-kv
GG=$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
QW=$CACHE/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
TXT=$CACHE/python3.11-tutorial.txt
for f in "$GG" "$QW" "$TXT"; do
    [[ -f $f ]] || { echo "missing $f (run cargo xtask fetch-model)" >&2; exit 2; }
done

TIMEBIN=""
COMMANDS="ppl sweep frontier lowrank-report calibrate generate batch niah accumulate adapt shard-stream top"
if command -v /usr/bin/time >/dev/null 2>&1; then TIMEBIN=/usr/bin/time; fi

# Scratch folder for corrupted models, requests files and every case's
# outputs; the cases run with it as their working directory.
W=$(mktemp -d /tmp/kv-hostile.XXXXXX)
trap 'rm -rf "$W"' EXIT

# ---------------------------------------------------------------- fixtures
setup() {
    echo "fixtures in $W"
    mkdir -p "$W/out" "$W/adir" "$W/hf-empty" "$W/hf-garbage"
    echo "not a folder" > "$W/afile"
    head -c 1000 "$GG" > "$W/trunc1000.gguf"
    head -c 49000000 "$GG" > "$W/trunc-half.gguf"
    : > "$W/empty.gguf"
    head -c 1000000 /dev/urandom > "$W/random.gguf"
    { printf 'GGUF\003\000\000\000'; head -c 1000000 /dev/urandom; } > "$W/random-magic.gguf"
    printf 'not json' > "$W/hf-garbage/config.json"
    head -c 4096 /dev/urandom > "$W/hf-garbage/model.safetensors"
    printf '{}' > "$W/hf-garbage/tokenizer.json"
    head -c 3000 /dev/urandom > "$W/binary.txt"          # not UTF-8
    printf '\xff\xfe\xfd' > "$W/bad-utf8.txt"
    printf 'x' > "$W/onechar.txt"
    head -c 4000 "$TXT" > "$W/small.txt"                   # a short calibration text
    mkgguf                                                 # in-place header corruptions
    # batch requests files
    : > "$W/rq-empty.jsonl"
    printf '\n\n   \n' > "$W/rq-blank.jsonl"
    printf 'hello world\n' > "$W/rq-nonjson.jsonl"
    printf '[{"prompt":"hi","max_new_tokens":4}]\n' > "$W/rq-array.jsonl"
    printf '{"prompt":"hi","max_new_tokens":18446744073709551615}\n' > "$W/rq-maxu64.jsonl"
    printf '{"prompt":"hi","max_new_tokens":1e30}\n' > "$W/rq-float.jsonl"
    printf '{"prompt":"hi","max_new_tokens":-1}\n' > "$W/rq-neg.jsonl"
    printf '{"prompt":"hi","max_new_tokens":9000}\n' > "$W/rq-pastctx.jsonl"
    printf '{"prompt":"hi","max_new_tokens":0}\n' > "$W/rq-zero.jsonl"
    printf '{"prompt":"","max_new_tokens":4}\n' > "$W/rq-emptyprompt.jsonl"
    printf '{"prompt":"hi"}\n' > "$W/rq-missing.jsonl"
    printf '{"prompt":"hi","max_new_tokens":4,"bogus":1}\n' > "$W/rq-unknown.jsonl"
    printf '{"prompt":"hi","max_new_tokens":4,"arrival_step":18446744073709551615}\n' > "$W/rq-arrival.jsonl"
    printf '{"prompt":"hi","max_new_tokens":4,"temperature":-1}\n' > "$W/rq-temp.jsonl"
    printf '{"prompt":"hi","max_new_tokens":4,"top_p":0}\n' > "$W/rq-topp0.jsonl"
    printf '{"prompt":"hi","max_new_tokens":4,"top_p":1e-300,"temperature":1e308}\n' > "$W/rq-extreme-sampling.jsonl"
    printf '{"prompt":"hi","max_new_tokens":4,"priority":4294967295,"seed":18446744073709551615}\n' > "$W/rq-maxprio.jsonl"
    printf '{"prompt":"hi","max_new_tokens":4}\n{"prompt":"hi","max_new_tokens":"four"}\n' > "$W/rq-line2.jsonl"
    printf '{"prompt":"hi","max_new_tokens":4}\n' > "$W/rq-ok.jsonl"
    python3 -c 'import json; print(json.dumps({"prompt": "word " * 20000, "max_new_tokens": 4}))' > "$W/rq-longprompt.jsonl"
    python3 -c 'print("{\"prompt\":" * 100000)' > "$W/rq-deep.jsonl"
    # prompt files
    python3 -c 'print("word " * 20000)' > "$W/long-prompt.txt"
    # a calibration file fitted quickly, and corrupted copies of it
    if "$KV" calibrate --calib-tokens 64 --calib-ctx 32 --out "$W/cal.st" >/dev/null 2>&1; then
        head -c 200 "$W/cal.st" > "$W/cal-trunc.st"
        { head -c 8 "$W/cal.st"; head -c 5000 /dev/urandom; } > "$W/cal-random.st"
    else
        echo "warning: could not write the calibration fixture" >&2
    fi
}

# Corrupted copies of the GGUF: each edits one header field of a full copy
# (so nothing else is wrong with the file).
mkgguf() {
    python3 - "$GG" "$W" <<'PY'
import shutil, struct, sys
src, w = sys.argv[1], sys.argv[2]
data = open(src, 'rb').read()
FMT = {0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: 'B', 10: 'Q', 11: 'q', 12: 'd'}
meta, tensors = {}, {}
p = 24
def u32():
    global p; v = struct.unpack_from('<I', data, p)[0]; p += 4; return v
def u64():
    global p; v = struct.unpack_from('<Q', data, p)[0]; p += 8; return v
def string():
    global p; off = p; n = u64(); p += n; return data[off + 8:p].decode(), off
def skip(t):
    global p
    if t in FMT: p += struct.calcsize('<' + FMT[t]); return
    if t == 8: string(); return
    it = u32(); n = u64()
    for _ in range(n): skip(it)
n_tensors = struct.unpack_from('<Q', data, 8)[0]
n_kv = struct.unpack_from('<Q', data, 16)[0]
for _ in range(n_kv):
    key, koff = string(); t = u32(); meta[key] = (t, p, koff); skip(t)
for _ in range(n_tensors):
    name, noff = string(); nd = u32(); doff = p
    dims = [u64() for _ in range(nd)]; toff = p; u32(); u64()
    tensors[name] = (doff, toff)
data_start = (p + 31) // 32 * 32   # the reader's default alignment
def info_offset(name):
    return struct.unpack_from('<Q', data, tensors[name][1] + 4)[0]
def data_at(name):
    return data_start + info_offset(name)
def out(name, edits):
    b = bytearray(data)
    for off, fmt, val in edits:
        struct.pack_into(fmt, b, off, val)
    open(f'{w}/{name}.gguf', 'wb').write(b)
def m(key, val):
    t, off, _ = meta[key]
    return (off, '<' + FMT[t], val)
nan = float('nan')
out('version99', [(4, '<I', 99)])
out('badmagic', [(0, '<I', 0x46554747 ^ 0xff)])
out('ntensors-huge', [(8, '<Q', 2**64 - 1)])
out('nkv-huge', [(16, '<Q', 2**62)])
out('keylen-huge', [(meta['general.architecture'][2], '<Q', 2**64 - 1)])
out('toktype-unknown', [(tensors['token_embd.weight'][1], '<I', 0xff)])
out('toktype-f32', [(tensors['token_embd.weight'][1], '<I', 0)])   # too big for its bytes
out('normtype-f16', [(tensors['blk.0.attn_norm.weight'][1], '<I', 1)])  # fits, wrong data
out('dim-unaligned', [(tensors['token_embd.weight'][0], '<Q', 577)])
out('dim-huge', [(tensors['token_embd.weight'][0] + 8, '<Q', 2**40)])
out('dim-small', [(tensors['token_embd.weight'][0] + 8, '<Q', 1)])  # 1-token vocab
out('layers0', [m('llama.block_count', 0)])
out('layers-huge', [m('llama.block_count', 2**32 - 1)])
out('layers31', [m('llama.block_count', 31)])
out('layers29', [m('llama.block_count', 29)])   # the last block's tensors unused
out('offset32', [(tensors['blk.0.attn_k.weight'][1] + 4, '<Q',
                  info_offset('blk.0.attn_k.weight') + 32)])   # still aligned
out('norm-nan', [(data_at('blk.1.ffn_norm.weight') + 8, '<f', nan)])
out('embd0', [m('llama.embedding_length', 0)])
out('embd577', [m('llama.embedding_length', 577)])
out('heads0', [m('llama.attention.head_count', 0)])
out('kvheads0', [m('llama.attention.head_count_kv', 0)])
out('kvheads4', [m('llama.attention.head_count_kv', 4)])
out('ffn-huge', [m('llama.feed_forward_length', 2**32 - 1)])
out('ropebase-nan', [m('llama.rope.freq_base', nan)])
out('ropebase-neg', [m('llama.rope.freq_base', -1.0)])
out('eps-nan', [m('llama.attention.layer_norm_rms_epsilon', nan)])
out('ropedim0', [m('llama.rope.dimension_count', 0)])
out('ropedim-huge', [m('llama.rope.dimension_count', 100000)])
out('ctx0', [m('llama.context_length', 0)])
out('vocab-huge', [m('llama.vocab_size', 2**32 - 1)])
out('bos-huge', [m('tokenizer.ggml.bos_token_id', 2**32 - 1)])
out('eos-huge', [m('tokenizer.ggml.eos_token_id', 2**32 - 1)])
PY
}

# -------------------------------------------------------------- the cases
# One case a line:   EXPECT  NEEDLE  ARGS...
#   EXPECT  bad  the input is hostile and must be refused (exit 0 is a defect)
#           ok   a valid boundary case (exit 0 expected)
#           any  either outcome is acceptable (only crashes and hangs count)
#   NEEDLE  extended regex (case-insensitive) a helpful error message should
#           match: the flag or value at fault; `-` for no check
#   ARGS    kv-eval's arguments, as shell words (expanded when the case runs:
#           $W scratch folder, $O this case's output folder, $GG / $QW the
#           models, $TXT the corpus, $P / $C cheap run / calibration sizes)
P="--max-tokens 64 --ctx 32"
C="--calib-tokens 64 --calib-ctx 32"
CASES=$(cat <<'EOF'
# ---- global --memory-limit
bad  memory.limit                   --memory-limit 0 generate --prompt hi --max-new 4 --ctx 64
bad  memory.limit|-1                --memory-limit -1 top
bad  memory.limit|18446744073709551615 --memory-limit 18446744073709551615T top
bad  memory.limit|nan               --memory-limit NaN top
any  -                              --memory-limit 1.5G top -k 2
ok   -                              --memory-limit 18446744073709551615 top -k 2
bad  memory.limit|budget            --memory-limit 1K batch --requests $W/rq-ok.jsonl --out $O
bad  memory.limit|budget            --memory-limit 1M niah --lengths 128 --depths 0.5 --out $O
bad  memory.limit|budget            --memory-limit 1K accumulate --prompt-tokens 16 --steps 4 --forms int4+secded84 --scrub never --out $O
bad  memory.limit|budget            --memory-limit 1 ppl --max-tokens 64 --ctx 32 --backend paged
bad  command|subcommand             nonsense-command
# ---- ppl: numbers
bad  ctx                            ppl --max-tokens 64 --ctx 0
any  ctx                            ppl --max-tokens 64 --ctx 1
ok   -                              ppl --max-tokens 64 --ctx 4
bad  ctx|token                      ppl --max-tokens 64 --ctx 18446744073709551615
bad  max.tokens                     ppl --max-tokens 0 --ctx 32
bad  max.tokens|token               ppl --max-tokens 1 --ctx 32
bad  stride                         ppl $P --method sliding --stride 0
any  stride                         ppl $P --method sliding --stride 18446744073709551615
bad  thread                         ppl $P --threads 18446744073709551615
any  thread                         ppl $P --threads 100000
bad  ber                            ppl $P --form int4 --ber -1
bad  ber|bit.error.rate             ppl $P --form int4 --ber 2
bad  ber|nan                        ppl $P --form int4 --ber NaN
bad  ber|--form                     ppl $P --ber 0.01
bad  channel                        ppl $P --form int4 --ber 0.01 --channel xyz
ok   -                              ppl $P --form int4 --ber 1 --channel stuck1
bad  abft.emax|nan                  ppl $P --abft --abft-emax NaN
bad  gemm.flips                     ppl $P --abft --gemm-flips 2
bad  gemm.flips|abft                ppl $P --gemm-flips 0.5
bad  abft.correct|abft              ppl $P --abft-correct
bad  weight.flips                   ppl $P --weight-flips 2
bad  weight.flips|nan               ppl $P --weight-flips NaN
bad  weight.check|never             ppl $P --weight-check 0
bad  weight.check|never             ppl $P --weight-check -3
bad  weight.group                   ppl $P --weight-check 1 --weight-group 0
bad  weight.flips|abft|use.one      ppl $P --weight-flips 1e-7 --abft
bad  weight.flips|plain             ppl $P --weight-flips 1e-7 --form int4
bad  weight|memory.limit            --memory-limit 150M ppl $P --weight-check 1 --weight-group 1
ok   -                              ppl $P --weight-flips 1e-7 --weight-check 1 --weight-group 18446744073709551615
bad  calib.tokens|calibration.tokens ppl $P --form vq --calib-tokens 0 --calib-ctx 32
any  calib                          ppl $P --form vq --calib-tokens 18446744073709551615 --calib-ctx 32 --calib-text $W/small.txt
# ---- ppl: paths
bad  text|null|token|empty          ppl $P --text /dev/null
any  text|zero|memory               ppl $P --text /dev/zero
bad  text|nonexistent               ppl $P --text $W/nonexistent.txt
bad  text|adir|directory            ppl $P --text $W/adir
bad  text|binary|utf                ppl $P --text $W/binary.txt
bad  text|token|onechar             ppl $P --text $W/onechar.txt
bad  json|proc                      ppl $P --json /proc/x/out
bad  json|full|space                ppl $P --json /dev/full
bad  json|adir|directory            ppl $P --json $W/adir
# ---- models (through top, generate and ppl)
bad  model|nonexistent              top --model $W/nonexistent.gguf
bad  model|name|bogus               top --model bogus-model-name
bad  model|adir|config              top --model $W/adir
bad  model|config|json              top --model $W/hf-garbage
bad  model|null|gguf|magic|truncat  top --model /dev/null
bad  model|zero|gguf|magic|truncat  top --model /dev/zero
bad  model|gguf|truncat             top --model $W/trunc1000.gguf
bad  truncat|tensor                 top --model $W/trunc-half.gguf
bad  model|gguf|magic               top --model $W/random.gguf
bad  gguf|version                   top --model $W/version99.gguf
bad  tensor.count                   top --model $W/ntensors-huge.gguf
bad  key|truncat                    top --model $W/keylen-huge.gguf
bad  token_embd|type                top --model $W/toktype-unknown.gguf
bad  token_embd                     top --model $W/toktype-f32.gguf
bad  offset|attn_norm                top --model $W/normtype-f16.gguf
bad  token_embd                     top --model $W/dim-huge.gguf
bad  token_embd|vocab               top --model $W/dim-small.gguf
bad  block_count|layer              top --model $W/layers0.gguf
bad  block_count|layer|blk\.        top --model $W/layers-huge.gguf
bad  block_count|layer|blk\.30      top --model $W/layers31.gguf
bad  blk\.29|not.used               top --model $W/layers29.gguf
bad  offset                         top --model $W/offset32.gguf
bad  ffn_norm|nan                   top --model $W/norm-nan.gguf
ok   -                              top --model $W/norm-nan.gguf --allow-non-finite-weights
bad  embedding                      top --model $W/embd577.gguf
bad  head                           top --model $W/kvheads4.gguf
bad  feed_forward|ffn               top --model $W/ffn-huge.gguf
bad  rope|freq                      top --model $W/ropebase-nan.gguf
bad  eps|norm                       top --model $W/eps-nan.gguf
bad  rope|rotary                    top --model $W/ropedim0.gguf
any  context                        top --model $W/ctx0.gguf
bad  vocab|token_embd               top --model $W/vocab-huge.gguf
any  eos                            generate --model $W/eos-huge.gguf --prompt hi --max-new 4 --ctx 64
# ---- form spellings (through ppl)
bad  int4-ch0                       ppl $P $C --form int4-ch0
bad  pca-r0                         ppl $P $C --form pca-r0
bad  pca-r100000|rank               ppl $P $C --form pca-r100000
bad  pca-e1.5|energy                ppl $P $C --form pca-e1.5
bad  int99                          ppl $P $C --form int99
bad  int4\+sink999999|sink          ppl $P $C --form int4+sink999999
bad  form|empty|''                  ppl $P $C --form ''
any  int4-g3|group                  ppl $P $C --form int4-g3
bad  int4-g100000|group             ppl $P $C --form int4-g100000
bad  lm9                            ppl $P $C --form lm9
bad  vq-d3                          ppl $P $C --form vq-d3
bad  vq-k100000                     ppl $P $C --form vq-k100000
bad  fp8-e4m3-h7|head               ppl $P $C --form fp8-e4m3-h7
bad  rot128|rotation|head           ppl $P $C --form int4+rot128
bad  interp|code                    ppl $P $C --form int4+interp
bad  code                           ppl $P $C --form int4+golay24+secded84
bad  s9|stream                      ppl $P $C --form shard-s9
bad  r100000|rank                   ppl $P $C --form shard-r100000
bad  fd-r8-m4|sketch                ppl $P $C --form fd-r8-m4
bad  \+|empty|suffix                ppl $P $C --form +
bad  key.form|bogus                 ppl $P $C --form int4 --key-form fp16 --value-form bogus
bad  plain|key.form                 ppl $P $C --key-form plain --value-form int4
bad  layer.forms|99|layer           ppl $P $C --layer-forms '99:fp16;*:int4'
bad  layer.forms|rule|layer         ppl $P $C --layer-forms '0:fp16'
bad  layer.forms|18446744073709551616|layer ppl $P $C --layer-forms '18446744073709551616:int4;*:fp16'
bad  dense|plain|backend            ppl $P --backend dense --form int4
# ---- block sizes a form cannot use (paged backend)
bad  block.size                     ppl $P --backend paged --block-size 0
bad  block.size|memory|budget       ppl $P --backend paged --block-size 18446744073709551615
bad  block|int4-ch16|7              ppl $P --backend paged --form int4-ch16 --block-size 7
bad  block|int4-ch32|16             ppl $P --backend paged --form int4-ch32 --block-size 16
any  block|win                      ppl $P --backend paged --form int4+win32 --block-size 5
bad  block|int4-ch32|16             generate --prompt hi --max-new 4 --ctx 64 --form int4-ch32 --block-size 16
# ---- sweep
bad  bers|''                        sweep $P --forms int4 --bers '' --out $O
bad  bers|nan                       sweep $P --forms int4 --bers NaN --out $O
bad  bers|,                         sweep $P --forms int4 --bers 0,,0.1 --out $O
bad  forms|""|empty                 sweep $P --forms '' --bers 0 --out $O
bad  out|proc                       sweep $P --forms int4 --bers 0 --out /proc/x/out
bad  out|afile|director             sweep $P --forms int4 --bers 0 --out $W/afile
bad  ctx                            sweep --max-tokens 64 --ctx 0 --forms int4 --bers 0 --out $O
# ---- frontier
bad  contexts|0                     frontier --max-tokens 64 --contexts 0 --configs int4 --out $O
bad  contexts|token|18446744073709551615 frontier --max-tokens 64 --contexts 18446744073709551615 --configs int4 --out $O
bad  configs|""|empty               frontier --max-tokens 64 --contexts 32 --configs '|||' --out $O
bad  backends|paged0                frontier --max-tokens 64 --contexts 32 --configs int4 --backends paged0 --out $O
bad  backends|pagedx                frontier --max-tokens 64 --contexts 32 --configs int4 --backends pagedX --out $O
bad  backends|paged18446744073709551615|block|memory frontier --max-tokens 64 --contexts 32 --configs int4 --backends paged18446744073709551615 --out $O
any  int4-ch16|paged7|skip|block    frontier --max-tokens 64 --contexts 32 --configs int4-ch16 --backends paged7 --out $O
bad  out|proc                       frontier --max-tokens 64 --contexts 32 --configs int4 --out /proc/x/out
# ---- lowrank-report
bad  calib.ctx|windows.of.0         lowrank-report --calib-tokens 64 --calib-ctx 0 --out $O
any  calib.ctx                      lowrank-report --calib-tokens 64 --calib-ctx 1 --out $O
bad  calib.text|null|token          lowrank-report $C --calib-text /dev/null --out $O
bad  calibration|zero|safetensors   lowrank-report $C --calibration /dev/zero --out $O
bad  calibration|cal-trunc|safetensors lowrank-report $C --calibration $W/cal-trunc.st --out $O
bad  out|proc                       lowrank-report $C --out /proc/x/out
bad  out|afile|director             lowrank-report $C --out $W/afile
# ---- calibrate
bad  forms|""|empty                 calibrate $C --forms '' --out $O/c.st
any  int4|calibrat                  calibrate $C --forms int4 --out $O/c.st
bad  pca-r100000|rank               calibrate $C --forms pca-r100000 --out $O/c.st
bad  vq-k100000|centroid            calibrate $C --forms vq-k100000 --out $O/c.st
bad  calib.tokens|token             calibrate --calib-tokens 1 --calib-ctx 32 --out $O/c.st
bad  out|proc                       calibrate $C --out /proc/x/out
bad  out|full|space                 calibrate $C --out /dev/full
bad  calibration|zero               calibrate $C --calibration /dev/zero --out $O/c.st
bad  calibration|gguf|safetensors   calibrate $C --calibration $GG --out $O/c.st
bad  calibration|qwen|model|layer|head ppl --model qwen2.5-0.5b $P --form vq --calibration $W/cal.st
ok   -                              ppl $P --form vq --calibration $W/cal.st
# ---- generate
any  max.new                        generate --prompt hi --max-new 0 --ctx 64
any  max.new|ctx                    generate --prompt hi --max-new 18446744073709551615 --ctx 64
bad  ctx|context                    generate --prompt hi --max-new 4 --ctx 0
any  ctx|memory|budget|context      generate --prompt hi --max-new 4 --ctx 18446744073709551615
bad  ctx|prompt                     generate --prompt 'hello there' --max-new 4 --ctx 1
bad  temperature                    generate --prompt hi --max-new 4 --ctx 64 --temperature -1
bad  top.p                          generate --prompt hi --max-new 4 --ctx 64 --temperature 1 --top-p 0
bad  prompt|empty|token             generate --prompt '' --max-new 4 --ctx 64
bad  prompt|null|empty|token        generate --prompt-file /dev/null --max-new 4 --ctx 64
any  prompt|zero|memory             generate --prompt-file /dev/zero --max-new 4 --ctx 64
bad  prompt|ctx|token|context       generate --prompt-file $W/long-prompt.txt --max-new 4 --ctx 64
bad  prompt|prompt.file             generate --prompt hi --prompt-file $TXT --max-new 4 --ctx 64
bad  block.size                     generate --prompt hi --max-new 4 --ctx 64 --block-size 0
bad  scrub.every                    generate --prompt hi --max-new 4 --ctx 64 --form int4+secded84 --scrub-every 0
bad  ber.per.step                   generate --prompt hi --max-new 4 --ctx 64 --form int4+secded84 --ber-per-step 2
bad  prefill.step                   generate --prompt hi --max-new 4 --ctx 64 --prefill-step 0
bad  speculate|self                 generate --prompt hi --max-new 4 --ctx 64 --speculate self
bad  speculate|k=0                  generate --prompt hi --max-new 4 --ctx 64 --speculate lookup:k=0
bad  k|context                      generate --prompt hi --max-new 4 --ctx 64 --speculate lookup:k=18446744073709551615
bad  speculate|lookup               generate --prompt hi --max-new 4 --ctx 64 --speculate draft:
bad  draft|tokenizer                generate --prompt hi --max-new 4 --ctx 64 --speculate draft:qwen2.5-0.5b
bad  draft|nonexistent|cannot       generate --prompt hi --max-new 4 --ctx 64 --speculate draft:$W/nonexistent.gguf
ok   -                              generate --prompt hi --max-new 8 --ctx 64 --speculate lookup:k=3
bad  dense|plain|backend            generate --prompt hi --max-new 4 --ctx 64 --backend dense --form int4
bad  form|pca-r100000|rank          generate --prompt hi --max-new 4 --ctx 64 $C --form pca-r100000
# ---- batch
bad  requests|empty|no.request      batch --requests $W/rq-empty.jsonl --out $O
bad  requests|no.request            batch --requests $W/rq-blank.jsonl --out $O
bad  requests|line.1                batch --requests $W/rq-nonjson.jsonl --out $O
bad  requests|line.1                batch --requests $W/rq-array.jsonl --out $O
bad  requests|line.1|context        batch --requests $W/rq-maxu64.jsonl --out $O
bad  requests|line.1                batch --requests $W/rq-neg.jsonl --out $O
bad  requests|line.1|context        batch --requests $W/rq-pastctx.jsonl --out $O
bad  requests|line.1|prompt         batch --requests $W/rq-emptyprompt.jsonl --out $O
bad  requests|line.1|arrival        batch --requests $W/rq-arrival.jsonl --out $O
any  -                              batch --requests $W/rq-extreme-sampling.jsonl --out $O
ok   -                              batch --requests $W/rq-maxprio.jsonl --out $O
bad  requests|line.2                batch --requests $W/rq-line2.jsonl --out $O
bad  requests|line.1|context        batch --requests $W/rq-longprompt.jsonl --out $O
bad  requests|line.1|recursion      batch --requests $W/rq-deep.jsonl --out $O
bad  requests|nonexistent           batch --requests $W/nonexistent.jsonl --out $O
any  requests|zero|memory           batch --requests /dev/zero --out $O
bad  requests|workload              batch --requests $W/rq-ok.jsonl --workload --out $O
bad  requests|workload              batch --out $O
bad  blocks                         batch --requests $W/rq-ok.jsonl --blocks 0 --out $O
bad  blocks|memory|budget           batch --requests $W/rq-ok.jsonl --blocks 18446744073709551615 --out $O
bad  blocks|memory|budget           batch --requests $W/rq-ok.jsonl --blocks 100000000 --out $O
bad  host.blocks|memory|budget      batch --requests $W/rq-ok.jsonl --host-blocks 18446744073709551615 --preemption swap --out $O
any  host.blocks                    batch --requests $W/rq-ok.jsonl --host-blocks 0 --preemption swap --out $O
bad  block.size                     batch --requests $W/rq-ok.jsonl --block-size 0 --out $O
bad  block|int4-ch32|16             batch --requests $W/rq-ok.jsonl --form int4-ch32 --block-size 16 --out $O
bad  watermark|nan                  batch --requests $W/rq-ok.jsonl --watermark NaN --out $O
bad  max.running                    batch --requests $W/rq-ok.jsonl --max-running 0 --out $O
bad  num.requests|request           batch --workload --num-requests 0 --out $O
bad  num.requests|memory|budget     batch --workload --num-requests 18446744073709551615 --prompt-len 8,16 --output-len 2,4 --shared-prefixes 1,4 --out $O
bad  arrivals                       batch --workload --num-requests 2 --arrivals-per-step 0 --prompt-len 8,16 --output-len 2,4 --shared-prefixes 1,4 --out $O
bad  prompt.len                     batch --workload --num-requests 2 --prompt-len 16,8 --output-len 2,4 --shared-prefixes 1,4 --out $O
bad  prompt.len|prompt.tokens       batch --workload --num-requests 2 --prompt-len 8,18446744073709551615 --output-len 2,4 --shared-prefixes 1,4 --out $O
bad  output.len|outputs             batch --workload --num-requests 2 --prompt-len 8,16 --output-len 2,18446744073709551615 --shared-prefixes 1,4 --out $O
bad  shared.prefix|prompt           batch --workload --num-requests 2 --prompt-len 8,16 --output-len 2,4 --shared-prefixes 2,100000 --out $O
bad  text|null|token                batch --workload --num-requests 2 --prompt-len 8,16 --output-len 2,4 --shared-prefixes 1,4 --text /dev/null --out $O
# ---- niah
ok   -                              niah --lengths 128 --depths 0.5 --out $O
bad  length                         niah --lengths 0 --depths 0.5 --out $O
bad  length|memory|budget|context   niah --lengths 18446744073709551615 --depths 0.5 --out $O
bad  length|context                 niah --lengths 100000 --depths 0.5 --out $O
bad  depth|nan                      niah --lengths 128 --depths NaN --out $O
bad  digit                          niah --lengths 128 --depths 0.5 --digits 0 --out $O
bad  haystack|null|token            niah --lengths 128 --depths 0.5 --haystack /dev/null --out $O
any  haystack|zero|memory           niah --lengths 128 --depths 0.5 --haystack /dev/zero --out $O
bad  forms|bogus                    niah --lengths 128 --depths 0.5 --forms bogus --out $O
bad  block.size                     niah --lengths 128 --depths 0.5 --block-size 0 --out $O
bad  block|int4-ch32|16             niah --lengths 128 --depths 0.5 --forms int4-ch32 --block-size 16 --out $O
bad  out|proc                       niah --lengths 128 --depths 0.5 --out /proc/x/out
# ---- accumulate
bad  steps                          accumulate --prompt-tokens 16 --steps 0 --forms int4+secded84 --scrub never --out $O
bad  steps|memory|budget|context    accumulate --prompt-tokens 16 --steps 18446744073709551615 --forms int4+secded84 --scrub never --out $O
bad  steps|context                  accumulate --prompt-tokens 16 --steps 100000 --forms int4+secded84 --scrub never --out $O
bad  prompt.tokens                  accumulate --prompt-tokens 0 --steps 4 --forms int4+secded84 --scrub never --out $O
bad  prompt.tokens|context|token    accumulate --prompt-tokens 18446744073709551615 --steps 4 --forms int4+secded84 --scrub never --out $O
bad  scrub                          accumulate --prompt-tokens 16 --steps 4 --forms int4+secded84 --scrub 0 --out $O
bad  ber.per.step                   accumulate --prompt-tokens 16 --steps 4 --forms int4+secded84 --scrub never --ber-per-step 2 --out $O
any  int4-ch|per.token|block        accumulate --prompt-tokens 16 --steps 4 --forms int4-ch --scrub never --out $O
bad  text|null|token                accumulate --prompt-tokens 16 --steps 4 --forms int4+secded84 --scrub never --text /dev/null --out $O
bad  out|proc                       accumulate --prompt-tokens 16 --steps 4 --forms int4+secded84 --scrub never --out /proc/x/out
# ---- adapt
bad  hot                            adapt $P --observe-tokens 32
bad  hot                            adapt $P --observe-tokens 32 --hot-layers 0 --hot-rows 0.1
bad  hot.layers|99|layer            adapt $P --observe-tokens 32 --hot-layers 99
bad  hot.layers|0                   adapt $P --observe-tokens 32 --hot-layers 0,0
bad  hot.blocks                     adapt $P --observe-tokens 32 --hot-blocks 2
any  hot.rows                       adapt $P --observe-tokens 32 --hot-rows 0
bad  block                          adapt $P --observe-tokens 32 --hot-blocks 0.1 --block 0
bad  block|memory                   adapt $P --observe-tokens 32 --hot-blocks 0.1 --block 18446744073709551615
bad  hot.ber                        adapt $P --observe-tokens 32 --hot-layers 0 --hot-ber 2
bad  observe.tokens                 adapt $P --observe-tokens 0 --hot-layers 0
bad  observe.tokens|token           adapt $P --observe-tokens 18446744073709551615 --hot-layers 0
bad  promote.at|demote.at           adapt $P --observe-tokens 32 --hot-layers 0 --promote-at 1e-6 --demote-at 1e-2
bad  base|bogus                     adapt $P --observe-tokens 32 --hot-layers 0 --base bogus
bad  base|secded|code               adapt $P --observe-tokens 32 --hot-layers 0 --base int4+secded84
bad  json|proc                      adapt $P --observe-tokens 32 --hot-layers 0 --json /proc/x/out
# ---- shard-stream
bad  prompts|token                  shard-stream --max-tokens 256 --prompts 18446744073709551615 --prefix 32 --new-tokens 4 --checkpoints 4
bad  prefix|0.tokens                shard-stream --max-tokens 256 --prompts 1 --prefix 0 --new-tokens 4 --checkpoints 4
bad  prefix|token|context           shard-stream --max-tokens 256 --prompts 1 --prefix 18446744073709551615 --new-tokens 4 --checkpoints 4
bad  new.tokens                     shard-stream --max-tokens 256 --prompts 1 --prefix 32 --new-tokens 0 --checkpoints 4
bad  new.tokens|context|memory      shard-stream --max-tokens 256 --prompts 1 --prefix 32 --new-tokens 18446744073709551615 --checkpoints 4
bad  checkpoint|999                 shard-stream --max-tokens 256 --prompts 1 --prefix 32 --new-tokens 4 --checkpoints 999
bad  form|int4|shard                shard-stream --max-tokens 256 --prompts 1 --prefix 32 --new-tokens 4 --checkpoints 4 --form int4
bad  fold                           shard-stream --max-tokens 256 --prompts 1 --prefix 32 --new-tokens 4 --checkpoints 4 --fold 0
any  fold                           shard-stream --max-tokens 256 --prompts 1 --prefix 32 --new-tokens 4 --checkpoints 4 --fold 18446744073709551615
bad  json|proc                      shard-stream --max-tokens 256 --prompts 1 --prefix 32 --new-tokens 4 --checkpoints 4 --json /proc/x/out
# ---- top
bad  k|0                            top -k 0
any  k|vocab                        top -k 18446744073709551615
bad  k|-1                           top -k -1
bad  prompt|empty|token             top --prompt ''
bad  prompt|context|token           top --prompt "$(cat $W/long-prompt.txt)"
ok   -                              top --model qwen2.5-0.5b -k 2
EOF
)

# ----------------------------------------------------- running and judging
TSV=$OUT/results.tsv
if [[ -n $ONLY && -f $TSV ]]; then
    awk -F'\t' -v re="$ONLY" 'NR > 1 && $1 !~ re' "$TSV" > "$W/kept.tsv"
fi
printf 'id\tcommand\tlabel\texpect\texit\tclass\tseconds\tpeak_rss_kb\tsuspicious\tfirst_stderr_line\tmessage\n' > "$TSV"

# The error line of a run's stderr: the first line starting with "error",
# else the last non-empty line.
message_of() {
    local m
    m=$(grep -m1 -A1 -iE '^(error|thread .* panicked|memory allocation)' "$1")
    if [[ -n $m ]]; then
        # Keep the second line only where the first ends with ':' (clap
        # names the missing argument there; a panic gives its reason there).
        if [[ ${m%%$'\n'*} == *: ]]; then m=${m//$'\n'/ }; else m=${m%%$'\n'*}; fi
    else
        m=$(grep -v '^[[:space:]]*$' "$1" | tail -n1)
    fi
    printf '%s' "$m" | tr '\t\r' '  ' | tr -s ' ' | cut -c1-400
}

# Why a clean error's message is unhelpful ("" when it is fine).
suspicion_of() {
    local msg=$1 needle=$2 why=()
    local body=${msg#error: }
    if grep -qE '[A-Za-z_][A-Za-z0-9_]* \{ |Some\(|Err\(|Ok\(|\bOs \{' <<<"$body"; then
        why+=("debug-dump")
    fi
    (( ${#body} < 16 )) && why+=("short")
    if [[ $needle != - ]] && ! grep -qiE -- "$needle" <<<"$msg"; then
        why+=("does-not-name-input")
    fi
    (IFS=,; printf '%s' "${why[*]}")
}

# run_case ID EXPECT NEEDLE ARGS...: runs one case and appends its row.
run_case() {
    local id=$1 expect=$2 needle=$3; shift 3
    local err=$OUT/logs/$id.err out=$OUT/logs/$id.out rss=$OUT/logs/$id.rss
    local label=global
    case " $COMMANDS " in *" $1 "*) label=$1 ;; esac
    local shown
    shown=$(printf '%q ' "$@"); shown="kv-eval ${shown% }"; shown=${shown//$W/\$W}
    shown=$(printf '%s' "$shown" | cut -c1-300)
    local t0 t1 rc
    t0=$(date +%s.%N)
    if [[ -n $TIMEBIN ]]; then
        ( ulimit -v "$VMEM_KB"; exec "$TIMEBIN" -o "$rss" -f %M timeout -k 5 "$TIMEOUT" "$KV" "$@" ) \
            >"$out" 2>"$err" </dev/null
    else
        ( ulimit -v "$VMEM_KB"; exec timeout -k 5 "$TIMEOUT" "$KV" "$@" ) >"$out" 2>"$err" </dev/null
    fi
    rc=$?
    t1=$(date +%s.%N)
    local secs peak="" first msg class suspicious=""
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    # GNU time writes "Command exited/terminated ..." before the number.
    [[ -f $rss ]] && peak=$(grep -E '^[0-9]+$' "$rss" | tail -n1)
    first=$(head -n1 "$err" | tr '\t\r' '  ' | cut -c1-300)
    msg=$(message_of "$err")
    if (( rc == 101 )) || grep -q 'panicked at' "$err"; then
        class=panic
    elif (( rc == 124 || rc == 137 )); then
        class=timeout
    elif (( rc >= 128 )) || grep -qE 'memory allocation of|Aborted' "$err"; then
        class=abort
    elif (( rc == 0 )); then
        if [[ $expect == bad ]]; then class=exit0-on-bad-input; else class=ok; fi
    elif [[ $expect == ok ]]; then
        class=error-on-valid
    else
        class=clean-error
    fi
    if [[ $class == clean-error || $class == error-on-valid ]]; then
        suspicious=$(suspicion_of "$msg" "$needle")
    fi
    if [[ $expect != ok && -n $peak ]] && (( peak > RSS_FLAG_KB )); then
        suspicious=${suspicious:+$suspicious,}rss-$((peak / 1024))MiB
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$shown" "$label" "$expect" \
        "$rc" "$class" "$secs" "$peak" "$suspicious" "$first" "$msg" >> "$TSV"
    printf '%-5s %-20s %6ss rc=%-3s %s\n' "$id" "$class${suspicious:+ ($suspicious)}" "$secs" "$rc" "$shown"
}

setup
n=0
while IFS= read -r line; do
    [[ -z ${line// } || $line == \#* ]] && continue
    n=$((n + 1))
    id=$(printf 'c%03d' "$n")
    [[ -n $ONLY && ! $id =~ $ONLY ]] && continue
    read -r expect needle rest <<<"$line"
    O=$W/out/$id
    eval "args=($rest)"
    run_case "$id" "$expect" "$needle" "${args[@]}"
done <<<"$CASES"

if [[ -f $W/kept.tsv ]]; then          # a partial rerun: merge the kept rows
    { head -n1 "$TSV"; { tail -n +2 "$TSV"; cat "$W/kept.tsv"; } | sort; } > "$W/merged.tsv"
    cp "$W/merged.tsv" "$TSV"
fi

# ---------------------------------------------------------------- summary
python3 - "$TSV" "$OUT/summary.md" "$TIMEOUT" "$VMEM_KB" <<'PY'
import csv, sys, collections
tsv, md, timeout, vmem = sys.argv[1:]
rows = list(csv.DictReader(open(tsv), delimiter='\t', quoting=csv.QUOTE_NONE))
classes = ['panic', 'abort', 'timeout', 'exit0-on-bad-input', 'error-on-valid', 'clean-error', 'ok']
labels = []
for r in rows:
    if r['label'] not in labels: labels.append(r['label'])
count = collections.Counter((r['label'], r['class']) for r in rows)
out = ['# kv-eval hostile-input probe', '',
       f'{len(rows)} invocations, each under `timeout {timeout}` and `ulimit -v {vmem}` (KiB). '
       'Written by `scripts/hostile-probe.sh` (not run by CI); every row is in `results.tsv`, '
       'stdout and stderr of each case in `logs/`.', '',
       '| command | ' + ' | '.join(classes) + ' | suspicious messages |',
       '|---|' + '---|' * (len(classes) + 1)]
for l in labels + ['**all**']:
    sel = rows if l == '**all**' else [r for r in rows if r['label'] == l]
    cells = [str(sum(1 for r in sel if r['class'] == c)) for c in classes]
    cells.append(str(sum(1 for r in sel if r['suspicious'])))
    out.append(f'| {l} | ' + ' | '.join(cells) + ' |')
def item(r, extra=''):
    msg = r['message'] or r['first_stderr_line'] or '(no stderr)'
    return f"- `{r['id']}` exit {r['exit']}{extra}: `{r['command']}`\n  - {msg}"
for c in classes[:5]:
    sel = [r for r in rows if r['class'] == c]
    out += ['', f'## {c} ({len(sel)})', '']
    out += [item(r) for r in sel] or ['none']
sel = [r for r in rows if r['suspicious']]
out += ['', f'## suspicious messages ({len(sel)})', '']
out += [item(r, f" [{r['suspicious']}]") for r in sel] or ['none']
open(md, 'w').write('\n'.join(out) + '\n')
print('\n'.join(out[:len(labels) + 8]))
PY
echo "results: $TSV and $OUT/summary.md"

