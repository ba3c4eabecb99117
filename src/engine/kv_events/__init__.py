"""KV-cache events on vLLM's wire: what a cache-aware router (vllm-router's ``kv_aware``
policy, llm-d's KV indexer) reads to know which replica holds which prefix.

``config`` holds ``KVEventsConfig``, vLLM's ``--kv-events-config`` with vLLM's fields;
``publisher`` the ZMQ publisher a driver hands the engine core's events to (msgpack
``EventBatch`` messages on a PUB socket, and a ROUTER socket that replays missed ones).
Imports the core's event types and nothing else of the engine."""
