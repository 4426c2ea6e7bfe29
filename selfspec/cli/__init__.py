"""Entry points: the only modules that import hydra, omegaconf or wandb.

- :mod:`selfspec.cli.search`: ``python -m selfspec.search`` (Hydra, ``conf/search.yaml``)
- :mod:`selfspec.cli.evaluate`: ``python experiments/evaluate.py`` (Hydra, ``conf/evaluate.yaml``)
- :mod:`selfspec.cli.generate`: ``python -m selfspec.generate`` (argparse)
- :mod:`selfspec.cli.tables`: ``python -m selfspec.tables`` (argparse)
- :mod:`selfspec.cli.wandb_logger`: the W&B logger both Hydra entry points use
- :mod:`selfspec.cli.config`: where ``conf/`` is, and configs turned into typed settings
"""
