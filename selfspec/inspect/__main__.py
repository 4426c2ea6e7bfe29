"""``python -m selfspec.inspect <subcommand>``: see :mod:`selfspec.inspect`."""

import sys

from selfspec.inspect import main

sys.exit(main())
