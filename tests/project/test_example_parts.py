"""The example project's parts: the rate-limited stand-in API and the timeline renderers."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from example_project.api import ExternalAPI, call
from example_project.timeline import Span, overlaps, render_text, write_picture

SVG = "{http://www.w3.org/2000/svg}"


def _get_json(url: str, method: str = "GET") -> tuple[int, Any]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


def _parallel(api: ExternalAPI, entities: list[str]) -> list[int]:
    """Call ``/collect`` once per entity from as many threads, released at the same moment."""
    barrier = threading.Barrier(len(entities))
    statuses: list[int] = []

    def caller(entity: str) -> None:
        barrier.wait(timeout=5)
        status, _ = call(api.url, "crm", entity, caller=threading.current_thread().name)
        statuses.append(status)

    threads = [threading.Thread(target=caller, args=(e,)) for e in entities]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    return statuses


# -- ExternalAPI -----------------------------------------------------------------------------


def test_api_serves_json_with_deterministic_items() -> None:
    with ExternalAPI(latency=0.0) as api:
        assert api.url.startswith("http://127.0.0.1:")
        status, body = call(api.url, "crm", "customer-1", caller="t")
        assert status == 200
        assert (body["source"], body["entity"]) == ("crm", "customer-1")
        assert isinstance(body["items"], int)
        assert abs(body["served_at"] - time.time()) < 5
        with ExternalAPI(latency=0.0) as other:
            assert call(other.url, "crm", "customer-1", caller="t")[1]["items"] == body["items"]


def test_rate_limit_answers_429_then_serves_again_after_one_over_rate() -> None:
    rate = 5.0
    with ExternalAPI(rate=rate, burst=1, latency=0.0) as api:
        started = time.monotonic()
        assert call(api.url, "crm", "c1", caller="t")[0] == 200
        status, body = call(api.url, "crm", "c1", caller="t")
        assert status == 429
        assert body["error"] == "rate limited"
        assert 0 < body["retry_after"] <= 1 / rate
        # Another entity has a bucket of its own.
        assert call(api.url, "crm", "c2", caller="t")[0] == 200

        deadline = started + 3
        while (status := call(api.url, "crm", "c1", caller="t")[0]) == 429:
            assert time.monotonic() < deadline, "still rate limited long after 1/rate"
            time.sleep(0.01)
        assert status == 200
        # The token was taken after `started`, and the next one is due 1/rate later.
        assert time.monotonic() - started >= 1 / rate - 0.01

        entity = api.stats()["entities"]["crm:c1"]
        assert entity["calls"] == 2
        assert entity["rate_limited"] >= 1
        assert api.stats()["calls"] == 3


def test_concurrent_calls_for_one_entity_are_counted_as_overlap() -> None:
    with ExternalAPI(rate=100.0, burst=2, latency=0.3) as api:
        assert _parallel(api, ["c1", "c1"]) == [200, 200]
        stats = api.stats()
        assert stats["entities"]["crm:c1"]["max_concurrent"] == 2
        assert stats["entities"]["crm:c1"]["duplicate_calls"] >= 1
        assert stats["max_concurrent"] == 2
        assert stats["duplicate_calls"] >= 1


def test_concurrent_calls_for_different_entities_do_not_overlap() -> None:
    with ExternalAPI(rate=100.0, burst=1, latency=0.3) as api:
        assert _parallel(api, ["c1", "c2"]) == [200, 200]
        stats = api.stats()
        assert stats["max_concurrent"] == 1
        assert stats["duplicate_calls"] == 0
        assert sorted(stats["entities"]) == ["crm:c1", "crm:c2"]


def test_reset_clears_counts_and_refills_buckets() -> None:
    with ExternalAPI(rate=0.5, burst=1, latency=0.0) as api:
        call(api.url, "crm", "c1", caller="t")
        assert call(api.url, "crm", "c1", caller="t")[0] == 429
        assert _get_json(f"{api.url}/reset", method="POST")[0] == 200
        assert api.stats() == {
            "entities": {},
            "calls": 0,
            "rate_limited": 0,
            "max_concurrent": 0,
            "duplicate_calls": 0,
        }
        # Without the refill, the next token would be two seconds away.
        assert call(api.url, "crm", "c1", caller="t")[0] == 200


def test_stats_over_http_equal_stats() -> None:
    with ExternalAPI(rate=100.0, burst=1, latency=0.0) as api:
        call(api.url, "crm", "c1", caller="t")
        call(api.url, "crm", "c1", caller="t")
        call(api.url, "erp", "c1", caller="t")
        status, body = _get_json(f"{api.url}/stats")
        assert status == 200
        assert body == api.stats()
        assert body["calls"] + body["rate_limited"] == 3


def test_unknown_paths_and_missing_parameters_answer_json_errors() -> None:
    with ExternalAPI() as api:
        assert _get_json(f"{api.url}/nope")[0] == 404
        assert _get_json(f"{api.url}/stats", method="POST")[0] == 404
        status, body = _get_json(f"{api.url}/collect?source=crm")
        assert status == 400
        assert "entity" in body["error"]
        assert api.stats()["calls"] == 0


def test_stop_is_idempotent_and_url_needs_start() -> None:
    api = ExternalAPI()
    with pytest.raises(RuntimeError, match="start"):
        _ = api.url
    api.start()
    api.stop()
    api.stop()


# -- timeline --------------------------------------------------------------------------------


def _spans() -> list[Span]:
    return [
        Span("a", 0.0, 1.0, "w1", "ok"),
        Span("a", 1.0, 2.0, "w2", "ok"),  # touches the first: no overlap
        Span("b", 0.0, 2.0, "w1", "ok"),
        Span("b", 1.0, 3.0, "w2", "ok"),
        Span("b", 1.5, 1.8, "w3", "killed"),
        Span("c", 0.5, 0.5, "w3", "dropped"),  # empty: covers nothing
        Span("d", 2.0, 4.0, "w1", "killed"),
    ]


def test_overlaps_counts_the_peak_per_key() -> None:
    assert overlaps(_spans()) == {"a": 1, "b": 3, "c": 0, "d": 1}
    assert overlaps([]) == {}
    nested = [Span("k", 0, 10, "w", "ok"), Span("k", 1, 2, "w", "ok"), Span("k", 3, 4, "w", "ok")]
    assert overlaps(nested) == {"k": 2}
    # Same start: both run at once.
    assert overlaps([Span("k", 1, 2, "w", "ok"), Span("k", 1, 3, "w", "ok")]) == {"k": 2}


def test_render_text_marks_overlapping_rows() -> None:
    text = render_text({"no lock": _spans(), "empty": []}, width=40)
    lines = text.splitlines()
    rows = {line.split()[0]: line for line in lines if "│" in line}
    assert set(rows) == {"a", "b", "c", "d"}
    assert rows["b"].endswith("← overlap")
    assert "3" in rows["b"]
    assert not rows["a"].endswith("← overlap")
    assert "2" not in rows["a"].split("│")[1]
    assert rows["c"].split("│")[1].strip() == ""
    # d is killed at the end of the time range: its last cell is marked.
    assert rows["d"].split("│")[1].endswith("x")
    # All rows have `width` cells and line up.
    assert {len(row.split("│")[1]) for row in rows.values()} == {40}
    assert len({row.index("│") for row in rows.values()}) == 1
    assert lines[0].startswith("no lock")
    assert any(line.strip().startswith("0 s") and line.endswith("4.0 s") for line in lines)
    assert "empty" in text


def test_write_picture_svg_has_one_rect_per_span(tmp_path: Path) -> None:
    spans = _spans()
    path = tmp_path / "timeline.svg"
    write_picture({"no lock": spans, "with lock <&>": spans[:2]}, path)
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    rects = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "span"]
    assert len(rects) == len(spans) + 2
    red = [r for r in rects if r.get("fill") == "#d62728"]
    assert len(red) == 3  # the three spans of "b"
    titles = [r.findtext(f"{SVG}title") or "" for r in rects]
    assert any(t.startswith("b, w3, 1.50") and "killed" in t for t in titles)
    assert "with lock <&>" in [t.text for t in root.iter(f"{SVG}text")]


def test_write_picture_html_embeds_svg(tmp_path: Path) -> None:
    path = tmp_path / "timeline.html"
    write_picture({"pass": _spans()}, str(path), title="Demo & co")
    html = path.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    assert "<svg" in html
    assert "<title>Demo &amp; co</title>" in html


def test_write_picture_rejects_other_suffixes(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    with pytest.raises(ValueError, match=r"'\.png'.*\.svg or \.html"):
        write_picture({"pass": _spans()}, path)
    assert not path.exists()
