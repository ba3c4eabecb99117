"""What the engine process knows of a model before any worker loads it: its shape and rules
from config.json (:mod:`.config`, the fields it reads in :mod:`.hf_fields`), its sampling
defaults and end-of-sequence ids (:mod:`.generation_config`), and where it is with its
tokenizer (:mod:`.setup`). Imports no torch (the engine process never does); the worker
reads the same :class:`~triode.engine.model.config.ModelConfig`."""
