"""``Batch``: the record every data source hands the trainer, host side (numpy).

Every field is ``[batch, seq]`` in original token order; the trainer applies the ring layout.
"""

from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    tokens: np.ndarray  # int32 [batch, seq]
    labels: np.ndarray  # int32 [batch, seq]: the token to predict at each position
    loss_mask: np.ndarray  # float32 [batch, seq]: 1 where the prediction is scored
    positions: np.ndarray  # int32 [batch, seq]: RoPE positions (within the document)
    segment_ids: np.ndarray  # int32 [batch, seq]: document id of each token
