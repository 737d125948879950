"""``python -m orchestrate.doctor.checkup``: the doctor's rank program (see program.py)."""

import sys

from orchestrate.doctor.checkup.program import main

sys.exit(main())
