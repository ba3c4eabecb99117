"""Unit tests: the model resolver (triode.engine.model_files.resolve), checkpoint reading
(triode.engine.worker.checkpoint) and the conversion cache (triode.engine.model_files.cache).

Local Hugging Face directories (single-file and sharded), load errors that name the file,
GGUF conversion into the cache (a tiny GGUF written here), cache integrity (atomic entries,
manifest, rebuild of broken entries, one builder under concurrency), and hub ids failing fast
without a network, and that building a model does not import torch._dynamo. The
default-model cases download and convert SmolLM2 once per cache dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.gguf_models import write_tiny_gguf
from triode import LLM
from triode.engine.config import EngineArgs
from triode.engine.errors import ModelLoadError
from triode.engine.model_files import resolve as loading
from triode.engine.model_files.cache import MARKER_FILE, ensure_cache_entry, entry_is_complete
from triode.engine.model_files.layout import QUANTIZED_METADATA_KEY, load_hf_config
from triode.engine.model_files.resolve import ResolvedModel, resolve_model
from triode.engine.worker.checkpoint import iter_safetensors


def tiny_llama(directory: Path, tokenizer, *, tie: bool = False, **save_kwargs) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tie, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(directory)
    return model


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(path))


def assert_same_weights(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    expected = {k: v for k, v in model.state_dict().items()
                if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(tensors) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(tensors[name], tensor, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("single")
    return directory, tiny_llama(directory, tiny_tokenizer)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("sharded")
    return directory, tiny_llama(directory, tiny_tokenizer, max_shard_size="100KB")


def copy_of(directory: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(directory, tmp_path / directory.name))


# --- local Hugging Face directories -------------------------------------------------------


def test_local_single_file_directory(single_dir, tmp_path):
    directory, model = single_dir
    resolved = resolve_model(str(directory), cache_dir=str(tmp_path), progress=False)
    assert resolved == ResolvedModel(path=directory, source=str(directory))
    assert load_hf_config(resolved.path)["hidden_size"] == 64
    assert_same_weights(model, tensors_of(resolved.path))
    assert not (tmp_path / "models").exists()  # nothing cached for a local directory


def test_local_sharded_directory(sharded_dir, tmp_path):
    directory, model = sharded_dir
    assert len(list(directory.glob("*.safetensors"))) > 2
    resolved = resolve_model(str(directory), cache_dir=str(tmp_path), progress=False)
    assert_same_weights(model, tensors_of(resolved.path))


def test_truncated_safetensors_names_the_file(single_dir, tmp_path):
    directory = copy_of(single_dir[0], tmp_path)
    weights = directory / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1000)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors") as info:
        resolve_model(str(directory), cache_dir=str(tmp_path), progress=False)
    assert info.value.path == str(weights)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        list(iter_safetensors(directory))


def test_garbage_shard_names_the_shard(sharded_dir, tmp_path):
    directory = copy_of(sharded_dir[0], tmp_path)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=re.escape(shard.name)):
        list(iter_safetensors(directory))


@pytest.mark.parametrize("kinds", ['[1, 2]', '{"model.norm.weight": ["Q8_0"]}', "5"])
def test_quantized_metadata_of_the_wrong_shape_names_the_file(single_dir, tmp_path, kinds):
    """Found by probing: a JSON list there was an AttributeError."""
    directory = copy_of(single_dir[0], tmp_path)
    weights = directory / "model.safetensors"
    save_file(load_file(weights), weights, metadata={QUANTIZED_METADATA_KEY: kinds})
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: .*(triode\.quantized|quantized tensor)"):
        list(iter_safetensors(directory))


def test_weights_that_are_not_floats_are_refused_naming_the_tensor(single_dir, tmp_path):
    """Found by probing: integer and boolean tensors were cast to float and generated garbage."""
    directory = copy_of(single_dir[0], tmp_path)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.norm\.weight' is int32, not a floating-point type"):
        LLM(model=str(directory), kv_cache_memory="16MiB", max_model_len=128)


def test_a_failure_inside_the_worker_at_load_is_a_model_load_error(single_dir, tmp_path):
    """The worker's own exceptions (here torch's allocator, for layers of 10^12 features) came
    out of LLM() as they were, a bare RuntimeError."""
    directory = copy_of(single_dir[0], tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 10**12}))
    with pytest.raises(ModelLoadError, match=r"the workers could not load the model: RuntimeError: .*allocate"):
        LLM(model=str(directory), kv_cache_memory="16MiB", max_model_len=128)


def test_missing_config(single_dir, tmp_path):
    directory = copy_of(single_dir[0], tmp_path)
    (directory / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: model config is missing"):
        resolve_model(str(directory), cache_dir=str(tmp_path), progress=False)


def test_invalid_config_json(single_dir, tmp_path):
    directory = copy_of(single_dir[0], tmp_path)
    (directory / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ModelLoadError, match=r"config\.json: model config is not valid JSON"):
        load_hf_config(directory)


def test_missing_shard(sharded_dir, tmp_path):
    directory = copy_of(sharded_dir[0], tmp_path)
    shard = sorted(directory.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{re.escape(shard.name)}: shard listed in .* is missing"):
        resolve_model(str(directory), cache_dir=str(tmp_path), progress=False)
    with pytest.raises(ModelLoadError, match=re.escape(shard.name)):
        list(iter_safetensors(directory))


def test_index_names_a_tensor_the_shard_lacks(sharded_dir, tmp_path):
    directory = copy_of(sharded_dir[0], tmp_path)
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first_shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.ghost.weight"] = first_shard
    index_file.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=rf"{re.escape(first_shard)}: .*model\.ghost\.weight"):
        list(iter_safetensors(directory))


def test_directory_without_safetensors(single_dir, tmp_path):
    directory = copy_of(single_dir[0], tmp_path)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors .*pytorch_model\.bin"):
        resolve_model(str(directory), cache_dir=str(tmp_path), progress=False)


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(ModelLoadError, match="no such model directory or file") as info:
        resolve_model(str(missing), cache_dir=str(tmp_path), progress=False)
    assert info.value.path == str(missing)


def test_file_that_is_not_gguf(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"weights\.bin: expected a Hugging Face"):
        resolve_model(str(other), cache_dir=str(tmp_path), progress=False)


# --- the Hugging Face hub ------------------------------------------------------------------


def test_hub_id_fails_fast_without_network(tmp_path):
    started = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        resolve_model("triode-tests/no-such-model", cache_dir=str(tmp_path), progress=False)
    assert time.monotonic() - started < 20
    message = str(info.value)
    assert "'triode-tests/no-such-model'" in message
    assert "was not found locally" in message
    # No network here: unreachable. With a network the hub answers that there is no such repo.
    assert "could not be reached" in message or "no such repository" in message


def test_hub_id_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        resolve_model("triode-tests/no-such-model", cache_dir=str(tmp_path), progress=False)


def test_hub_id_found_in_the_hugging_face_cache(single_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    hub_cache = tmp_path / "hub"
    repo = hub_cache / "models--triode-tests--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(single_dir[0], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    resolved = resolve_model("triode-tests/tiny", cache_dir=str(tmp_path), progress=False)
    assert resolved.path == repo / "snapshots" / commit
    assert resolved.source == "triode-tests/tiny"
    assert_same_weights(single_dir[1], tensors_of(resolved.path))


class _FakeHub:
    """Stands in for a reachable hub: records the snapshot_download calls."""

    def __init__(self, snapshot: Path) -> None:
        self.snapshot = snapshot
        self.downloads: list[dict] = []

    def model_info(self, repo_id, *, timeout=None, **kwargs):
        assert timeout is not None and timeout <= 10
        return object()

    def snapshot_download(self, repo_id, **kwargs):
        from huggingface_hub.errors import LocalEntryNotFoundError

        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        self.downloads.append(kwargs)
        return str(self.snapshot)


def test_hub_id_downloads_when_the_hub_is_reachable(single_dir, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    hub = _FakeHub(single_dir[0])
    monkeypatch.setattr(huggingface_hub, "model_info", hub.model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    resolved = resolve_model("triode-tests/tiny", cache_dir=str(tmp_path), progress=True)
    assert resolved == ResolvedModel(path=single_dir[0], source="triode-tests/tiny")
    [kwargs] = hub.downloads
    assert {"*.safetensors", "*.json", "*.jinja"} <= set(kwargs["allow_patterns"])
    assert "triode: downloading triode-tests/tiny" in capsys.readouterr().err


def test_hub_repo_not_found(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    class NotFound(RepositoryNotFoundError):
        def __init__(self) -> None:  # the real one wants an HTTP response object
            Exception.__init__(self, "404 Client Error: Repository Not Found")

    def model_info(repo_id, **kwargs):
        raise NotFound()

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    with pytest.raises(ModelLoadError, match="hub has no such repository"):
        resolve_model("triode-tests/no-such-model", cache_dir=str(tmp_path), progress=False)


# --- GGUF ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_gguf(request, tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("gguf")
    model = tiny_llama(directory / "hf", tiny_tokenizer, tie=request.param)
    path = directory / "tiny-llama.F32.gguf"
    write_tiny_gguf(path, model, tiny_tokenizer)
    return path, model


@pytest.fixture
def counted_conversions(monkeypatch):
    calls: list[Path] = []
    real = loading.convert_gguf

    def counting(gguf_path, out_dir, scratch, *, progress):
        calls.append(gguf_path)
        return real(gguf_path, out_dir, scratch, progress=progress)

    monkeypatch.setattr(loading, "convert_gguf", counting)
    return calls


def test_gguf_round_trip(tiny_gguf, tiny_tokenizer, tmp_path, counted_conversions):
    path, model = tiny_gguf
    resolved = resolve_model(str(path), cache_dir=str(tmp_path), progress=False)
    assert resolved.source == str(path)
    assert resolved.path.parent == tmp_path / "models"
    assert resolved.path.name.startswith("gguf-tiny-llama.F32-")
    assert counted_conversions == [path.resolve()]
    config = load_hf_config(resolved.path)
    assert config["tie_word_embeddings"] is model.config.tie_word_embeddings
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert_same_weights(model, tensors_of(resolved.path))
    converted = AutoTokenizer.from_pretrained(resolved.path)
    text = "Paris is the capital of France; <|im_end|> héllo 12345"
    assert converted(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
    assert converted.chat_template == tiny_tokenizer.chat_template
    # A second start finds the sealed entry and converts nothing.
    marker = resolved.path / MARKER_FILE
    sealed_at = marker.stat().st_mtime_ns
    again = resolve_model(str(path), cache_dir=str(tmp_path), progress=False)
    assert again == resolved
    assert counted_conversions == [path.resolve()]
    assert marker.stat().st_mtime_ns == sealed_at
    leftovers = [p.name for p in (tmp_path / "models").iterdir()
                 if p.name != resolved.path.name and not p.name.endswith(".lock")]
    assert leftovers == []


@pytest.mark.parametrize("damage", ["delete weights", "truncate weights", "scramble header",
                                    "corrupt marker", "delete marker"])
def test_broken_gguf_entry_is_rebuilt(damage, tiny_gguf, tmp_path, counted_conversions):
    path, model = tiny_gguf
    entry = resolve_model(str(path), cache_dir=str(tmp_path), progress=False).path
    weights, marker = entry / "model.safetensors", entry / MARKER_FILE
    if damage == "delete weights":
        weights.unlink()
    elif damage == "truncate weights":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif damage == "scramble header":  # same size, so only the header check can notice
        with open(weights, "r+b") as f:
            f.write(b"\xff" * 8)
    elif damage == "corrupt marker":
        marker.write_text("{not json")
    else:
        marker.unlink()
    # A crashed builder's temporary directory must be swept too.
    (tmp_path / "models" / f".{entry.name}.tmp-crashed").mkdir()
    assert entry_is_complete(entry) is (damage == "scramble header")
    rebuilt = resolve_model(str(path), cache_dir=str(tmp_path), progress=False)
    assert rebuilt.path == entry and entry_is_complete(entry)
    assert len(counted_conversions) == 2
    assert_same_weights(model, tensors_of(entry))
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == sorted(
        [entry.name, f".{entry.name}.lock"])


def test_truncated_gguf_names_the_file_and_leaves_nothing(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    with pytest.raises(ModelLoadError, match=r"broken\.gguf: GGUF file is truncated or corrupt"):
        resolve_model(str(broken), cache_dir=str(tmp_path / "cache"), progress=False)
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("hello, world")
    with pytest.raises(ModelLoadError, match=r"fake\.gguf: not a GGUF file"):
        resolve_model(str(fake), cache_dir=str(tmp_path / "cache"), progress=False)


# --- the cache itself ------------------------------------------------------------------------


def _fake_model(out: Path) -> None:
    (out / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, str(out / "model.safetensors"))


def test_failed_build_leaves_nothing(tmp_path):
    def build(out: Path, scratch: Path, progress: bool) -> None:
        _fake_model(out)
        raise ModelLoadError("conversion blew up")

    with pytest.raises(ModelLoadError, match="conversion blew up"):
        ensure_cache_entry(tmp_path, "thing", build, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock"]


def test_build_without_weights_is_not_sealed(tmp_path):
    def build(out: Path, scratch: Path, progress: bool) -> None:
        (out / "config.json").write_text("{}")

    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        ensure_cache_entry(tmp_path, "thing", build, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock"]


def test_concurrent_builders_build_once(tmp_path):
    """Two processes asking for the same entry at once: one builds, the other waits and reuses."""
    script = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from safetensors.torch import save_file
        import torch
        from triode.engine.model_files.cache import ensure_cache_entry

        root = Path(sys.argv[1])
        def build(out, scratch, progress):
            with open(root / "builds.log", "a") as log:
                log.write("built\\n")
            # Build only once the other process has arrived, so that it must wait on the lock.
            deadline = time.monotonic() + 60
            while len(list(root.glob("arrived-*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            (out / "config.json").write_text("{}")
            save_file({"w": torch.ones(3)}, str(out / "model.safetensors"))

        (root / f"arrived-{sys.argv[2]}").touch()
        print(ensure_cache_entry(root / "models", "shared", build, progress=True))
    """)
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert out.strip() == str(tmp_path / "models" / "shared")
    assert (tmp_path / "builds.log").read_text() == "built\n"
    assert sum("waiting for another process" in err for _, err in results) == 1
    assert entry_is_complete(tmp_path / "models" / "shared")


