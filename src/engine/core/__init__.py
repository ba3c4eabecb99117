"""The engine's policy, sans-IO: the engine core and its step pipeline (:mod:`.engine_core`),
the scheduler and its plans (:mod:`.scheduler`, :mod:`.scheduler_output`), a sequence's state
(:mod:`.request`), the KV blocks (:mod:`.kv_blocks`), and the output side (:mod:`.detokenizer`,
:mod:`.output_processor`). No trio, no I/O, no torch; checked by mypy, strictly. Both drivers
(``LLMEngine``, the scheduler actor) run it and decide nothing of their own."""
