"""Fixtures of the modules that start a ``kvtier serve``: each defines its own ``server`` (a base
URL, the flags its tests need); these give the official client and the served model's name."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI  # (here: the GPU machines run this folder's engine tests without it)

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
