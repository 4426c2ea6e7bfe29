"""``python -m selfspec.search``: the Hydra entry point lives in :mod:`selfspec.cli.search`."""

from selfspec.cli.search import main

main()
