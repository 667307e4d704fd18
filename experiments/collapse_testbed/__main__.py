"""``python -m experiments.collapse_testbed`` (from the repository root): see README.md."""

import sys

from experiments.collapse_testbed.cli import main

sys.exit(main())
