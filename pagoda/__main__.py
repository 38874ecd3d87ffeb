"""python -m pagoda: the `pagoda` command line (pagoda.client.cli)."""

import sys

from pagoda.client.cli import main

sys.exit(main())
