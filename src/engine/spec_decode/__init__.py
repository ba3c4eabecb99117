"""Speculative decoding's engine side: the configuration (``config``), prompt lookup's index
(``ngram``) and the scheduler's policy and counters (``policy``). The worker's side, which
proposes and verifies, is ``triode.engine.worker.speculation`` and ``.rejection``."""
