"""unit: the worker's block tables (one tensor row per sequence) and the step inputs gathered
from them, against the slots and tables computed position by position; the staging buffers
that send a GPU step's inputs up in one copy (run here with a CPU "device" buffer)."""

from __future__ import annotations

import pytest
import torch

from triode.engine.worker.block_tables import MAX_INITIAL_ROWS, BlockTables
from triode.engine.worker.input_staging import InputStaging
from triode.engine.worker.step_inputs import StepInputs
from triode.engine.worker_messages import ScheduledChunk

BLOCK = 4


def _tables(sequences: dict[str, list[int]], rows: int = 2) -> BlockTables:
    tables = BlockTables(8, rows=rows)
    for seq_id, blocks in sequences.items():
        tables.add(seq_id)
        tables.extend(seq_id, blocks[:1])
        tables.extend(seq_id, blocks[1:])  # a table grows over several plans
    return tables


def test_rows_are_reused_and_the_tensor_grows():
    tables = _tables({"a": [3, 9], "b": [1], "c": [5, 6, 7]})  # three sequences in two rows: grown
    assert tables.table.shape[0] == 4
    assert tables.table[tables.row("c"), :3].tolist() == [5, 6, 7] and tables.lengths[tables.row("c")] == 3
    row = tables.row("a")
    tables.remove("a")
    assert "a" not in tables
    tables.add("d")
    assert tables.row("d") == row and tables.lengths[row] == 0 and not tables.table[row].any()
    tables.add("d")  # a sequence that restarts starts with an empty table
    assert tables.lengths[tables.row("d")] == 0


def test_rows_past_the_initial_cap_are_allocated_as_sequences_arrive():
    # max_num_seqs=10**9 asked for 2 TB of tables up front at the default model's length
    tables = BlockTables(512, rows=10**9)
    assert tables.table.shape == (MAX_INITIAL_ROWS, 512)
    for index in range(MAX_INITIAL_ROWS + 1):
        tables.add(f"s{index}")
    assert tables.table.shape[0] == 2 * MAX_INITIAL_ROWS and len(tables.lengths) == 2 * MAX_INITIAL_ROWS


def test_a_table_longer_than_the_longest_sequence_is_refused():
    tables = _tables({"a": list(range(8))})
    with pytest.raises(ValueError, match="'a': 9 blocks, more than the 8"):
        tables.extend("a", [8])


def test_a_step_extends_many_tables_in_one_write_as_one_by_one():
    one_by_one = _tables({"a": [3], "b": [1, 2], "c": [5]}, rows=4)
    at_once = _tables({"a": [3], "b": [1, 2], "c": [5]}, rows=4)
    additions = [("a", [4, 8]), ("b", []), ("c", [6])]
    for seq_id, blocks in additions:
        one_by_one.extend(seq_id, blocks)
    at_once.extend_many(additions)
    assert torch.equal(at_once.table, one_by_one.table) and at_once.lengths.tolist() == one_by_one.lengths.tolist()
    assert at_once.table[at_once.row("a"), :3].tolist() == [3, 4, 8]
    assert at_once.highest_block == one_by_one.highest_block == 8  # the KV pages committed through


def test_the_highest_block_outlives_the_tables_that_held_it():
    tables = BlockTables(8)
    assert tables.highest_block == -1
    tables.add("a")
    tables.extend("a", [7, 2])
    tables.remove("a")
    tables.add("b")
    tables.extend("b", [3])
    assert tables.highest_block == 7


def test_extending_many_writes_nothing_when_one_table_would_overflow():
    tables = _tables({"a": [1], "b": list(range(8))})
    before, lengths = tables.table.clone(), tables.lengths.tolist()
    with pytest.raises(ValueError, match="'b': 9 blocks"):
        tables.extend_many([("a", [2]), ("b", [9])])
    assert torch.equal(tables.table, before) and tables.lengths.tolist() == lengths