# --- the default model -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def shared_cache_dir() -> str:
    """The suite-wide cache ($TRIODE_CACHE or ~/.cache/triode), so SmolLM2 converts once."""
    return EngineArgs().resolved_cache_dir()


def check_default_entry(path: Path) -> None:
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", MARKER_FILE} <= names
    config = load_hf_config(path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (49152, True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    shapes = {name: tuple(t.shape) for name, t in iter_safetensors(path)}
    assert len(shapes) == 272 and "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (49152, 576)


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model(shared_cache_dir, monkeypatch):
    resolved = resolve_model(None, cache_dir=shared_cache_dir, progress=True)
    assert resolved.source == "default"
    assert resolved.path == Path(shared_cache_dir) / "models" / "SmolLM2-135M-Instruct-q2"
    check_default_entry(resolved.path)
    marker = resolved.path / MARKER_FILE
    sealed_at = marker.stat().st_mtime_ns

    def must_not_run(*args, **kwargs):
        raise AssertionError("the second start must not download or convert again")

    monkeypatch.setattr(loading, "convert_gguf", must_not_run)
    monkeypatch.setattr(loading, "fetch_default_gguf", must_not_run)
    again = resolve_model("default", cache_dir=shared_cache_dir, progress=False)
    assert again == resolved
    assert marker.stat().st_mtime_ns == sealed_at


@pytest.mark.default_model
@pytest.mark.slow
def test_broken_default_entry_is_rebuilt(shared_cache_dir, tmp_path):
    """A copy of the shared entry, damaged: the resolver throws it away and rebuilds it from
    scratch (download and conversion included) instead of half-loading it."""
    shared = resolve_model(None, cache_dir=shared_cache_dir, progress=False).path
    entry = tmp_path / "models" / shared.name
    shutil.copytree(shared, entry)
    (entry / "model.safetensors").unlink()
    rebuilt = resolve_model(None, cache_dir=str(tmp_path), progress=False)
    assert rebuilt.path == entry and entry_is_complete(entry)
    check_default_entry(entry)
    expected = json.loads((shared / MARKER_FILE).read_text())["files"]
    assert json.loads((entry / MARKER_FILE).read_text())["files"] == expected


# --- what building a model costs in memory ------------------------------------------------


def test_building_a_model_imports_neither_dynamo_nor_triton(single_dir):
    # torch._dynamo (and triton through it) is about 150 MB in every worker; it comes in
    # when a tensor on the meta device is initialized through torch's refs (normal_).
    directory, _ = single_dir
    probe = textwrap.dedent(f"""
        import sys
        from triode.engine.config import EngineArgs
        from triode.engine.worker.runner import ModelRunner
        runner = ModelRunner(EngineArgs(model={str(directory)!r}, kv_cache_memory="8MiB",
                                        max_model_len=64), {str(directory)!r})
        print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
