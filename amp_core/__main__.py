"""`python -m amp_core …` is the `amp-lab` command (amp_core.cli)."""

import sys

from amp_core.cli import main

sys.exit(main())
