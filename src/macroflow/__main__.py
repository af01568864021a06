"""``python -m macroflow`` is the ``macroflow`` command."""

import sys

from .cli import main

sys.exit(main())
