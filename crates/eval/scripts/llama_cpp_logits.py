"""Token ids and logits of a text by llama.cpp: the reference behind
kv-eval's tiny-Qwen2 test (tests/qwen2.rs).

llama-cpp-python loads the GGUF with an f32 KV cache, tokenizes the text
without BOS and without parsing special tokens, evaluates all tokens in one
batch and writes the logits of every eighth position (positions 7, 15, 23,
... and the last; positions × n_vocab, f32 little-endian) to OUT; it prints
the ids, the SHA-256 of the GGUF and the largest |logit|.

    pip install llama-cpp-python==0.3.36 numpy
    python3 crates/eval/scripts/llama_cpp_logits.py MODEL.gguf OUT.bin TEXT
"""

import hashlib
import sys

import llama_cpp
import numpy as np


def main() -> None:
    model, out, text = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(model, "rb") as f:
        print("sha256", hashlib.sha256(f.read()).hexdigest())
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=256,
        n_batch=256,
        logits_all=True,
        n_threads=1,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        verbose=False,
    )
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    print("ids", ids)
    llm.eval(ids)
    positions = sorted(set(range(7, len(ids), 8)) | {len(ids) - 1})
    logits = np.array([llm.scores[p] for p in positions], dtype=np.float32)
    logits.astype("<f4").tofile(out)
    print("positions", positions, "vocab", logits.shape[1], "max |logit|", float(np.abs(logits).max()))


if __name__ == "__main__":
    main()
