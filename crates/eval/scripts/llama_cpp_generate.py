"""llama.cpp's greedy generation speed on the same GGUF, threads and contexts
as `kv-eval generate --prompt-file F --prompt-tokens N`: the prompt's first
N tokens are evaluated, then NEW tokens are generated greedily one at a
time; prints decode tokens/s (the prompt excluded).

pip install llama-cpp-python==0.3.36
python3 llama_cpp_generate.py MODEL.gguf TEXT N [NEW] [THREADS]
"""

import sys
import time

from llama_cpp import Llama


def main():
    model, text = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3])
    new = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    threads = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    llm = Llama(
        model_path=model,
        n_ctx=n + new + 8,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )
    ids = llm.tokenize(open(text, encoding="utf-8").read().encode("utf-8"))[:n]
    start = time.perf_counter()
    first = None
    produced = 0
    for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        produced += 1
        if produced == 1:
            first = time.perf_counter()
        if produced == new:
            break
    end = time.perf_counter()
    print(
        f"llama.cpp: prompt {len(ids)} tokens in {first - start:.2f} s; "
        f"{produced} new tokens, {(produced - 1) / (end - first):.2f} tokens/s"
    )


if __name__ == "__main__":
    main()
