"""From what the user named to a local Hugging Face model directory, in the engine process.

``resolve.resolve_model`` takes a directory, a ``.gguf`` file, a hub id or nothing (the
default model); GGUF files are converted once into the triode cache (``cache``,
``default_model``); ``layout`` reads and checks a directory's config and checkpoint files.
Nothing here imports torch at module level: the engine process loads no model (the workers
do), and only a GGUF conversion needs torch, imported when it runs.
"""
