"""``python -m distckpt.checks PATH ...``: the pre-flight checks, as ``distckpt preflight``."""

import sys

from .cli import main

sys.exit(main())
