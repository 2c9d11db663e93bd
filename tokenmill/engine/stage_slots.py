"""Stage slots, which a pool of a staged KV format (int4, layers/kv_cache.py) lends with its
blocks: every block not yet full of computed tokens holds one, where its K rows wait in the
model's dtype until the block is quantized. A sequence's stage table, parallel to its block
table, says which (-1: a full block). A slot comes with its block (allocate) and goes back
when the block's tokens are all computed (commit), or when the block is released (free,
truncate). Mixed into BlockManager, which provides `group` and `block_size`."""

from __future__ import annotations

from tokenmill.engine.sequence import Sequence


class StageSlots:
    def _init_stages(self, slots: int) -> None:
        self.staged = slots > 0
        self._free_stages = list(range(slots - 1, -1, -1))  # popped from the end

    @property
    def num_free_stages(self) -> int:
        return len(self._free_stages)

    def stages(self, seq: Sequence) -> list[int]:
        """Seq's stage slot of each block of its table in this pool (-1: none)."""
        while len(seq.stage_tables) <= self.group:
            seq.stage_tables.append([])
        return seq.stage_tables[self.group]

    def _reset_stages(self, seq: Sequence, blocks: int) -> None:
        """A new table of `blocks` full blocks (cache hits, a fork's shared blocks, none)."""
        if self.staged:
            self.stages(seq)
            seq.stage_tables[self.group] = [-1] * blocks

    def _lend_stage(self, seq: Sequence) -> None:
        """For the block just appended to seq's table."""
        if self.staged:
            self.stages(seq).append(self._free_stages.pop())

    def release_stages(self, seq: Sequence) -> None:
        """Slots of blocks whose tokens are all computed go back (those blocks are quantized
        now; the open blocks follow them in the table)."""
        if not self.staged:
            return
        stages = self.stages(seq)
        i = seq.num_computed_tokens // self.block_size - 1
        while 0 <= i < len(stages) and stages[i] >= 0:
            self._free_stages.append(stages[i])
            stages[i] = -1
            i -= 1

    def _return_stages(self, seq: Sequence, last: bool = False) -> None:
        """Every slot seq holds (free), or only its last block's (truncate)."""
        if not self.staged:
            return
        stages = self.stages(seq)
        taken = [stages.pop()] if last else stages
        self._free_stages += [s for s in taken if s >= 0]
