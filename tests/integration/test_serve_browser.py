"""The live denoising page at GET / in a real headless Chromium (Debian's chromium + chromedriver through
selenium): type a prompt, wait for the final text, check that earlier frames showed masks, that the page
shows the prompt it sent, marks spaces, clears old output on an error, and loads with no failed resource
(its favicon included).

Set DLLM_SERVE_SCREENSHOTS=DIR to save the page mid-denoise and at the end (docs/img/serve-*.png)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
webdriver = pytest.importorskip("selenium.webdriver")

from tests.integration.serve_support import make_server  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def _driver():
    from selenium.webdriver.chrome.service import Service

    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=960,560"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: failed loads (a 404) show there
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)


def test_page_shows_masks_turning_into_tokens():
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    shots = os.environ.get("DLLM_SERVE_SCREENSHOTS")
    with make_server(max_batch=4, max_wait_ms=5) as srv:
        browser = _driver()
        try:
            browser.get(srv.url + "/")
            WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "model").text == "tiny")
            assert browser.find_element(By.ID, "policy").is_displayed()  # a diffusion model's server reads it
            browser.find_element(By.ID, "prompt").send_keys("12 + 7 =")
            box = browser.find_element(By.ID, "max_tokens")
            box.clear()
            box.send_keys("24")
            browser.find_element(By.ID, "go").click()
            if shots:  # the replay shows one frame per 60 ms: catch one halfway
                WebDriverWait(browser, 10).until(lambda b: b.execute_script("return window.dllmFrames.length") >= 12)
                browser.save_screenshot(str(Path(shots) / "serve-mid.png"))
            final = browser.find_element(By.ID, "final")
            WebDriverWait(browser, 15).until(lambda b: final.get_attribute("data-done") == "1")
            if shots:
                browser.save_screenshot(str(Path(shots) / "serve-end.png"))
            frames = browser.execute_script("return window.dllmFrames")
            text = final.text
            assert browser.find_element(By.ID, "error").text == ""
            assert "NFE 24" in browser.find_element(By.ID, "stats").text
            sent = browser.find_element(By.ID, "sent")
            assert sent.text == "12 + 7 =" and sent.get_attribute("data-kind") == "prompt"
            failed = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
            assert not failed, failed  # no resource failed to load: the favicon is served
            _spaces_are_visible(browser)
            _an_error_clears_the_old_output(browser)
        finally:
            browser.quit()
        masked = [f["masked"] for f in frames]
        assert masked[0] == 23 and masked[-1] == 0  # one position per step, masks first
        assert masked == sorted(masked, reverse=True)
        api = httpx.post(srv.url + "/v1/completions", json={"prompt": "12 + 7 =", "max_tokens": 24}).json()
        assert text == api["choices"][0]["text"].strip()  # the page's final text is the model's answer


def _spaces_are_visible(browser) -> None:
    """The final text keeps every space (pre-wrap) and marks the leading and trailing ones; canvas tokens
    show a space as a middle dot and keep the exact text in their title."""
    marked = browser.execute_script(
        "const el = document.getElementById('final'); showText(el, '  a  b \\n');"
        "return [el.textContent, Array.from(el.querySelectorAll('.edge-space')).map(s => s.textContent),"
        " getComputedStyle(el).whiteSpace]"
    )
    assert marked == ["  a  b \n", ["  ", " \n"], "pre-wrap"]
    tokens = browser.execute_script(
        "render([' the', '\\n', null, 'x'], null); const c = document.getElementById('canvas');"
        "return Array.from(c.children).map(s => [s.className, s.textContent, s.title])"
    )
    assert tokens == [["tok", "\u00b7the", '" the"'], ["tok", "\u21b5\n", '"\\n"'], ["mask", "", "masked"],
                      ["tok", "x", '"x"']]  # fmt: skip


def _an_error_clears_the_old_output(browser) -> None:
    """A request the server refuses (more tokens than the model has positions): the error shows, the
    previous canvas, text and counters go, and the prompt shown is the one just sent."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.execute_script("showText(document.getElementById('final'), 'old'); render(['o', 'l', 'd'], null)")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(" too long ")
    box = browser.find_element(By.ID, "max_tokens")
    box.clear()
    box.send_keys("500")
    browser.find_element(By.ID, "go").click()
    error = browser.find_element(By.ID, "error")
    WebDriverWait(browser, 10).until(lambda b: error.text != "")
    assert "max_tokens" in error.text
    assert browser.find_element(By.ID, "canvas").text == "" and browser.find_element(By.ID, "final").text == ""
    assert browser.find_element(By.ID, "final").get_attribute("data-done") == "0"
    assert "step 0" in browser.find_element(By.ID, "stats").text
    sent = browser.execute_script("return document.getElementById('sent').textContent")
    assert sent == " too long "


@pytest.mark.parametrize("draft", [False, True], ids=["ar", "draft"])
def test_page_sends_only_what_a_causal_server_reads(draft: bool):
    """On a causal model's server (`dllm serve --ar`, or `--draft`) Generate failed every time: the page always
    sent a policy, which that server refuses. The model card lists what the server reads; the page hides the
    policy and steps controls and sends neither, and shows the model's answer."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from dllm.serving.server import BackgroundServer, make_state
    from tests.distributed.harness import free_port
    from tests.integration.serve_support import tiny_loaded
    from tests.integration.test_serve_causal import causal_base, random_drafter

    loaded = tiny_loaded()
    drafter = random_drafter(loaded) if draft else None
    state = make_state(loaded, causal_base(loaded), model_id="tiny-ar", drafter=drafter)
    with BackgroundServer(state, port=free_port()) as srv:
        card = httpx.get(srv.url + "/v1/models").json()["data"][0]["dllm"]
        assert card["generation"] == "causal" and "policy" not in card["fields"] and "steps" not in card["fields"]
        browser = _driver()
        try:
            browser.get(srv.url + "/")
            WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "model").text == "tiny-ar")
            assert not browser.find_element(By.ID, "policy").is_displayed()
            assert not browser.find_element(By.ID, "steps").is_displayed()
            browser.find_element(By.ID, "prompt").send_keys("12 + 7 =")
            box = browser.find_element(By.ID, "max_tokens")
            box.clear()
            box.send_keys("8")
            browser.find_element(By.ID, "go").click()
            final = browser.find_element(By.ID, "final")
            WebDriverWait(browser, 15).until(lambda b: final.get_attribute("data-done") == "1" or
                                             b.find_element(By.ID, "error").text)  # fmt: skip
            assert browser.find_element(By.ID, "error").text == ""
            text = final.text
        finally:
            browser.quit()
        api = httpx.post(srv.url + "/v1/completions", json={"prompt": "12 + 7 =", "max_tokens": 8}).json()
        assert text == api["choices"][0]["text"].strip()


def test_page_icon_and_assets_are_served():
    """Without a browser: the page links its icon, the icon is served where browsers look for it, and the
    page's script has the helpers the browser test drives."""
    from fastapi.testclient import TestClient

    from dllm.serving.app import build_app

    with TestClient(build_app(make_server().state)) as http:
        page = http.get("/").text
        assert '<link rel="icon" href="/favicon.ico"' in page and 'id="sent"' in page
        icon = http.get("/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
        assert icon.text.startswith("<svg")
        script = http.get("/static/app.js").text
        assert all(f"function {name}(" in script for name in ("showText", "clearOutput", "render"))
        assert "white-space: pre-wrap" in http.get("/static/style.css").text
