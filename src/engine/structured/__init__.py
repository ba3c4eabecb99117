"""Structured outputs and the text parsed out of an answer, on the engine side: a request's
constraint checked and compiled before it is scheduled (:mod:`.params`, :mod:`.compiler`; the
worker enforces it token by token in :mod:`triode.engine.worker.grammar`), and a reasoning
model's thinking split from its answer (:mod:`.reasoning`, with :mod:`.streaming_text` for
markers cut across streamed pieces, which the tool-call parsers share). Imports no torch."""
