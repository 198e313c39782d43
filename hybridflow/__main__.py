"""``python -m hybridflow``: the ``hybridflow`` command, for an environment whose scripts
directory is not on PATH."""

import sys

from hybridflow.cli import main

sys.exit(main())
