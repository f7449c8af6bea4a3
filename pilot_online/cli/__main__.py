"""``python -m pilot_online.cli``."""

import sys

from .main import main

sys.exit(main())