def _expected(chunks, tokens, sequences):
    slots, positions = [], []
    for chunk, ids in zip(chunks, tokens, strict=True):
        table = sequences[chunk.seq_id]
        for position in range(chunk.start_position, chunk.start_position + len(ids)):
            positions.append(position)
            slots.append(table[position // BLOCK] * BLOCK + position % BLOCK)
    return slots, positions


@pytest.mark.parametrize("prefill", [False, True])
def test_inputs_match_the_tables_position_by_position(prefill):
    sequences = {"a": [3, 9, 4], "b": [1], "c": [5, 6]}
    tables = _tables(sequences)
    chunks = [ScheduledChunk("a", (11,), 9), ScheduledChunk("b", (12,), 2)]
    tokens = [(11,), (12,)]
    if prefill:
        chunks.append(ScheduledChunk("c", (1, 2, 3, 4, 5), 2))
        tokens.append((1, 2, 3, 4, 5))
    inputs = StepInputs.build(chunks, tokens, tables, block_size=BLOCK, device=torch.device("cpu"))
    slots, positions = _expected(chunks, tokens, sequences)
    md = inputs.metadata
    assert md.slot_mapping.tolist() == slots and inputs.positions.tolist() == positions
    assert inputs.token_ids.tolist() == [t for ids in tokens for t in ids]
    assert md.num_decodes == 2 and md.max_query_len == (5 if prefill else 1)
    ends = [c.start_position + len(t) for c, t in zip(chunks, tokens, strict=True)]
    assert md.seq_lens.tolist() == ends and md.seq_lens_host == tuple(ends) and md.max_seq_len == max(ends)
    width = 3
    assert md.block_tables.shape == (len(chunks), width)
    for row, chunk in enumerate(chunks):
        table = sequences[chunk.seq_id]
        assert md.block_tables[row, :len(table)].tolist() == table
        assert not md.block_tables[row, len(table):].any()  # padding: block 0
    assert inputs.last_token_rows == ((0, 1, 6) if prefill else (0, 1))
    assert md.query_start_loc.tolist() == list(md.query_start_loc_host)
    dtypes = {"slot_mapping": torch.int64, "query_start_loc": torch.int32, "seq_lens": torch.int32,
              "block_tables": torch.int32}
    for name, dtype in dtypes.items():
        tensor = getattr(md, name)
        assert tensor.dtype == dtype and tensor.is_contiguous(), name
    assert inputs.token_ids.dtype == inputs.positions.dtype == torch.int64


def test_a_chunk_past_its_blocks_is_refused_naming_the_sequence():
    tables = _tables({"a": [3]})
    with pytest.raises(ValueError, match="'a': 5 tokens need more than its 1 blocks of 4"):
        StepInputs.build([ScheduledChunk("a", (1,), 4)], [(1,)], tables, block_size=BLOCK,
                         device=torch.device("cpu"))


def test_staged_inputs_equal_the_inputs_copied_one_by_one():
    """Every tensor of a step through the staging buffers (one copy), and again for a larger
    step (the buffers grow) and a smaller one (they are reused)."""
    sequences = {"a": [3, 9, 4], "b": [1], "c": [5, 6]}
    tables = _tables(sequences)
    staging = InputStaging(torch.device("cpu"))
    steps = [
        ([ScheduledChunk("a", (11,), 9)], [(11,)]),
        ([ScheduledChunk("a", (11,), 9), ScheduledChunk("b", (12,), 2), ScheduledChunk("c", (1, 2, 3, 4, 5), 2)],
         [(11,), (12,), (1, 2, 3, 4, 5)]),
        ([ScheduledChunk("b", (12,), 2)], [(12,)]),
    ]
    for number, (chunks, tokens) in enumerate(steps, start=1):
        plain = StepInputs.build(chunks, tokens, tables, block_size=BLOCK, device=torch.device("cpu"))
        staged = StepInputs.build(chunks, tokens, tables, block_size=BLOCK, device=torch.device("cpu"),
                                  staging=staging)
        assert staging.copies == number
        for name in ("token_ids", "positions"):
            assert torch.equal(getattr(staged, name), getattr(plain, name))
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            mine, theirs = getattr(staged.metadata, name), getattr(plain.metadata, name)
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name


def test_staging_keeps_segments_of_mixed_sizes_apart():
    staging = InputStaging(torch.device("cpu"))
    tensors = [torch.arange(3, dtype=torch.int32), torch.arange(5, dtype=torch.int64) * 7,
               torch.empty(0, 4, dtype=torch.int32), torch.arange(6, dtype=torch.int32).reshape(2, 3)]
    uploaded = staging.upload(tensors)
    for sent, received in zip(tensors, uploaded, strict=True):
        assert received.dtype == sent.dtype and received.shape == sent.shape and torch.equal(received, sent)
