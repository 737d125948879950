"""``python -m orchestrate.checkup``: the doctor's rank program (see program.py)."""

import sys

from orchestrate.checkup.program import main

sys.exit(main())
