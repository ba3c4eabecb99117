"""contract: GGUF models run from their quantized weights, held to Hugging Face transformers
reading the same GGUF file (``gguf_file=``, which dequantizes it to float32).

Each block type gets a tiny random Llama written as a GGUF file (tests/gguf_models.py); our
runner keeps its matrices quantized (dtype auto on a CPU with the kernels) or dequantizes
them (``--dtype float32``); both must give transformers' greedy tokens, with vLLM's top-5
rule where float32 sums in another order part a near-tie. Bad files fail at conversion with
the file and the tensor named, and leave nothing in the cache.
"""

from __future__ import annotations

import attrs
import gguf
import numpy as np
import pytest
import torch

from tests.driver import Driver
from tests.gguf_models import tiny_quantizable_llama, write_tiny_gguf
from tests.hf_compare import (
    TINY_MODEL_TEXTS,
    assert_close_to_hf,
    assert_matches_hf,
    greedy_params,
    hf_greedy,
    make_driver,
    ours_greedy,
)
from tests.tiny_models import train_tokenizer
from triode.engine.config import EngineArgs
from triode.engine.errors import ModelLoadError, UnsupportedModelError
from triode.engine.model_files.resolve import resolve_model
from triode.engine.worker.checkpoint import iter_safetensors, quantized_tensors
from triode.engine.worker.runner import ModelRunner
from triode.kernels.quant_linear import (
    QuantizedWeight,
    interleaved_kernels_available,
    quantized_activations,
    quantized_kernels_available,
    set_quantized_activations,
)

pytestmark = pytest.mark.skipif(not quantized_kernels_available(), reason="no AVX2 or no C compiler")

KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_model(tiny_tokenizer):
    return tiny_quantizable_llama(tiny_tokenizer)


@pytest.fixture(scope="module", params=KINDS)
def quantized_gguf(request, tmp_path_factory, tiny_model, tiny_tokenizer):
    """(the GGUF file in a directory of its own, the converted cache entry)."""
    directory = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = directory / f"tiny.{request.param}.gguf"
    write_tiny_gguf(path, tiny_model, tiny_tokenizer, request.param)
    entry = resolve_model(str(path), cache_dir=str(directory / "cache"), progress=False).path
    return request.param, path, entry


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(text) for text in TINY_MODEL_TEXTS]


def test_conversion_keeps_the_blocks(quantized_gguf):
    kind, path, entry = quantized_gguf
    kinds = quantized_tensors(entry)
    # Every matrix (the embedding and the LM head included) stays in the file's blocks.
    assert len(kinds) == 2 + 2 * 7 and set(kinds.values()) == {kind}
    reader = gguf.GGUFReader(path)
    tensors = dict(iter_safetensors(entry))
    original = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, QuantizedWeight) and down.kind == kind
    assert np.array_equal(down.data.numpy(), np.asarray(original.data))
    assert tensors["model.norm.weight"].dtype == torch.float32


def test_quantized_and_dequantized_runs_match_hf_on_the_same_file(quantized_gguf, prompts):
    kind, path, entry = quantized_gguf
    reference = hf_greedy(path.parent, prompts, MAX_TOKENS)
    driver = make_driver(entry)
    assert driver.runner.quantized, "dtype auto on this CPU keeps the blocks"
    quantized = driver.generate(prompts, greedy_params(MAX_TOKENS))
    assert_close_to_hf(quantized, reference, logprob_atol=2e-3)
    dequantized = ours_greedy(entry, prompts, MAX_TOKENS, dtype="float32")
    assert_close_to_hf(dequantized, reference, logprob_atol=2e-3)
    agree = sum(a == b for (ours, _), (hf, _) in zip(quantized, reference, strict=True)
                for a, b in zip(ours, hf, strict=True))
    assert agree >= 0.9 * MAX_TOKENS * len(prompts), f"{kind}: only {agree} tokens agree"


