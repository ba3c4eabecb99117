"""`triode bench attention`: what the CPU's batch-invariant attention costs. Every query row of
a step goes through the C decode kernel (a prefill token at position p as the decode of a
sequence p + 1 tokens long); the alternative it replaced runs prefill chunks through the torch
reference (scaled_dot_product_attention per sequence). Both are timed on the same steps, in
the same run, at the default model's attention shape (9 query heads, 3 KV heads, head dim 64,
blocks of 16 tokens) over 30 layers, float32."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from triode.bench.report import machine_description, plot_lines, print_table, write_json
from triode.kernels.cpu_attention import paged_decode_cpu
from triode.kernels.paged_attention import paged_attention_cpu
from triode.kernels.prefill_attention import prefill_attention_reference
from triode.kernels.testing import PagedBatch, make_paged_batch

LAYERS = 30
# (label, [(cached prefix, new tokens)] per sequence): prefills of one and several prompts, a
# chunk after a cached prefix, and a step that mixes decodes with a prefill chunk.
STEPS = [
    ("1 x 512", [(0, 512)]),
    ("4 x 128", [(0, 128)] * 4),
    ("8 x 64", [(0, 64)] * 8),
    ("512 after 512", [(512, 512)]),
    ("32 decodes + 256", [(200, 1)] * 32 + [(0, 256)]),
]


def _milliseconds(function, repeats: int) -> float:
    function()
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats * 1e3


def _invariant(batch: PagedBatch) -> None:
    for _ in range(LAYERS):
        paged_attention_cpu(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, batch.metadata,
                            batch.scale)


def _sdpa_prefill(batch: PagedBatch) -> None:
    """What the CPU path ran before: the decodes in the kernel, the chunks through SDPA."""
    out, metadata, decodes = torch.empty_like(batch.query), batch.metadata, batch.metadata.num_decodes
    for _ in range(LAYERS):
        if decodes:
            paged_decode_cpu(batch.query[:decodes], batch.k_cache, batch.v_cache, metadata.block_tables[:decodes],
                             metadata.seq_lens[:decodes], batch.scale, out[:decodes])
        prefill_attention_reference(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache, metadata,
                                    batch.scale, out)


def run(*, repeats: int = 3, output_dir: Path = Path("bench-results")) -> list[dict]:
    print(f"triode bench attention: the default model's attention shape, {LAYERS} layers, float32; "
          f"{machine_description()}")
    rows = []
    for label, seqs in STEPS:
        batch = make_paged_batch(seqs, num_decodes=sum(1 for _, new in seqs if new == 1), kv_heads=3, group=3,
                                 head_dim=64, block_size=16, poison=False)
        rows.append({"step": label, "invariant_ms": _milliseconds(lambda b=batch: _invariant(b), repeats),
                     "sdpa_prefill_ms": _milliseconds(lambda b=batch: _sdpa_prefill(b), repeats)})
    print_table(["step", "decode kernel, every row ms", "SDPA for prefill chunks ms", "ratio"],
                [[r["step"], r["invariant_ms"], r["sdpa_prefill_ms"], f"{r['invariant_ms'] / r['sdpa_prefill_ms']:.2f}x"]
                 for r in rows])
    write_json(output_dir / "attention.json", {"layers": LAYERS, "rows": rows})
    plot_lines(output_dir / "attention.png", title=f"CPU attention of one step, {LAYERS} layers",
               x_label="step", y_label="ms", x=list(range(len(rows))), tick_labels=[r["step"] for r in rows],
               series={"decode kernel for every row (batch invariant)": [r["invariant_ms"] for r in rows],
                       "SDPA for prefill chunks": [r["sdpa_prefill_ms"] for r in rows]})
    print(f"wrote {output_dir / 'attention.json'} and {output_dir / 'attention.png'}")
    return rows
