"""The plan search: space, acceptance scoring, cost model, the Optuna study, the pipeline.

``python -m selfspec.search`` runs it (:mod:`selfspec.cli.search`).
"""
