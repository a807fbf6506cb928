"""PyTorch peer of examples/gpu_bench.rs: decode attention with
torch.nn.functional.scaled_dot_product_attention on f16 at Llama-3-8B's head
shape (32 query heads, 8 KV heads, head_dim 128), contiguous K/V, the same
contexts and batches; median of CUDA-event-timed repeats after a warm-up.

    python3 crates/gpu-kernels/bench/sdpa_peer.py [--quick]
"""
import sys

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS, HD = 32, 8, 128


def median_ms(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[reps // 2]


def main():
    quick = "--quick" in sys.argv
    contexts = [4096, 32768] if quick else [4096, 16384, 65536, 131072]
    batches = [1, 16] if quick else [1, 8, 32, 64]
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| peer | context | batch | time (ms) | per token (µs) | GB/s |")
    print("|---|---|---|---|---|---|")
    for ctx in contexts:
        for batch in batches:
            try:
                q = torch.randn(batch, Q_HEADS, 1, HD, device="cuda", dtype=torch.float16)
                k = torch.randn(batch, KV_HEADS, ctx, HD, device="cuda", dtype=torch.float16)
                v = torch.randn_like(k)
            except torch.cuda.OutOfMemoryError:
                print(f"| sdpa-f16 | {ctx} | {batch} | out of memory | | |")
                continue
            ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            moved = 2 * k.numel() * 2
            print(f"| sdpa-f16 | {ctx} | {batch} | {ms:.3f} | {ms * 1e3 / batch:.3f} | {moved / ms / 1e6:.0f} |")
            del q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
