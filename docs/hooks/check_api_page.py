"""A mkdocs hook (mkdocs.yml `hooks:`): the rendered API reference shows only names a user can import and no
private parameters. Each finding is a warning, which `mkdocs build --strict` (CI's docs build) turns into a failure."""

from __future__ import annotations

import html
import logging
import re

log = logging.getLogger("mkdocs.hooks.check_api_page")


def on_post_page(output: str, page, config) -> str:
    if page.file.src_uri != "api.md":
        return output
    headings = re.findall(r'<h\d id="([\w.]+)" class="doc doc-heading"', output)
    outside = sorted({h for h in headings if not h.startswith("ajet.")})
    if outside:
        log.warning("api.md renders names outside the installed `ajet` package: %s", outside)
    signatures = re.findall(r'<div class="doc-signature[^"]*">(.*?)</div>', output, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", "", "".join(signatures)))
    private = sorted(set(re.findall(r"[(,]\s*(_[A-Za-z]\w*)\s*[:=,)]", text)))
    if private:
        log.warning("api.md renders private parameters in signatures: %s", private)
    if not headings or not signatures:
        log.warning("api.md: no rendered entries found (the check's patterns no longer match the page)")
    return output
