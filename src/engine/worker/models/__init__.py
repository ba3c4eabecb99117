"""triode's model implementations over the paged KV cache: the Llama family and Phi-3
(:mod:`.llama`), Gemma 2 and 3 (:mod:`.gemma`), the mixtures of experts (:mod:`.moe`), their
shared layers, rope and weight loading, the registry of architectures (:mod:`.registry`) and
the C decode stack's description of a model (:mod:`.cpu_decode`). Ops go through
:mod:`triode.kernels`."""
