"""``python -m multitoken.pipeline.cli``: the ``multitoken`` command."""

import sys

from multitoken.pipeline.cli import main

sys.exit(main())
