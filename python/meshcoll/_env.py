"""Kept for the compiled module alone: csrc/python/bind_config.cc imports
``meshcoll._env.core_config_from_env`` when ``_C`` is imported (Note [Configuration] in
csrc/common/config.h). The settings live in _settings.py, the launchers' variables in
_rendezvous.py; import from those."""

from ._settings import core_config_from_env

__all__ = ["core_config_from_env"]
