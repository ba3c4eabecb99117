"""LoRA adapters as the engine process sees them: the request that names one
(:class:`LoRARequest`), the checks of a PEFT adapter's files against the served model
(:mod:`.peft_files`, torch-free, which the workers also read tensor names from), and the
checked adapters an engine remembers by id (:mod:`.adapters`). The adapters a server serves by
name are the frontend's (``triode.frontend.server.adapters``); the worker side, which holds the
weights and applies them, is :mod:`triode.engine.worker.lora`."""
