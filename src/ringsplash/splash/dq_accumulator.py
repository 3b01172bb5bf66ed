"""The fused backward's dq: accumulated in float32 in HBM by the dK/dV kernel (``kernel_backward.py``)."""

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["DqAccumulator"]


class DqAccumulator:
    """dq of the fused backward, accumulated in float32 in HBM by the dK/dV kernel.

    The dK/dV grid visits, per kv block, every q block that attends it, so one (q head, q block)
    dq block is updated by many grid steps far apart. Each maximal run of consecutive steps on
    one dq block adds into one of two VMEM slots; the run's block is read from HBM before it
    (the DMA started at the end of the previous run, waited just before the first add) and
    written back at its end (waited at the end of the next run, before that run's slot is
    reused for the following read). A read never races a pending write of the same block:
    neighbouring runs name different blocks, and the write two runs back is waited before the
    read is started. The state lives in SMEM: ``[slot, read pending, write pending]``. Each kv
    head (the parallel grid axis) starts and drains its own pipeline, so megacore halves never
    share a dq block (a kv head's q heads are its own).
    """

    def __init__(self, hbm, slots, sems, state, *, h, q_block, next_entry):
        self.hbm, self.slots, self.sems, self.state = hbm, slots, sems, state
        self.h, self.q_block = h, q_block
        self.has_next, self.next_h, self.next_q_block = next_entry
        self.bq = slots.shape[1]

    def _copy(self, slot, h, q_block, *, read):
        rows = self.hbm.at[h, pl.ds(pl.multiple_of(q_block * self.bq, self.bq), self.bq), :]
        if read:
            return pltpu.make_async_copy(rows, self.slots.at[slot], self.sems.at[0, slot])
        return pltpu.make_async_copy(self.slots.at[slot], rows, self.sems.at[1, slot])

    def begin(self, *, start):
        @pl.when(start)  # a kv head's first step: nothing pending, read its first block into slot 0
        def _start():
            self.state[0] = 0
            self.state[2] = 0
            self._copy(0, self.h, self.q_block, read=True).start()
            self.state[1] = 1

    def _wait_read(self):
        @pl.when(self.state[1] == 1)
        def _wait():
            self._copy(self.state[0], self.h, self.q_block, read=True).wait()
            self.state[1] = 0

    def add(self, contribution, rows=None):
        """Add ``contribution`` to the block's dq, or to its ``rows`` (a ``pl.ds``)."""
        self._wait_read()  # after the tile's matmuls, so the read overlaps them
        slot = self.state[0]
        if rows is None:
            self.slots[slot] = self.slots[slot] + contribution
        else:
            block = self.slots.at[slot]
            block[rows, :] = block[rows, :] + contribution

    def end(self):
        self._wait_read()  # steps that computed nothing
        slot = self.state[0]
        same_next = self.has_next & (self.next_h == self.h) & (self.next_q_block == self.q_block)

        @pl.when(jnp.logical_not(same_next))  # the run ends: write its block back, read the next one
        def _end_of_run():
            @pl.when(self.state[2] == 1)
            def _wait_previous_write():  # it is the other slot's, which the next read fills
                self._copy(1 - slot, self.h, self.q_block, read=False).wait()

            self._copy(slot, self.h, self.q_block, read=False).start()
            self.state[2] = 1

            @pl.when(self.has_next)
            def _read_next():
                self._copy(1 - slot, self.next_h, self.next_q_block, read=True).start()
                self.state[0] = 1 - slot
                self.state[1] = 1

            @pl.when(jnp.logical_not(self.has_next))
            def _drain():  # the kv head's last step
                self._copy(slot, self.h, self.q_block, read=False).wait()
                self.state[2] = 0
