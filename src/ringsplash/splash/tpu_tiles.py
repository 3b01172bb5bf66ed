"""The TPU's native tile: 8 sublanes x 128 lanes of 32-bit values (a leaf module: the config,
the block table and the VMEM estimate all size blocks in these units)."""

NUM_LANES = 128
NUM_SUBLANES = 8
