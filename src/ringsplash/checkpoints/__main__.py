"""``python -m ringsplash.checkpoints verify DIR``: check every step of a checkpoint directory."""

import sys

from ringsplash.checkpoints.cli import main

sys.exit(main())
