import sys

from ringsplash.cli import PATH_ERRORS
from ringsplash.evals.cli import main

try:
    main()
except (ValueError, ImportError, *PATH_ERRORS) as e:  # bad input: one line (exit status 2), not a traceback
    print(f"python -m ringsplash.evals: error: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
