"""One TLS context for the OpenAI clients ajet builds for each episode.

`openai.AsyncOpenAI(...)` builds an httpx client, and httpx builds a TLS context for it: `ssl.create_default_context`
plus loading certifi's CA bundle, 20-60 ms of CPU on the 2-core machine (more under load) for every client, whether
or not it ever speaks TLS. ajet builds one client per episode (`Tuner.client`, `EpisodeHandle.openai`, `LLMJudge`):
hundreds per run, nearly all to the plain-HTTP proxy on 127.0.0.1. The clients built here share one context, made on
first use with httpx's defaults (certifi's bundle; `SSL_CERT_FILE` / `SSL_CERT_DIR` when set), so a client that
does reach an https URL verifies certificates and host names exactly as before. An `ssl.SSLContext` may be shared by
any number of connections, threads and event loops.
"""

from __future__ import annotations

import functools
import ssl


@functools.lru_cache(maxsize=1)
def shared_ssl_context() -> ssl.SSLContext:
    """The process's TLS context for ajet's per-episode clients (built once; httpx's defaults)."""
    import httpx

    return httpx.create_ssl_context()


def openai_http_client(asynchronous: bool = True):
    """A fresh `openai.DefaultAsyncHttpxClient` (or `DefaultHttpxClient` when `asynchronous` is False): the
    timeouts, connection limits and redirects the OpenAI SDK uses by default, with the shared TLS context."""
    from openai import DefaultAsyncHttpxClient, DefaultHttpxClient

    return (DefaultAsyncHttpxClient if asynchronous else DefaultHttpxClient)(verify=shared_ssl_context())
