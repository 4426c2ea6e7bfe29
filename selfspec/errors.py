"""User-facing errors.

Everything a user can get wrong (a model name, a plan, a prompt, an argument)
raises :class:`SelfSpecError` with one sentence that says what is wrong and what
to do, instead of a traceback from deep inside torch or transformers.
Entry points catch it and print the message alone.
"""


class SelfSpecError(Exception):
    """A problem the user can fix; the message says how."""


class AssetError(SelfSpecError):
    """A packaged model or dataset could not be fetched, verified or converted."""


class PlanError(SelfSpecError):
    """A skip plan does not fit the model it is used with."""


class RunRefused(SelfSpecError):
    """A run folder or study that holds valid results refused this run (another setting, another writer).

    The folder is left exactly as it was: no ``FAILED`` marker, no rewritten config.
    """