@pytest.mark.parametrize(("activations", "logprob_atol"), [
    ("int8", 0.25),
    pytest.param("int16", 2e-3, marks=pytest.mark.skipif(not interleaved_kernels_available(),
                                                          reason="this CPU has no interleaved kernels (AVX2 and a C compiler)")),
])
def test_integer_activations_follow_hf_within_the_top5_rule(quantized_gguf, prompts, activations, logprob_atol):
    """--quantized-activations int8 (llama.cpp's arithmetic): the tokens hold to HF reading
    the same file by vLLM's rule, logprobs within 0.25 (measured at most 0.12, on the K
    types, whose activations share one scale per 256); int16 (15-bit, on interleaved weights)
    as close as float32 activations are held to."""
    _, path, entry = quantized_gguf
    reference = hf_greedy(path.parent, prompts, MAX_TOKENS)
    args = EngineArgs(model=str(entry), kv_cache_memory=64 << 20, max_model_len=512,
                      quantized_activations=activations)
    try:
        driver = Driver(ModelRunner(args, entry))
        assert quantized_activations() == activations
        assert_close_to_hf(driver.generate(prompts, greedy_params(MAX_TOKENS)), reference,
                           logprob_atol=logprob_atol)
    finally:
        set_quantized_activations("float32")


def test_an_unknown_architecture_fails_naming_the_file(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"other\.gguf: GGUF architecture 'gpt2' is not supported"):
        resolve_model(str(path), cache_dir=str(tmp_path / "cache"), progress=False)


def test_a_tensor_whose_size_disagrees_with_the_header_names_it(tmp_path, tiny_model, tiny_tokenizer):
    """A file whose feed-forward length says 512 but whose gate matrix has other rows."""
    path = tmp_path / "inconsistent.gguf"
    wrong = tiny_quantizable_llama(tiny_tokenizer)
    layer = wrong.model.layers[1].mlp
    layer.gate_proj.weight = torch.nn.Parameter(layer.gate_proj.weight[:256].clone())
    write_tiny_gguf(path, wrong, tiny_tokenizer, "Q8_0")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=r"inconsistent\.gguf: tensor blk\.1\.ffn_gate\.weight has "
                                             r"shape \[256, 256\], but the file's header says \[512, 256\]"):
        resolve_model(str(path), cache_dir=str(cache), progress=False)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_unkept_types_are_dequantized_and_logged(tmp_path, tiny_model, tiny_tokenizer, caplog):
    """Q5_0 has no kernel here: its matrices arrive as float32, and the log says so."""
    path = tmp_path / "tiny.Q5_0.gguf"
    write_tiny_gguf(path, tiny_model, tiny_tokenizer, "Q5_0")
    with caplog.at_level("WARNING", logger="triode.engine.model_files.gguf_convert"):
        entry = resolve_model(str(path), cache_dir=str(tmp_path / "cache"), progress=False).path
    assert "dequantized to float32: token_embd.weight (Q5_0)" in caplog.text
    assert quantized_tensors(entry) == {}
    assert dict(iter_safetensors(entry))["model.embed_tokens.weight"].dtype == torch.float32


