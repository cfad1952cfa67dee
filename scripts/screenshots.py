"""Regenerate the README's screenshots: the boundary scenario and its control on SmolLM2, opened in
the inspector, in Debian chromium. `python scripts/screenshots.py [OUT_DIR]` (default docs/images)."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.browser import chromium, new_page, streamlit_app, wait_for_app  # noqa: E402


def settle(page) -> None:
    page.wait_for_timeout(500)
    wait_for_app(page, timeout_ms=600_000)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, streamlit_app(Path(tmp) / "kvviz.duckdb") as url, \
            chromium() as browser:
        page = new_page(browser, timeout_ms=600_000)
        page.set_viewport_size({"width": 1400, "height": 1250})

        def shot(name: str) -> None:
            page.screenshot(path=str(out / f"{name}.png"))
            print(out / f"{name}.png")

        page.goto(f"{url}/scenarios")
        wait_for_app(page)
        page.locator(".st-key-sc_name [role='combobox']").click()
        page.get_by_role("option", name="boundary: Boundary leak").click()
        settle(page)
        page.get_by_role("button", name="Run it with its control").click()
        page.get_by_text("Side by side").wait_for()
        settle(page)
        page.get_by_text("Side by side").scroll_into_view_if_needed()
        shot("scenarios")
        page.locator(".st-key-sc_open_scenario button").click()
        settle(page)
        box = page.locator(".st-key-insp_blockmap .scatterlayer path.point").first.bounding_box()
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.get_by_text("Referenced by").wait_for()
        settle(page)
        shot("inspector-blocks")
        page.locator(".st-key-insp_view").get_by_role("radio", name="Leaks").click()
        settle(page)
        shot("inspector-leaks")
        grid = page.locator(".st-key-insp_findings [data-testid='stDataFrameResizable']").bounding_box()
        page.mouse.click(grid["x"] + 12, grid["y"] + 35 + 17)
        page.get_by_text("foreign + stale mass up to").wait_for()
        settle(page)
        page.locator(".st-key-insp_view").scroll_into_view_if_needed()
        shot("inspector-attention")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/images"))
