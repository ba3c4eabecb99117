"""Shared fixtures: tiny random models of each architecture, built once per session, and the
process-wide kernel settings put back after a test."""

from __future__ import annotations

import pytest

from tests.tiny_models import ARCHITECTURES, build_tiny_model, train_tokenizer
from triode import kernels
from triode.kernels import native


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tiny_tokenizer):
    """Builds (and caches per session) a tiny model: factory(arch, **config_overrides) -> path."""
    built = {}

    def factory(architecture: str, **overrides):
        key = (architecture, repr(sorted(overrides.items())))
        if key not in built:
            directory = tmp_path_factory.mktemp(f"tiny-{architecture}")
            built[key] = build_tiny_model(directory, architecture, tiny_tokenizer, **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def tiny_model(request, tiny_model_factory):
    return tiny_model_factory(request.param)


@pytest.fixture(scope="session")
def protocol_server():
    """One `triode serve` on the default model for the protocol tests (structured outputs,
    tools), with vLLM's tool flags on. No reasoning parser: it would offer the model a
    thinking block before every constrained answer, which a model that does not reason
    wanders into at temperature 1."""
    from tests.http_server import running, triode_serve

    flags = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes"]
    with running(triode_serve(None, *flags)) as server:
        yield server


@pytest.fixture(scope="session")
def protocol_client(protocol_server):
    """The openai SDK against ``protocol_server``, with strict response validation."""
    import openai

    with openai.OpenAI(base_url=f"{protocol_server.url}/v1", api_key="unused", max_retries=0,
                       _strict_response_validation=True) as client:
        yield client


@pytest.fixture(params=["native", "avx2"])
def isa(request):
    """The test runs with this CPU's build of the C kernels and with the AVX2 one
    (TRIODE_CPU_ISA=avx2)."""
    previous = native.cpu_isa()
    native.set_cpu_isa(request.param)
    yield request.param
    native.set_cpu_isa(previous)


@pytest.fixture
def kernel_settings():
    """The process-wide kernel settings that a runner made in this process changes, put back."""
    activations, invariant = kernels.quantized_activations(), kernels.batch_invariant()
    yield
    kernels.set_quantized_activations(activations)
    kernels.set_batch_invariant(invariant)
