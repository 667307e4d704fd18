"""``python -m experiments.health_corpus`` (from the repository root): see README.md."""

import sys

from experiments.health_corpus.cli import main

sys.exit(main())
