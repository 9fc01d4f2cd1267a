"""``python -m lossbeat``: the ``lossbeat`` command."""

import sys

from lossbeat.cli import main

sys.exit(main())
