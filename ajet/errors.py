"""ajet's error types. Each message says what is wrong and what to change."""


class AjetError(Exception):
    """Base class: the CLI prints these without a traceback and exits with status 2."""


class ConfigError(AjetError, ValueError):
    """The config file is missing, unreadable, or has an unknown key / wrong type / bad value."""


class BackboneUnavailable(AjetError, ImportError):
    """The chosen backbone's optional dependencies are not installed (the message names the extra)."""


class WorkflowLoadError(AjetError, ImportError):
    """The `workflow:` or `judge:` entry does not name an importable object."""
