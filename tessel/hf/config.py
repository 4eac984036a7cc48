"""A config.json's dict as transformers' own configuration object: the one place tessel builds one.

Its model_type names the configuration class (transformers' AutoConfig); every other key is that class's
keyword. The dict is not changed.
"""

from __future__ import annotations


def transformers_config(doc: dict):
    """transformers' configuration object for `doc` (a config.json read as a dict, model_type included)."""
    from transformers import AutoConfig  # deferred: transformers loads torch (seconds)
    rest = dict(doc)
    return AutoConfig.for_model(rest.pop("model_type"), **rest)
