"""``python -m experiments.tools_testbed`` (from the repository root): see README.md."""

import sys

from experiments.tools_testbed.cli import main

sys.exit(main())
