"""`ajet view` in a real headless Chromium (Debian's `chromium`, driven by Playwright's Python API): click from
the run overview to a step, an episode and a sample, and check that trained and untrained tokens render
differently. Skipped, with the reason, when Playwright or Chromium is not installed.

The same click-through writes the README's screenshots:
    python -m tests.test_viewer_browser EXP_DIR docs    # -> docs/viewer-{overview,step,episode,sample,compare}.png
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.viewer_server import running_viewer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _playwright_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install playwright; the browser is Debian's chromium)"
    if CHROMIUM is None:
        return "no Chromium on PATH (apt-get install -y chromium)"
    return None


def tour(base: str, shots: Path) -> dict:
    """Click overview -> step 1 -> its first successful episode -> sample 0 -> back -> compare two episodes,
    saving `shots/viewer-<view>.png` for each; returns what the page showed, for the assertions."""
    from playwright.sync_api import sync_playwright

    seen: dict = {}
    with sync_playwright() as p, tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        # a fresh profile each run (Playwright takes it here instead of --user-data-dir)
        browser = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                       args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 900})
        page = browser.new_page()
        page.set_default_timeout(60_000)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))

        page.goto(base + "/")
        page.wait_for_selector("body[data-view=overview] #steps")
        seen["charts"] = page.locator("#charts svg polyline").count()
        page.screenshot(path=str(shots / "viewer-overview.png"), full_page=True)

        page.locator("a.step-link").first.click()
        page.wait_for_selector("body[data-view=step] #episodes")
        rows = page.locator("#episodes tr:has(a.episode-link)")
        seen["episode_rows"] = rows.count()
        seen["failure_rows"] = page.locator("#episodes tr:has-text('the lookup service is down')").count()
        page.screenshot(path=str(shots / "viewer-step.png"), full_page=True)

        ok_row = page.locator("#episodes tr:has(a.episode-link)").filter(has_not_text="RuntimeError").first
        seen["episode_id"] = ok_row.locator("a.episode-link").inner_text()
        ok_row.locator("a.episode-link").click()
        page.wait_for_selector("body[data-view=episode] a.sample-link")
        seen["tool_message"] = page.locator(".msg.tool").first.inner_text()
        page.screenshot(path=str(shots / "viewer-episode.png"), full_page=True)

        page.locator("a.sample-link").first.click()
        page.wait_for_selector("body[data-view=sample] .tokens")
        trained, untrained = page.locator(".tokens .tok.trained"), page.locator(".tokens .tok.untrained")
        seen["trained"], seen["untrained"] = trained.count(), untrained.count()
        style = "e => { const s = getComputedStyle(e); return [s.color, s.backgroundColor, s.fontWeight]; }"
        seen["trained_style"] = trained.first.evaluate(style)
        seen["untrained_style"] = untrained.first.evaluate(style)
        seen["boundaries"] = page.locator(".tokens .boundary").count()
        trained.nth(2).hover()
        page.wait_for_selector("#tip:not([hidden])")
        seen["tip"] = page.locator("#tip").inner_text()
        page.screenshot(path=str(shots / "viewer-sample.png"))

        page.go_back()
        page.go_back()
        page.wait_for_selector("body[data-view=step] #episodes")
        boxes = page.locator("#episodes tr:has(a.episode-link)").filter(has_not_text="RuntimeError").locator("input[type=checkbox]")
        boxes.nth(0).check()
        boxes.nth(1).check()
        page.get_by_text("compare 2 selected").click()
        page.wait_for_selector("body[data-view=compare] .compare")
        seen["compare_columns"] = page.locator(".compare > div").count()
        seen["compare_token_views"] = page.locator(".compare .tokens").count()
        page.screenshot(path=str(shots / "viewer-compare.png"), full_page=True)
        seen["page_errors"] = errors
        browser.close()
    return seen


@pytest.mark.skipif(_playwright_missing() is not None, reason=_playwright_missing() or "")
def test_click_through_overview_episode_sample_in_chromium(tiny_experiment, tmp_path):
    with running_viewer(tiny_experiment) as base:
        seen = tour(base, tmp_path)
        sample = httpx.get(f"{base}/api/episode/{seen['episode_id']}/sample/0", timeout=60).json()
    assert seen["page_errors"] == []
    assert seen["charts"] >= 5                       # reward, ratios, KL, clip, step time...
    assert seen["episode_rows"] == 6 and seen["failure_rows"] == 3
    assert "TOOL RESULT 42" in seen["tool_message"]
    # one span per token; exactly the loss-mask-1 tokens are drawn as trained, and they look different
    assert seen["trained"] == sum(sample["loss_mask"]) > 0
    assert seen["untrained"] == len(sample["ids"]) - sum(sample["loss_mask"]) > 0
    assert seen["trained_style"] != seen["untrained_style"]
    assert seen["trained_style"][1] != "rgba(0, 0, 0, 0)"   # shaded by its logprob
    assert seen["boundaries"] == 2 * len(sample["calls"])   # where each call starts and where it sampled
    assert "loss mask 1 (trained)" in seen["tip"] and "logprob -" in seen["tip"] and "advantage" in seen["tip"]
    assert seen["compare_columns"] == 2 and seen["compare_token_views"] == 2
    for view in ("overview", "step", "episode", "sample", "compare"):
        assert (tmp_path / f"viewer-{view}.png").stat().st_size > 10_000


if __name__ == "__main__":   # README screenshots: python -m tests.test_viewer_browser EXP_DIR docs
    if len(sys.argv) != 3 or _playwright_missing():
        sys.exit(_playwright_missing() or "usage: python -m tests.test_viewer_browser EXP_DIR OUT_DIR")
    with running_viewer(Path(sys.argv[1])) as url:
        print(tour(url, Path(sys.argv[2])))
