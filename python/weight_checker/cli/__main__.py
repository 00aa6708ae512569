"""``python -m weight_checker.cli``."""

import sys

from weight_checker.cli.main import main

sys.exit(main())