def test_a_type_nothing_reads_is_refused_naming_the_tensor(tmp_path, tiny_model, tiny_tokenizer):
    """I8: the gguf package's dequantize raised NotImplementedError out of the conversion."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model, tiny_tokenizer, "Q8_0", kinds={"ffn_up": "I8"})
    with pytest.raises(UnsupportedModelError, match=r"tiny\.gguf: tensor blk\.0\.ffn_up\.weight is of block "
                                                    r"type I8, which neither triode's kernels nor"):
        resolve_model(str(path), cache_dir=str(tmp_path / "cache"), progress=False)


def test_a_bfloat16_run_dequantizes(tmp_path, tiny_model, tiny_tokenizer):
    path = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, tiny_model, tiny_tokenizer, "Q8_0")
    entry = resolve_model(str(path), cache_dir=str(tmp_path / "cache"), progress=False).path
    driver = make_driver(entry, dtype="bfloat16")
    assert driver.runner.quantized == {}
    assert driver.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


def _written_and_converted(tmp_path, source, tokenizer, kind: str):
    """(source, cache entry): the Hugging Face model at ``source`` written as a GGUF file the
    way llama.cpp writes it, every matrix in ``kind``, and converted into the cache."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny.{kind}.gguf"
    write_tiny_gguf(path, AutoModelForCausalLM.from_pretrained(source), tokenizer, kind)
    return source, resolve_model(str(path), cache_dir=str(tmp_path / "cache"), progress=False).path


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])
def test_gemma_gguf_files_read_as_llama_cpp_writes_them(tmp_path, tiny_model_factory, tiny_tokenizer, prompts,
                                                         architecture, kind):
    """llama.cpp's Gemma conventions: norms stored as 1 + w, q/k rows as they are, Gemma 2's
    soft caps and Gemma 3's linear rope scaling in the metadata, the query scale from the head
    size. An F32 file generates as transformers does on the model it was written from; a Q8_0
    file, its blocks kept quantized, follows that by vLLM's rule."""
    head_dim = 16 if architecture == "gemma2" else 32
    overrides = {"query_pre_attn_scalar": head_dim}
    if architecture == "gemma3":
        overrides |= {"num_hidden_layers": 6, "layer_types": None}  # llama.cpp's five local, one global
    source, entry = _written_and_converted(tmp_path, tiny_model_factory(architecture, **overrides),
                                           tiny_tokenizer, kind)
    reference = hf_greedy(source, prompts, MAX_TOKENS)
    if kind == "F32":
        assert_matches_hf(ours_greedy(entry, prompts, MAX_TOKENS), reference)
        return
    driver = make_driver(entry)
    assert driver.runner.quantized
    assert_close_to_hf(driver.generate(prompts, greedy_params(MAX_TOKENS)), reference, logprob_atol=0.1)


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_phi3_gguf_files_keep_their_fused_tensors_window_and_longrope(tmp_path, tiny_model_factory,
                                                                      tiny_tokenizer, prompts, kind):
    """llama.cpp's Phi-3: fused attn_qkv and ffn_up (gate and up), the longrope factors as
    tensors, the window and the pretraining length in the metadata (transformers reads none of
    these three from a GGUF file), and the rotated share of each head. The F32 file, with a
    pretraining length the prompts cross (where transformers recomputes with the long factors,
    triode not), generates as triode does on the source model; the Q8_0 file, its blocks kept,
    follows transformers by vLLM's rule."""
    source = tiny_model_factory("phi3")
    if kind == "F32":  # and Phi-4-mini's partial rotary: rope.dimension_count, which transformers skips
        half = [1.0 + 0.1 * i for i in range(6)]
        source = tiny_model_factory("phi3", original_max_position_embeddings=20, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": half, "long_factor": [2 * f for f in half]})
    source, entry = _written_and_converted(tmp_path, source, tiny_tokenizer, kind)
    fused = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"}
    assert fused <= set(quantized_tensors(entry)) if kind == "Q8_0" else not quantized_tensors(entry)
    if kind == "F32":
        converted = ours_greedy(entry, prompts, MAX_TOKENS)
        reference = ours_greedy(source, prompts, MAX_TOKENS)
        assert [tokens for tokens, _ in converted] == [tokens for tokens, _ in reference]
        for (_, ours), (_, theirs) in zip(converted, reference, strict=True):
            assert max(abs(a.logprob - b.logprob) for a, b in zip(ours, theirs, strict=True)) < 1e-4
        return
    driver = make_driver(entry)
    assert driver.runner.quantized
    assert_close_to_hf(driver.generate(prompts, greedy_params(MAX_TOKENS)), hf_greedy(source, prompts, MAX_TOKENS),
                       logprob_atol=0.1)


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_moe_gguf_files_keep_their_experts_quantized(tmp_path, tiny_model_factory, tiny_tokenizer, prompts,
                                                     architecture, kind):
    """llama.cpp's Qwen3-MoE, and its Mixtral (a llama file with experts, which transformers
    reads as a dense Llama): every layer's experts stacked in one tensor per projection, cut
    per expert at conversion; Qwen3-MoE's experts' size from the metadata. An F32 file generates as transformers on the source model; Q8_0 experts stay in their
    blocks (each expert's gate and up run as one weight) and generate as the same file
    dequantized (against the float source, the blocks' rounding flips this tiny model's
    routing within a few tokens)."""
    overrides = {"mlp_only_layers": [], "moe_intermediate_size": 32} if architecture == "qwen3_moe" else {
        "intermediate_size": 64}
    source, entry = _written_and_converted(tmp_path, tiny_model_factory(architecture, **overrides),
                                           tiny_tokenizer, kind)
    reference = hf_greedy(source, prompts, MAX_TOKENS)
    if kind == "F32":
        assert_matches_hf(ours_greedy(entry, prompts, MAX_TOKENS), reference)
        return
    driver = make_driver(entry)
    moe = driver.runner.model.layers[0].mlp
    assert moe.quantized is not None and len(moe.quantized[0]) == 2, "gate and up joined, down apart"
    kept = driver.generate(prompts, greedy_params(MAX_TOKENS))
    dequantized = ours_greedy(entry, prompts, MAX_TOKENS, dtype="float32")
    assert [tokens for tokens, _ in kept] == [tokens for tokens, _ in dequantized]
    for (_, ours), (_, theirs) in zip(kept, dequantized, strict=True):
        assert max(abs(a.logprob - b.logprob) for a, b in zip(ours, theirs, strict=True)) < 2e-3



@pytest.mark.skipif(not interleaved_kernels_available(), reason="this CPU has no interleaved kernels (AVX2 and a C compiler)")
def test_batch_invariant_int8_is_refused_where_a_matrix_keeps_gguf_layout(tmp_path, kernel_settings):
    """A vocabulary of 405 rows does not interleave 16 at a time, so the LM head stays in GGUF's
    layout, where int8 activations run a loop that is not batch invariant: refused at load,
    naming it, rather than failing the first step. int16 activations run that matrix through
    the invariant float32 loop."""
    tokenizer = train_tokenizer(405)
    path = tmp_path / "tiny.Q4_0.gguf"
    write_tiny_gguf(path, tiny_quantizable_llama(tokenizer), tokenizer, "Q4_0")
    entry = resolve_model(str(path), cache_dir=str(tmp_path / "cache"), progress=False).path
    args = EngineArgs(model=str(entry), kv_cache_memory=64 << 20, max_model_len=512, batch_invariant=True,
                      quantized_activations="int8")
    with pytest.raises(ModelLoadError, match=r"int8 activations over weights in GGUF's layout have no invariant "
                                             r"kernel, and 1 of this model's 9 quantized matrices stay in it "
                                             r"\(Q4_0 \[405, 256\]\)"):
        ModelRunner(args, entry)
    driver = Driver(ModelRunner(attrs.evolve(args, quantized_activations="int16"), entry))
    assert [part.interleaved for part in driver.runner.model.lm_head.parts] == [False]
    prompts = [tokenizer.encode(text) for text in TINY_MODEL_TEXTS]
    together = driver.generate(prompts, greedy_params(8), name="together")
    assert len(together) == len(prompts) >= 4
    assert driver.generate(prompts[:1], greedy_params(8), name="alone") == together[:1]


def test_batch_invariant_int8_is_refused_for_quantized_experts(tmp_path, tiny_model_factory, tiny_tokenizer,
                                                               kernel_settings):
    """A mixture's quantized experts stay in GGUF's layout (each runs over its own tokens), so
    int8 activations cannot be batch invariant there either."""
    _, entry = _written_and_converted(tmp_path, tiny_model_factory("mixtral", intermediate_size=64),
                                      tiny_tokenizer, "Q8_0")
    args = EngineArgs(model=str(entry), kv_cache_memory=64 << 20, max_model_len=512, batch_invariant=True,
                      quantized_activations="int8")
    with pytest.raises(ModelLoadError, match=r"--batch-invariant cannot be honoured: .* Q8_0 \[128, 64\]"):
        ModelRunner(args, entry)
