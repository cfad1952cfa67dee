"""Real-browser smoke test: the Streamlit app served by `streamlit run`, opened in Debian chromium."""

import pytest

from .browser import SKIP_REASON, chromium, new_page, shot, streamlit_app, wait_for_app

pytestmark = [pytest.mark.browser, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]


def test_home_page_renders_in_chromium(tmp_path):
    with streamlit_app(tmp_path / "kvviz.duckdb") as url, chromium() as browser:
        page = new_page(browser)
        page.goto(url)
        wait_for_app(page)
        assert "kvviz" in page.title()
        exceptions = page.locator('[data-testid="stException"]')
        assert exceptions.count() == 0, exceptions.first.inner_text()
        path = shot(page, "home")
        assert path.stat().st_size > 0
