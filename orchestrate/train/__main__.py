"""Entry point of ``python -m orchestrate.train``."""

import sys

from orchestrate.train.main import main

sys.exit(main())
