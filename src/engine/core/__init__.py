"""The engine's policy, sans-IO: the engine core and its step pipeline (:mod:`.engine_core`),
the scheduler (:mod:`.scheduler`: its plans; :mod:`.sequence_queues`: the sequences it holds;
:mod:`.step_results`: a step's result applied; :mod:`.lora_loads`: adapters' reads and slots;
:mod:`.scheduler_output`), a sequence's state (:mod:`.sequence`), the KV blocks
(:mod:`.kv_blocks`, :mod:`.kv_cache_events`), and the output side (:mod:`.detokenizer`,
:mod:`.output_processor`). No trio, no I/O, no torch; checked by mypy, strictly. Both drivers
(``LLMEngine``, the scheduler actor) run it and decide nothing of their own."""
