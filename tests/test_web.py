"""The web page at / (api/web/), driven in Debian's headless Chromium through Playwright, against
`mfsreg serve`'s app in a thread on the embedded default; its headers, sign-in and refusals also
through httpx. Screenshots of each page at 1280 px and at a phone's width land in
test-artifacts/screenshots/ (ignored by git)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import synth
from tests.cli_run import mfsreg
from tests.server import Server, embedded_server_env, token

pytestmark = pytest.mark.browser

SHOTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "screenshots"
VIEWPORTS = {"1280": {"width": 1280, "height": 900}, "phone": {"width": 390, "height": 844}}
PARENTS = {"base": None, "lora-chat": "base", "last-code": "base", "full-med": "base", "vocab-ext": "lora-chat"}


def chromium() -> str:
    """Debian's chromium (.ci/run installs it); MFSREG_TEST_CHROMIUM names another build."""
    path = os.environ.get("MFSREG_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("no chromium: `apt-get install -y chromium` (or set MFSREG_TEST_CHROMIUM to a Chromium binary)")
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A server holding family qwen (five members, lineage, tag prod) and family beta (one), with
    read tokens for every family, for beta* and for zz* (no family)."""
    from mfsreg.registry.config import Settings
    from mfsreg.registry.meta import VersionMeta
    from mfsreg.registry.registry import Registry

    where = tmp_path_factory.mktemp("web")
    env = embedded_server_env(where / "home")
    files = synth.family(where / "models")
    with Registry(Settings.from_env(env)) as reg:
        for name, path in files.items():
            reg.push(path, "qwen", name, parent=PARENTS[name], meta=VersionMeta(f"{name} of qwen", {"stage": "rc"}))
        reg.push(files["base"], "beta", "b1")
        reg.tag_set("qwen", "prod", "lora-chat")
        stats = reg.stats("qwen")
    srv = Server(env, where / "server.log")
    try:
        yield dict(
            srv=srv,
            env=env,
            stats=stats,
            all=token(env, "read", "*"),
            beta=token(env, "read", "beta*"),
            none=token(env, "read", "zz*"),
        )
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


class Visit:
    """A browser context at one viewport that records every request and console message."""

    def __init__(self, browser, site, viewport: str):
        self.url = site["srv"].url
        self.ctx = browser.new_context(viewport=VIEWPORTS[viewport], permissions=["clipboard-read", "clipboard-write"])
        self.ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=self.url)
        self.page = self.ctx.new_page()
        self.page.set_default_timeout(15_000)
        self.requests: list[str] = []
        self.console: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.viewport = viewport

    def sign_in(self, tok: str) -> None:
        self.page.goto(self.url + "/")
        assert self.page.url.startswith(self.url + "/ui/login")
        self.page.fill("#token", tok)
        self.page.click("#sign-in-button")
        self.page.wait_for_url(self.url + "/")

    def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}-{self.viewport}.png"), full_page=True)

    def close(self, refusals: int = 0) -> None:
        """``refusals``: pages opened that answer 4xx on purpose (Chromium logs each as an error)."""
        self.ctx.close()
        outside = [u for u in self.requests if not u.startswith(self.url + "/")]
        assert not outside, f"the page asked for something outside the server: {outside}"
        errors = [m for m in self.console if m.startswith("error")]
        refused = [m for m in errors if "Failed to load resource: the server responded with a status of 4" in m]
        assert len(refused) == refusals, errors
        errors = [m for m in errors if m not in refused]
        assert not errors, errors  # a Content-Security-Policy refusal is logged as an error


@pytest.mark.parametrize("viewport", list(VIEWPORTS))
def test_sign_in_open_a_family_and_a_version_and_copy_its_pull_command(browser, site, viewport):
    from mfsreg.registry.wording import in_words

    v = Visit(browser, site, viewport)
    v.page.goto(v.url + "/")
    v.shot("login")
    v.sign_in(site["all"])
    assert v.page.locator("#families tbody tr").all_inner_texts()[0].startswith("beta")
    qwen_row = v.page.locator("#families tbody tr", has_text="qwen").inner_text()
    assert "5" in qwen_row and "prod → lora-chat" in qwen_row and "latest → vocab-ext" in qwen_row
    v.shot("families")

    v.page.click("#families >> text=qwen")
    v.page.wait_for_url(v.url + "/ui/families/qwen")
    # one bar per version, in push order, each with the words `mfsreg stats` prints for it
    bars = v.page.locator("#bars li.version")
    assert bars.count() == 5
    words = {x["version"]: in_words(x["shares"]) for x in site["stats"]["versions"]}
    for i, name in enumerate(PARENTS):
        item = bars.nth(i)
        assert item.get_attribute("data-version") == name
        assert item.locator("p.words").inner_text() == words[name]
        assert item.locator("svg.bar rect:not(.track)").count() >= 1
    # lora-chat is all base and group; full-med's bar is deltas only in this version
    assert bars.nth(1).locator("rect.base").count() == 1
    assert bars.nth(3).locator("rect.deltas").count() == 1 and bars.nth(3).locator("rect.base").count() == 0
    # the tiers' totals, the lineage tree (vocab-ext under lora-chat under base) and the matrix
    tiers = v.page.locator("#tiers tbody tr").all_inner_texts()
    assert [t.split()[0] for t in tiers] == ["base", "group", "unique"]

    def children(name: str) -> list[str]:
        return v.page.locator(f'#lineage li:has(> a[href$="/versions/{name}"]) > ul > li > a').all_inner_texts()

    assert v.page.locator("#lineage .tree > ul > li > a").all_inner_texts() == ["base"]  # the one root
    assert children("base") == ["lora-chat", "last-code", "full-med"] and children("lora-chat") == ["vocab-ext"]
    cells = v.page.locator("#matrix table.heat tbody td")
    assert cells.count() == 25
    assert [cells.nth(i * 6).inner_text() for i in range(5)] == ["100%"] * 5  # the diagonal
    v.shot("family")

    v.page.click("#bars >> text=lora-chat")
    v.page.wait_for_url(v.url + "/ui/families/qwen/versions/lora-chat")
    assert v.page.locator("#version-name").inner_text() == "lora-chat"
    body = v.page.locator("main").inner_text()
    assert "prod" in body and "stage=rc" in body and "lora-chat of qwen" in body and "base" in body
    assert v.page.locator("#files tbody tr").count() == 1
    pre = v.page.locator("#pull-cli").inner_text()
    assert f"MFSREG_URL={v.url}" in pre and "mfsreg pull qwen lora-chat -o ./lora-chat.safetensors" in pre
    v.page.click("#copy-pull-cli")
    v.page.wait_for_function("document.getElementById('copy-pull-cli').textContent === 'Copied'")
    assert v.page.evaluate("navigator.clipboard.readText()") == pre
    assert f"HF_ENDPOINT={v.url}" in v.page.locator("#pull-hub").inner_text()
    v.shot("version")

    v.page.click("#sign-out")
    v.page.wait_for_url(re.compile(r".*/ui/login$"))
    v.page.goto(v.url + "/ui/families/qwen")
    assert "/ui/login" in v.page.url  # signed out: the cookie is gone
    v.close()


def test_a_token_for_other_families_sees_none_of_them(browser, site):
    v = Visit(browser, site, "1280")
    v.sign_in(site["none"])
    assert v.page.locator("#no-families").is_visible()
    assert "zz*" in v.page.locator("#no-families").inner_text()
    assert "qwen" not in v.page.locator("main").inner_text()
    for path in ("/ui/families/qwen", "/ui/families/qwen/versions/base", "/ui/families/nosuch"):
        answer = v.page.goto(v.url + path)
        assert answer.status == 403  # whether or not the family exists: nothing told
        assert "limited to families matching 'zz*'" in v.page.locator("#message").inner_text()
    v.shot("refused")
    v.close(refusals=3)

    v = Visit(browser, site, "1280")
    v.sign_in(site["beta"])
    assert v.page.locator("#families tbody tr").all_inner_texts()[0].startswith("beta")
    assert v.page.locator("#families tbody tr").count() == 1
    assert v.page.goto(v.url + "/ui/families/qwen").status == 403
    v.close(refusals=1)


def _client(site, tok: str | None = None) -> httpx.Client:
    cookies = {"mfsreg_session": tok} if tok else None
    return httpx.Client(base_url=site["srv"].url, cookies=cookies, follow_redirects=False, timeout=30)


def test_every_answer_carries_the_security_headers_and_no_inline_script_or_style(site):
    with _client(site, site["all"]) as c:
        for path in ("/", "/ui/families/qwen", "/ui/families/qwen/versions/prod", "/ui/login", "/ui/assets/mfsreg.css"):
            r = c.get(path)
            assert r.status_code == 200, (path, r.text[:200])
            csp = r.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
            assert r.headers["x-frame-options"] == "DENY"
            if r.headers["content-type"].startswith("text/html"):
                assert not re.search(r"<script(?![^>]*\bsrc=)", r.text), path  # every script is a file
                assert not re.search(r"\sstyle=|<style|\son[a-z]+=", r.text), path  # no inline style or handler
        # a tag names its version: the page is the version's
        assert '<h1 id="version-name">lora-chat</h1>' in c.get("/ui/families/qwen/versions/prod").text


def test_sign_in_sets_an_httponly_strict_cookie_and_refuses_bad_tokens(site):
    with _client(site) as c:
        assert c.get("/").headers["location"] == "/ui/login?next=/"
        r = c.post("/ui/login", data={"token": site["beta"], "next": "/ui/families/beta"})
        assert r.status_code == 303 and r.headers["location"] == "/ui/families/beta"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
        # another site's page as the next hop: home instead
        r = c.post("/ui/login", data={"token": site["beta"], "next": "//evil.example/x"})
        assert r.headers["location"] == "/"
        for form, status, said in (
            ({"token": "mfs_not-a-token"}, 401, "unknown or revoked token"),
            ({"token": ""}, 400, "no token given"),
            ({"token": "x" * 5000}, 413, "over the 4096 byte limit: paste the token alone"),  # refused unread
        ):
            r = c.post("/ui/login", data=form)
            assert r.status_code == status and said in r.text and "set-cookie" not in r.headers
        # a body of no stated length is read only up to the limit
        r = c.post("/ui/login", content=iter([b"token=" + b"x" * 4096] * 64))
        assert r.status_code == 413 and "set-cookie" not in r.headers
        r = c.post("/ui/login", data={"token": site["beta"]}, headers={"Origin": "http://evil.example"})
        assert r.status_code == 400 and "another site" in r.text and "set-cookie" not in r.headers
        r = c.post("/ui/logout", headers={"Origin": "http://evil.example"})
        assert r.status_code == 400 and "another site" in r.text and "set-cookie" not in r.headers
        # behind a TLS proxy: the page's origin is the proxy's host, said in X-Forwarded-Host, and
        # the cookie is Secure where the proxy says the browser came over https
        proxied = {"Origin": "https://registry.example", "X-Forwarded-Host": "registry.example"}
        r = c.post("/ui/login", data={"token": site["beta"]}, headers={**proxied, "X-Forwarded-Proto": "https"})
        assert r.status_code == 303 and "secure" in r.headers["set-cookie"].lower()
        r = c.post("/ui/login", data={"token": site["beta"]})
        assert r.status_code == 303 and "secure" not in r.headers["set-cookie"].lower()  # plain http
        # next hops that would leave the server land on the home page
        for hop in ("//evil.example", "/\\evil.example", "https://evil.example", "https:evil", "evil"):
            r = c.post("/ui/login", data={"token": site["beta"], "next": hop})
            assert r.headers["location"] == "/", hop
    # a cookie whose token was revoked: back to sign-in, told why, the cookie dropped
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    gone = token(site["env"], "read", "qwen*")
    with Registry(Settings.from_env(site["env"], blobs=False)) as reg:
        from mfsreg.registry.auth import revoke_token

        revoke_token(reg.engine, gone[:10])
    with _client(site, gone) as c:
        r = c.get("/ui/families/qwen")
        assert r.status_code == 303 and "expired=1" in r.headers["location"]
        assert 'mfsreg_session=""' in r.headers["set-cookie"] or "max-age=0" in r.headers["set-cookie"].lower()
        assert "no longer valid" in c.get(r.headers["location"]).text


def test_anonymous_reads_only_where_the_server_opens_them(site, tmp_path):
    with _client(site) as c:
        assert c.get("/ui/families/qwen").status_code == 303
    srv = Server({**site["env"], "MFSREG_ANONYMOUS_READ": "1"}, tmp_path / "server.log")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.get("/")
            assert r.status_code == 200 and "qwen" in r.text and "anonymous reader" in r.text
            assert c.get("/ui/families/qwen/versions/base").status_code == 200
            assert "browse without a token" in c.get("/ui/login").text
    finally:
        srv.stop()


def test_stats_prints_the_words_the_page_shows(site):
    from mfsreg.registry.wording import in_words

    out = mfsreg("stats", "-f", "qwen", env=site["env"]).stdout
    for v in site["stats"]["versions"]:
        assert f"{v['version']} (" in out and in_words(v["shares"]) in out
    assert "esubn" not in out and "zstd" not in out  # encodings only under --verbose
    verbose = mfsreg("stats", "-f", "qwen", "--verbose", env=site["env"]).stdout
    assert "encodings" in verbose and "alone holds" in verbose
    full = next(v for v in site["stats"]["versions"] if v["version"] == "full-med")["shares"]
    # a dense fine-tune stored as deltas against base shares none of its bytes: all its tensors'
    # bytes are stored as deltas, its header alone plain
    assert full["base"]["bytes"] == 0 and 0.99 * full["unique"]["bytes"] < full["unique"]["delta_bytes"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.text(min_size=1, max_size=40), version=st.text(min_size=1, max_size=40))
def test_any_path_is_a_page_or_a_refusal_never_a_failure(site, family, version):
    with _client(site, site["all"]) as c:
        for path in (f"/ui/families/{quote(family, safe='')}", f"/ui/families/qwen/versions/{quote(version, safe='')}"):
            r = c.get(path)
            # a page, a refusal in one line, or a redirect: a name of '.' or '..' (308), a trailing
            # slash (307, Starlette's redirect_slashes)
            assert r.status_code in (200, 307, 308, 400, 404), (path, r.status_code, r.text[:300])
            assert "Traceback" not in r.text and "sqlalchemy" not in r.text.lower()


def test_the_family_list_gives_each_family_the_figures_stats_gives(site):
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    with Registry(Settings.from_env(site["env"], blobs=False)) as reg:
        summaries = {s["family"]: s for s in reg.family_summaries()}
        assert set(summaries) == {"qwen", "beta"}
        for name, s in summaries.items():
            full = reg.stats(name)
            assert (s["versions_count"], s["logical_bytes"], s["stored_bytes"], s["sharing_ratio"]) == (
                full["versions_count"],
                full["logical_bytes"],
                full["stored_bytes"],
                full["sharing_ratio"],
            )
    # beta's one version is qwen's base: its chunks count for both families
    assert summaries["beta"]["stored_bytes"] > 0 and summaries["qwen"]["versions_count"] == 5


def test_the_pages_assets_leave_the_hub_paths_of_a_family_named_ui_alone(tmp_path):
    """The assets are served by a route of one path segment, not a mount at /ui/assets, which would
    take the Hub's downloads of family 'ui', version 'assets'."""
    import hashlib

    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    env = embedded_server_env(tmp_path / "home")
    path = synth.write(tmp_path / "m.safetensors", synth.base_tensors())
    with Registry(Settings.from_env(env)) as reg:
        reg.push(path, "ui", "assets")
    srv = Server(env, tmp_path / "server.log")
    try:
        tok = token(env, "read", "ui")
        got = httpx.get(
            f"{srv.url}/ui/assets/resolve/main/model.safetensors", headers={"Authorization": f"Bearer {tok}"}
        )
        assert got.status_code == 200, got.text[:200]
        assert hashlib.sha256(got.content).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
        css = httpx.get(f"{srv.url}/ui/assets/mfsreg.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert httpx.get(f"{srv.url}/ui/assets/nothing.css").status_code == 404
        assert httpx.get(f"{srv.url}/ui/assets/..%2Fviews.py").status_code == 404
    finally:
        srv.stop()


def test_the_words_never_round_a_part_away():
    from mfsreg.registry.wording import in_words

    def part(n: int, deltas: int = 0) -> dict:
        return {"bytes": n, "fraction": 0.0, "stored_bytes": n, "delta_bytes": deltas, "delta_stored_bytes": deltas}

    # a 10 GiB fine-tune whose own bytes are one 40 KB header: not "100%" and "0%"
    said = in_words({"base": part(10 << 30), "group": part(0), "unique": part(40_000)})
    assert said.startswith("shares >99% with base; <1% is only in this version (39.06 KiB stored, none as deltas)")
    said = in_words({"base": part(0), "group": part(0), "unique": part(1 << 20, 1 << 19)})
    assert said == "shares 0% with base; 100% is only in this version (1.00 MiB stored, 512.00 KiB of it as deltas)"
    assert in_words({"base": part(0), "group": part(0), "unique": part(0)}) == "holds no chunks"


def test_the_matrix_equals_a_count_of_the_chunks_each_pair_holds(site):
    """Against a brute-force count over the manifests' chunk ids and sizes."""
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    with Registry(Settings.from_env(site["env"], blobs=False)) as reg:
        m = reg.sharing_matrix("qwen")
        sizes, ids = {}, {}
        for name in m["versions"]:
            _, manifest = reg.manifest("qwen", name)
            sizes.update(manifest.chunk_sizes())
            ids[name] = set(manifest.chunk_ids())
    assert m["versions"] == list(PARENTS) and m["omitted"] == 0
    for i, a in enumerate(m["versions"]):
        for j, b in enumerate(m["versions"]):
            assert m["shared"][i][j] == sum(sizes[c] for c in ids[a] & ids[b]), (a, b)


def test_a_chunk_without_its_row_leaves_the_figures_standing(tmp_path):
    """A manifest naming a chunk with no row (`mfsreg check` reports such damage) must not break
    stats, the matrix or the pages: the chunk is left out of the figures."""
    from sqlalchemy import delete

    from mfsreg.registry.config import Settings
    from mfsreg.registry.db.engine import write_tx
    from mfsreg.registry.db.models import chunks
    from mfsreg.registry.registry import Registry

    env = embedded_server_env(tmp_path / "home")
    files = synth.family(tmp_path / "models")
    with Registry(Settings.from_env(env)) as reg:
        reg.push(files["base"], "f", "base")
        reg.push(files["lora-chat"], "f", "lora", parent="base")
        _, manifest = reg.manifest("f", "lora")
        gone = manifest.chunk_ids()[0]
        with write_tx(reg.engine) as conn:
            conn.execute(delete(chunks).where(chunks.c.id == gone))
        s = reg.stats("f")
        lora = next(v for v in s["versions"] if v["version"] == "lora")["shares"]
        sizes = manifest.chunk_sizes()
        assert sum(t["bytes"] for t in lora.values()) == sum(sizes.values()) - sizes[gone]
        assert (
            reg.sharing_matrix("f")["shared"][1][1]
            == sum(manifest.chunk_sizes().values()) - manifest.chunk_sizes()[gone]
        )
    srv = Server(env, tmp_path / "server.log")
    try:
        tok = token(env, "read", "*")
        with httpx.Client(base_url=srv.url, cookies={"mfsreg_session": tok}) as c:
            assert c.get("/ui/families/f").status_code == 200
            assert c.get("/ui/families/f/versions/lora").status_code == 200
    finally:
        srv.stop()
