"""Entry point of ``python -m orchestrate.train``.

Guarded by ``__name__``: a process that re-imports the main module (multiprocessing's spawn, as
torch.distributed.checkpoint's process-based async save uses) must not start another rank.
"""

import sys

from orchestrate.train.main import main

if __name__ == "__main__":
    sys.exit(main())
