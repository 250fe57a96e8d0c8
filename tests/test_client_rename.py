"""`ajet.client.EpisodeHandle` (a served episode's handle) is the name of what the clients hand out; the name it had,
`ajet.client.Episode` (clashing with `ajet.episode.Episode`, the record), still works for one release, with a
DeprecationWarning, and is the same class."""

from __future__ import annotations

import asyncio
import warnings

import pytest

import ajet.client
import ajet.episode
from ajet.client import AjetClient, AsyncAjetClient, AsyncEpisodeHandle, EpisodeHandle
from tests.test_serve_api import SECRET, served


@pytest.mark.parametrize("old, new", [("Episode", EpisodeHandle), ("AsyncEpisode", AsyncEpisodeHandle)])
def test_the_old_names_warn_and_are_the_new_classes(old, new):
    with pytest.warns(DeprecationWarning, match=rf"ajet.client.{old} is renamed ajet.client.{new.__name__}"):
        assert getattr(ajet.client, old) is new
    with pytest.warns(DeprecationWarning, match=new.__name__):
        exec(f"from ajet.client import {old}", {})       # `from ... import` goes through the module's __getattr__
    assert new is not ajet.episode.Episode


def test_the_new_names_do_not_warn_and_other_names_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ajet.client.EpisodeHandle is EpisodeHandle and ajet.client.AsyncEpisodeHandle is AsyncEpisodeHandle
    with pytest.raises(AttributeError, match="has no attribute 'Episod'"):
        ajet.client.Episod   # noqa: B018


def test_served_episodes_are_handles_old_isinstance_checks_still_hold(tokenizer):
    with served(tokenizer) as (_queue, http, stored):
        client = AjetClient(str(http.base_url), secret=SECRET)
        with client.episode() as ep:
            assert type(ep) is EpisodeHandle
            with pytest.warns(DeprecationWarning):
                assert isinstance(ep, ajet.client.Episode)      # code written against the old name keeps working
            ep.finish(reward=1.0)
        client.close()

        async def one_async() -> type:
            async with AsyncAjetClient(str(http.base_url), secret=SECRET) as aclient:
                async with aclient.episode() as aep:
                    await aep.finish(reward=0.5)
                    return type(aep)

        assert asyncio.run(one_async()) is AsyncEpisodeHandle
        assert [e.reward for e in stored] == [1.0, 0.5]
