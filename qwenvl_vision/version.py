"""The package's version: ``__version__`` for the source tree, ``package_version()`` for what is installed."""

from __future__ import annotations

__version__ = "0.1.0"


def package_version() -> str:
    """The installed distribution's version (run.json and the CLI report it), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qwenvl-vision")
    except PackageNotFoundError:
        return __version__
