"""unit: the pieces of ``triode bench serve --peer llama.cpp`` and ``triode bench write-gguf``
that run without llama.cpp: random blocks that dequantize to sane weights, llama.cpp's
Q4_K_M recipe, the bytes a decode step reads, and the logit bias standing in for
``ignore_eos``. (The peer itself is built and run only by the benchmark, never here.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from tests.gguf_models import tiny_quantizable_llama, write_tiny_gguf
from triode.bench.peer import decode_weight_bytes, no_eos_bias
from triode.bench.synthetic_gguf import SHAPES, random_blocks, tensor_kinds


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q4_0", "Q8_0"])
def test_random_blocks_are_small_centred_weights(kind):
    blocks = random_blocks(kind, 64, 512, np.random.default_rng(0))
    weights = dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(64, 512)
    assert np.isfinite(weights).all()
    assert np.abs(weights).max() <= 0.021
    assert abs(weights.mean()) < 0.002 and weights.std() > 0.004


def test_q4_k_m_follows_llama_cpps_recipe():
    kinds = tensor_kinds(SHAPES["llama-3.1-8b"], "Q4_K_M")
    assert kinds["output.weight"] == "Q6_K" and kinds["token_embd.weight"] == "Q4_K"
    more_bits = sorted(int(name.split(".")[1]) for name, kind in kinds.items()
                       if kind == "Q6_K" and name.endswith("ffn_down.weight"))
    assert more_bits == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert {kinds[f"blk.{i}.attn_v.weight"] for i in more_bits} == {"Q6_K"}
    assert kinds["blk.4.attn_v.weight"] == kinds["blk.4.attn_q.weight"] == "Q4_K"
    assert len(kinds) == 2 + 32 * 7


def test_decode_weight_bytes_and_the_eos_bias(tmp_path, tiny_tokenizer):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_quantizable_llama(tiny_tokenizer), tiny_tokenizer, "Q8_0")
    tensors = gguf.GGUFReader(path).tensors
    embedding = next(t for t in tensors if t.name == "token_embd.weight")
    assert decode_weight_bytes(path) == sum(int(t.n_bytes) for t in tensors) - int(embedding.n_bytes)
    assert no_eos_bias(path) == {"logit_bias": {str(tiny_tokenizer.eos_token_id): -100}}


def test_write_gguf_refuses_a_path_that_is_not_a_gguf_file(tmp_path):
    import argparse

    from triode.bench.synthetic_gguf import command

    target = tmp_path / "new" / "model.bin"
    with pytest.raises(SystemExit, match=r"writes a \.gguf file"):
        command(argparse.Namespace(path=str(target), shape="smollm2-135m", file_type="Q8_0", seed=0))
    assert not target.parent.exists()


def test_the_peer_is_built_without_amx_where_the_cpu_reports_it(tmp_path):
    """llama.cpp's AMX matmul died of a general protection fault on such a CPU here."""
    from triode.bench.peer import llama_cpp_build_flags

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags : fpu avx2 avx512f avx512_vnni amx_tile amx_int8\n")
    assert "-mno-amx-int8" in llama_cpp_build_flags(cpuinfo)
    cpuinfo.write_text("flags : fpu avx2 avx512f avx512_vnni\n")
    assert llama_cpp_build_flags(cpuinfo) == ""
    assert llama_cpp_build_flags(tmp_path / "missing") == ""
