"""``python -m selfspec.generate``: the entry point lives in :mod:`selfspec.cli.generate`."""

if __name__ == "__main__":
    import sys

    from selfspec.cli.generate import main

    sys.exit(main())
