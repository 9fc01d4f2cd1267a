import sys

from lossbeat.cli import main

sys.exit(main())
