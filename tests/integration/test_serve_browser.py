"""The live denoising page at GET / in a real headless Chromium (Debian's chromium + chromedriver through
selenium): type a prompt, wait for the final text, check that earlier frames showed masks.

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
        finally:
            browser.quit()
        masked = [f["masked"] for f in frames]
        assert masked[0] == 23 and masked[-1] == 0  # one position per step, masks first
        assert masked == sorted(masked, reverse=True)
        api = httpx.post(srv.url + "/v1/completions", json={"prompt": "12 + 7 =", "max_tokens": 24}).json()
        assert text == api["choices"][0]["text"].strip()  # the page's final text is the model's answer
