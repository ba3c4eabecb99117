"""The benchmarks behind ``triode bench``: each command measures triode and its baseline (Hugging
Face transformers, a peer server, the same engine with a setting off) in the same run, prints
them side by side and draws them. A tool beside the runtime: it may import every triode package,
and none of them imports it but the command line, which registers its subcommands
(:mod:`triode.bench.commands`, :mod:`triode.bench.serve`). Its own dependencies (matplotlib,
psutil) come with the ``bench`` extra."""
