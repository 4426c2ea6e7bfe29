"""``python -m selfspec.tables``: the entry point lives in :mod:`selfspec.cli.tables`."""

if __name__ == "__main__":
    import sys

    from selfspec.cli.tables import main

    sys.exit(main())
