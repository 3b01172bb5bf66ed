import sys

from ringsplash.evals.cli import main

try:
    main()
except (ValueError, FileNotFoundError, ImportError) as e:  # bad input: the message, not a traceback
    sys.exit(f"error: {e}")
