"""The transformers version kvtier's integration needs, checked before anything imports it."""

from __future__ import annotations

import importlib.metadata

#: oldest transformers whose Cache is a list of CacheLayerMixin layers
MIN_TRANSFORMERS = (5, 0)


class TransformersVersionError(ImportError):
    """The installed transformers is missing or older than :data:`MIN_TRANSFORMERS`."""


def _parse(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        raise TransformersVersionError(f"cannot read the transformers version {version!r}") from None


def require_transformers(version: str | None = None) -> str:
    """Return the installed transformers version, or raise :class:`TransformersVersionError`.

    ``version`` overrides the installed one (for checking a given string).
    """
    need = ".".join(map(str, MIN_TRANSFORMERS))
    if version is None:
        try:
            version = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            raise TransformersVersionError(
                f"kvtier.integrations.hf needs transformers>={need}, which is not installed; "
                "install it with: pip install 'kvtier[hf]'"
            ) from None
    if _parse(version) < MIN_TRANSFORMERS:
        raise TransformersVersionError(
            f"kvtier.integrations.hf needs transformers>={need} (the CacheLayerMixin cache API), "
            f"found {version}; upgrade with: pip install -U 'transformers>={need}'"
        )
    return version
