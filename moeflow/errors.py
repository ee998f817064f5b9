"""The configuration error every layer of moeflow raises (re-exported by :mod:`moeflow.config`).

It lives in its own module so that the routers, codecs, all-to-all algorithms and schedulers can
raise it without importing :mod:`moeflow.config`, which validates names against their registries
(through :func:`moeflow.registry.registry`); no paper section, plumbing only.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""


__all__ = ["ConfigError"]
