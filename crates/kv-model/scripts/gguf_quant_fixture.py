"""Writes tests/data/gguf_quants.gguf: blocks of every GGUF type kv-model
dequantises beyond the originals, with the values the `gguf` package (PyPI,
from the llama.cpp project) dequantises them to.

For each type `T` the file holds a tensor `T` of random blocks (random code
bytes; the f16 scale fields random finite values of both signs, normal and
subnormal) and an F32 tensor `T.expected` of `gguf.quants.dequantize` of
those bytes. `tests/gguf_kquants.rs` compares kv-model's dequantisation with
`T.expected` bit for bit. Q8_K has no NumPy dequantiser in the package and
is checked by a unit test instead.

    pip install gguf==0.19.0 numpy
    python3 crates/kv-model/scripts/gguf_quant_fixture.py crates/kv-model/tests/data/gguf_quants.gguf
"""

import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

# Byte offsets of the f16 scale fields inside each block.
F16_FIELDS = {
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
BLOCKS = {T.Q5_0: 8, T.Q5_1: 8, T.Q2_K: 2, T.Q3_K: 2, T.Q4_K: 2, T.Q5_K: 2, T.Q6_K: 2}


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    exp = rng.uniform(-26, 2, n)  # from subnormal (2^-24 and below) to 4
    sign = rng.choice([-1.0, 1.0], n)
    return (sign * np.exp2(exp)).astype(np.float16)


def main() -> None:
    rng = np.random.default_rng(20261123)
    w = GGUFWriter(sys.argv[1], "fixture")
    for ty, n_blocks in BLOCKS.items():
        block_elems, block_bytes = GGML_QUANT_SIZES[ty]
        blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
        for off in F16_FIELDS[ty]:
            blocks[:, off : off + 2] = random_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        # Each row is one block: the raw shape counts bytes per row.
        expected = dequantize(blocks, ty).reshape(n_blocks, block_elems).astype(np.float32)
        w.add_tensor(ty.name, blocks, raw_shape=blocks.shape, raw_dtype=ty)
        w.add_tensor(ty.name + ".expected", expected)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
