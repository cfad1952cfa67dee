"""Real browser: `streamlit run app.py` opened in Debian chromium. A user's path through the app:
run the boundary scenario against its control on a tiny model, open it in the inspector, click a
block and a finding, visit every page; a screenshot of each is kept as an artifact."""

from urllib.parse import urlparse

import pytest

from .browser import SKIP_REASON, chromium, new_page, shot, streamlit_app, wait_for_app

pytestmark = [pytest.mark.browser, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]
RUN_TIMEOUT_MS = 240_000


def settle(page, timeout_ms: int = 60_000) -> None:
    """Let the rerun an interaction started begin, then wait for it to finish."""
    page.wait_for_timeout(400)
    wait_for_app(page, timeout_ms=timeout_ms)


def no_exception(page) -> None:
    exceptions = page.locator('[data-testid="stException"]')
    assert exceptions.count() == 0, exceptions.first.inner_text()


def choose(page, key: str, option: str) -> None:
    """Pick an option of the selectbox with this key."""
    page.locator(f".st-key-{key} [role='combobox']").click()
    page.get_by_role("option", name=option).first.click()
    settle(page)


def click_point(page, selector: str) -> None:
    """Click where a plotly marker is drawn (plotly listens on the layer above the markers)."""
    box = page.locator(selector).first.bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)


def test_home_page_renders_in_chromium(tmp_path):
    with streamlit_app(tmp_path / "kvviz.duckdb") as url, chromium() as browser:
        page = new_page(browser)
        page.goto(url)
        wait_for_app(page)
        assert "kvviz" in page.title()
        no_exception(page)
        assert page.get_by_text("No runs yet").count() == 1
        shot(page, "home-empty")


def test_boundary_scenario_inspected_in_chromium(tmp_path):
    with streamlit_app(tmp_path / "kvviz.duckdb") as url, chromium() as browser:
        page = new_page(browser)
        hosts = set()
        page.on("request", lambda r: hosts.add(urlparse(r.url).hostname))
        page.set_viewport_size({"width": 1400, "height": 1600})
        page.goto(f"{url}/scenarios")
        wait_for_app(page)
        choose(page, "sc_name", "boundary: Boundary leak")
        choose(page, "sc_model", "tiny-llama")
        page.get_by_role("button", name="Run it with its control").click()
        page.get_by_text("Side by side").wait_for(timeout=RUN_TIMEOUT_MS)
        settle(page)
        no_exception(page)
        assert page.get_by_text("the detector fired").count() == 1
        assert page.get_by_text("clean", exact=True).count() == 1
        shot(page, "scenarios-boundary")

        page.locator(".st-key-sc_open_scenario button").click()
        page.get_by_role("heading", name="Inspector").wait_for()
        settle(page)
        no_exception(page)
        shot(page, "inspector-blocks")

        click_point(page, ".st-key-insp_blockmap .scatterlayer path.point")
        page.get_by_text("Referenced by").wait_for()
        settle(page)
        no_exception(page)
        shot(page, "inspector-block-clicked")

        page.locator(".st-key-insp_view").get_by_role("radio", name="Leaks").click()
        settle(page)
        grid = page.locator(".st-key-insp_findings [data-testid='stDataFrameResizable']")
        box = grid.bounding_box()
        page.mouse.click(box["x"] + 12, box["y"] + 35 + 17)  # the first finding's row selector
        page.get_by_text("foreign + stale mass up to").wait_for()
        settle(page)
        no_exception(page)
        shot(page, "inspector-finding-attention")

        page.goto(f"{url}/sql")
        wait_for_app(page)
        page.locator(".st-key-sql_text textarea").click()
        page.keyboard.press("Control+Enter")  # runs the default query
        page.get_by_text("2 rows").wait_for()
        settle(page)
        no_exception(page)
        shot(page, "sql")

        for name in ("runs", "upload", "run", ""):
            page.goto(f"{url}/{name}")
            wait_for_app(page)
            no_exception(page)
            shot(page, name or "home")
        assert hosts - {None} <= {"127.0.0.1"}, f"the app fetched from {hosts}: it must work offline"
