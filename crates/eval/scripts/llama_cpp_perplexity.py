"""Perplexity of a GGUF model on a text by llama.cpp, with the method of
`llama-perplexity`: the text tokenized whole (no BOS), cut into chunks of
n_ctx tokens (BOS in place of each chunk's first token when the model asks
for one), each chunk evaluated alone, and the second half of each chunk
scored. The reference behind kv-eval's clean-perplexity tests.

    pip install llama-cpp-python==0.3.36 numpy
    python3 crates/eval/scripts/llama_cpp_perplexity.py MODEL.gguf TEXT [N_CTX] [THREADS] [MAX_CHUNKS]

MAX_CHUNKS scores only the first chunks (`kv-eval ppl --max-tokens
MAX_CHUNKS·N_CTX` scores the same ones).
"""

import math
import sys
import time

import llama_cpp
import numpy as np


def main() -> None:
    model, text = sys.argv[1], sys.argv[2]
    n_ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        logits_all=True,
        n_threads=threads,
        verbose=False,
    )
    with open(text, "rb") as f:
        ids = llm.tokenize(f.read(), add_bos=False, special=False)
    add_bos = llm._model.add_bos_token()
    bos = llm.token_bos()
    chunks = len(ids) // n_ctx
    if len(sys.argv) > 5:
        chunks = min(chunks, int(sys.argv[5]))
    first = n_ctx // 2
    nll, count = 0.0, 0
    start = time.time()
    for c in range(chunks):
        chunk = ids[c * n_ctx : (c + 1) * n_ctx]
        inp = [bos] + chunk[1:] if add_bos else chunk
        llm.reset()
        llm.eval(inp)
        logits = np.array(llm.scores[:n_ctx], dtype=np.float64)
        for j in range(first, n_ctx - 1):
            row = logits[j]
            m = row.max()
            lse = m + math.log(np.exp(row - m).sum())
            nll += lse - row[chunk[j + 1]]
            count += 1
        if (c + 1) % 20 == 0:
            print(f"[{c + 1}/{chunks}] ppl {math.exp(nll / count):.4f}", file=sys.stderr)
    secs = time.time() - start
    print(f"tokens {len(ids)} chunks {chunks} scored {count} ppl {math.exp(nll / count):.4f} "
          f"({chunks * n_ctx / secs:.1f} tokens/s)")


if __name__ == "__main__":
    main()
