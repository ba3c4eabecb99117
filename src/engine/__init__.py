"""The engine: its sans-IO core (``core``), the trio actors that drive it (``actors``), the code
that runs in worker processes (``worker``), model files and the three Python entry layers
(``llm``, ``llm_engine``, ``async_llm``). The public names are re-exported by ``triode``."""
