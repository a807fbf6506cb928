"""Token ids of a text by llama.cpp's own tokenizer, and their SHA-256.

The reference behind kv-eval's tokenizer test: llama-cpp-python (PyPI,
built from source) loads only the vocabulary of the GGUF, tokenizes the
text without BOS, and prints the count and the SHA-256 of the ids as
little-endian u32.

    pip install llama-cpp-python==0.3.36
    python3 crates/eval/scripts/llama_cpp_ids.py MODEL.gguf TEXT [TEXT2 ...]
"""

import hashlib
import struct
import sys

import llama_cpp


def main() -> None:
    model, texts = sys.argv[1], sys.argv[2:]
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    for path in texts:
        with open(path, "rb") as f:
            data = f.read()
        ids = llm.tokenize(data, add_bos=False, special=False)
        digest = hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()
        print(f"{path}\t{len(ids)}\t{digest}\t{ids[:8]}")


if __name__ == "__main__":
    main()
