"""Which ranks and layers: the rank × layer map of a failed check, the
patterns named in it (each exact, and none where it does not hold), the map
in a terminal and as an HTML page, and the page in a real headless Chromium
(a screenshot, and its DOM)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from weight_checker.cli.report import verify_verdict
from weight_checker.verify.rank_map import MIXED, OK, STYLES, label_for, rank_layer_map, render_html, render_text
from weight_checker.verify.results import VerifyResult

from .cli import run_cli
from .fake_fleet import fake_fleet

ROOT = Path(__file__).resolve().parent.parent
#: A Llama layer's parameters, as vLLM names them (fused: qkv_proj, gate_up_proj).
LAYER = (
    "input_layernorm.weight",
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)
UNFUSED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.down_proj.weight")


def model_keys(tp: int = 8, layers: int = 80, pp: int = 1, dp: int = 1, params=LAYER) -> list[str]:
    """Every key of a Llama-like engine: the embedding on the first PP rank,
    the layers split between PP ranks, the norm and head on the last."""
    out = []
    per = layers // pp
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                prefix = f"dp{d}:pp{p}:pcp0:tp{t}:"
                if p == 0:
                    out.append(prefix + "model.embed_tokens.weight")
                out += [prefix + f"model.layers.{i}.{n}" for i in range(p * per, (p + 1) * per) for n in params]
                if p == pp - 1:
                    out += [prefix + "model.norm.weight", prefix + "lm_head.weight"]
    return out


def layer_of(key: str) -> int | None:
    part = key.partition("model.layers.")[2]
    return int(part.split(".")[0]) if part else None


def only(keys, label, pred) -> dict[str, str]:
    return {k: label for k in keys if pred(k)}


# --- the map -----------------------------------------------------------------------------------


def test_rows_columns_cells_ok_mixed_partial_and_absent():
    keys = model_keys(tp=2, layers=4, pp=2)
    labels = {
        "dp0:pp0:pcp0:tp1:model.layers.1.self_attn.qkv_proj.weight": "stale",
        "dp0:pp0:pcp0:tp1:model.layers.1.mlp.down_proj.weight": "zeros",
        "dp0:pp1:pcp0:tp0:lm_head.weight": "shard-of:tp1",
    }
    m = rank_layer_map(labels, keys)
    assert m.rows == ["pp0 tp0", "pp0 tp1", "pp1 tp0", "pp1 tp1"]
    assert m.columns == ["embed", "0", "1", "2", "3", "norm", "lm_head"]
    grid = m.to_json()["cells"]
    assert grid[0] == [OK, OK, OK, None, None, None, None]  # pp0 holds embed and layers 0-1 only
    assert grid[1][2] == MIXED and m.cell(1, 2).mismatching == 2 and m.cell(1, 2).keys == len(LAYER)
    assert m.cell(1, 2).partial
    assert grid[2] == [None, None, None, OK, OK, OK, "shard-of:tp1"]
    assert m.to_json()["counts"][2][6] == [1, 1]
    assert m.positions["dp0:pp1:pcp0:tp0:lm_head.weight"] == (2, 6)


@pytest.mark.parametrize(
    "keys,rows",
    [
        (["dp0:pp0:pcp0:tp0:w", "dp0:pp0:pcp0:tp1:w"], ["tp0", "tp1"]),
        (["dp0:pp0:pcp0:tp0:w", "dp1:pp0:pcp0:tp0:w", "dp1:pp0:pcp0:tp1:w"], ["dp0 tp0", "dp1 tp0", "dp1 tp1"]),
        (["dp0:pp0:pcp0:tp0:ep0:w", "dp0:pp0:pcp0:tp0:ep1:w"], ["ep0", "ep1"]),
        (["dp0:pp0:pcp0:tp0:w"], ["tp0"]),
        (["http://b:8000 dp0:pp0:pcp0:tp0:w", "http://a:8000 dp0:pp0:pcp0:tp0:w"], ["a:8000", "b:8000"]),
        (
            ["engine 10 (in-process LLM) dp0:pp0:pcp0:tp0:w", "engine 2 (in-process LLM) dp0:pp0:pcp0:tp1:w"],
            ["engine 2 (in-process LLM) tp1", "engine 10 (in-process LLM) tp0"],
        ),
        (["model.layers.0.w", "lm_head.weight"], ["(all keys)"]),
        (["dp0:pp0:pcp0:tp10:w", "dp0:pp0:pcp0:tp9:w", "dp0:pp0:pcp0:tp2:w"], ["tp2", "tp9", "tp10"]),
    ],
)
def test_row_labels_name_what_varies_in_rank_order(keys, rows):
    assert rank_layer_map({keys[0]: "stale"}, keys).rows == rows


@pytest.mark.parametrize(
    "name,column",
    [
        ("model.layers.17.mlp.down_proj.weight", "17"),
        ("model.language_model.layers.3.self_attn.qkv_proj.weight", "3"),
        ("transformer.h.5.attn.c_attn.weight", "5"),
        ("model.embed_tokens.weight", "embed"),
        ("transformer.wte.weight", "embed"),
        ("model.norm.weight", "norm"),
        ("transformer.ln_f.weight", "norm"),
        ("lm_head.weight", "lm_head"),
        ("model.rotary_emb.inv_freq", "other"),
        ("lora:sql:model.layers.2.self_attn.qkv_proj.lora_a", "2"),
        ("buffer:model.layers.4.mlp.scale", "4"),
        ("draft:model.layers.0.self_attn.qkv_proj.weight", "draft"),
    ],
)
def test_columns_from_the_parameter_name(name, column):
    m = rank_layer_map({f"dp0:pp0:pcp0:tp0:{name}": "stale"})
    assert m.columns == [column] and not m.complete


def test_the_map_and_patterns_do_not_depend_on_key_order():
    keys = model_keys(tp=4, layers=12)
    labels = only(keys, "stale", lambda k: ":tp3:" in k) | only(keys, "zeros", lambda k: "layers.5.mlp" in k)
    shuffled = list(keys)
    random.Random(7).shuffle(shuffled)
    a, b = rank_layer_map(labels, keys), rank_layer_map(dict(reversed(labels.items())), shuffled)
    assert a.to_json() == b.to_json() and a.patterns == b.patterns


def test_a_label_is_the_cause_where_one_was_found_else_the_class():
    assert label_for("changed", {"cause": "zeros"}) == "zeros"
    assert label_for("changed", {"cause": "unknown"}) == "changed"
    assert label_for("changed", {"cause": "mixed"}) == "changed"
    assert label_for("stale", None) == "stale"
    assert {s.char for s in STYLES.values()} >= {"S", "C", "Z"}
    assert len({s.char for s in STYLES.values()}) == len(STYLES)  # one character each


# --- patterns (8 TP ranks x 80 layers) -----------------------------------------------------------

KEYS = model_keys()


def patterns(labels, keys=KEYS):
    return rank_layer_map(labels, keys).patterns


def test_a_rank_that_missed_the_update():
    assert patterns(only(KEYS, "stale", lambda k: ":tp3:" in k)) == ["tp3 missed the update (every layer stale)"]
    two = only(KEYS, "untouched-since-reset", lambda k: ":tp3:" in k or ":tp6:" in k)
    assert patterns(two) == ["tp3, tp6 missed the update (every layer untouched-since-reset)"]


def test_a_rank_where_every_key_has_one_cause_or_several():
    assert patterns(only(KEYS, "zeros", lambda k: ":tp2:" in k)) == ["tp2: every layer zeros"]
    labels = only(KEYS, "stale", lambda k: ":tp3:" in k) | only(KEYS, "missing", lambda k: "tp3:lm_head" in k)
    assert patterns(labels) == ["tp3: every key differs (482 stale, 1 missing)"]


def test_a_rank_with_one_key_that_matches_did_not_miss_the_update():
    labels = only(KEYS, "stale", lambda k: ":tp3:" in k and "lm_head" not in k)
    found = patterns(labels)
    assert not any("missed" in p or "every layer" in p for p in found), found
    assert found == ["only tp3 differs (482 of its 483 keys)"]


def test_layer_ranges_on_every_rank():
    late = only(KEYS, "stale", lambda k: (layer_of(k) or 0) >= 40)
    assert patterns(late) == ["layers 40-79 stale on every rank"]
    # One key of layer 50 on tp1 matches: the range is two ranges, never 40-79.
    del late["dp0:pp0:pcp0:tp1:model.layers.50.mlp.down_proj.weight"]
    assert patterns(late) == ["layers 40-49 stale on every rank", "layers 51-79 stale on every rank"]
    one = only(KEYS, "changed", lambda k: layer_of(k) == 7)
    assert patterns(one) == ["layer 7 changed on every rank"]
    split = only(KEYS, "stale", lambda k: 10 <= (layer_of(k) or -1) < 20) | only(
        KEYS, "zeros", lambda k: 20 <= (layer_of(k) or -1) < 30
    )
    assert patterns(split) == ["layers 10-19 stale on every rank", "layers 20-29 zeros on every rank"]


def test_a_layer_range_on_all_but_one_rank_is_not_named():
    labels = only(KEYS, "stale", lambda k: (layer_of(k) or 0) >= 40 and ":tp0:" not in k)
    found = patterns(labels)
    assert not any("layers" in p for p in found), found
    assert found == ["only tp1, tp2, tp3, tp4, tp5, tp6, tp7 differ (1680 of their 3381 keys)"]


def test_one_parameter_kind_on_every_rank():
    keys = model_keys(tp=8, layers=80, params=UNFUSED)
    k_proj = only(keys, "stale", lambda k: ".k_proj." in k)
    assert patterns(k_proj, keys) == ["only `k_proj` differs on every rank (640 stale)"]
    # Not on tp5: one kind still, but not every key of it.
    partial = {k: c for k, c in k_proj.items() if ":tp5:" not in k}
    found = patterns(partial, keys)
    assert "only `k_proj` differs (560 of its 640 keys: 560 stale)" in found
    assert not any("on every rank" in p for p in found), found
    # Two kinds: no kind is named.
    both = k_proj | only(keys, "stale", lambda k: ".q_proj." in k)
    assert not any(p.startswith("only `") for p in patterns(both, keys))


def test_the_head_alone_differs():
    labels = only(KEYS, "stale", lambda k: k.endswith("lm_head.weight"))
    assert patterns(labels) == ["only `lm_head` differs on every rank (8 stale)"]


def test_every_key_of_every_rank():
    assert patterns(dict.fromkeys(KEYS, "stale")) == ["every key stale on every rank: the update reached no rank"]
    assert patterns(dict.fromkeys(KEYS, "changed")) == ["every key changed on every rank"]
    mixed = dict.fromkeys(KEYS, "stale") | only(KEYS, "zeros", lambda k: ":tp0:" in k)
    assert patterns(mixed) == ["every key differs on every rank (3381 stale, 483 zeros)"]


def test_the_same_parameters_on_every_rank():
    keys = model_keys(tp=8, layers=80, params=UNFUSED)
    labels = only(keys, "changed", lambda k: ".layers.3.self_attn.q_proj." in k or ".layers.9.mlp.down_proj." in k)
    assert patterns(labels, keys) == ["the same 2 parameters differ on every rank (16 changed)"]
    del labels["dp0:pp0:pcp0:tp4:model.layers.9.mlp.down_proj.weight"]
    assert not any("the same" in p for p in patterns(labels, keys))


def test_pipeline_ranks_hold_different_layers():
    keys = model_keys(tp=2, layers=8, pp=2)
    labels = only(keys, "stale", lambda k: ":pp1:" in k)
    assert patterns(labels, keys) == [
        "pp1 tp0, pp1 tp1 missed the update (every layer stale)",
        "layers 4-7 stale on every rank holding them",
    ]


def test_one_rank_a_compare_of_two_checkpoints():
    keys = model_keys(tp=1, layers=32)
    assert patterns(only(keys, "changed", lambda k: 10 <= (layer_of(k) or -1) <= 12), keys) == ["layers 10-12 changed"]
    assert patterns(dict.fromkeys(keys, "changed"), keys) == ["every key changed"]
    assert patterns(dict.fromkeys(keys, "stale"), keys) == ["every key stale: the update reached none of them"]


def test_without_every_key_only_what_the_mismatches_prove():
    labels = only(KEYS, "stale", lambda k: ":tp3:" in k)
    assert rank_layer_map(labels).patterns == []  # is tp3 all of it? unknown
    k_proj = only(model_keys(params=UNFUSED), "stale", lambda k: ".k_proj." in k)
    assert rank_layer_map(k_proj).patterns == ["only `k_proj.weight` differs"]


def test_no_mismatch_no_pattern():
    m = rank_layer_map({}, KEYS)
    assert m.patterns == [] and m.labels == {}


# --- the terminal ------------------------------------------------------------------------------


def test_text_grid_plain_and_in_colour_fits_100_columns():
    labels = only(KEYS, "stale", lambda k: ":tp3:" in k) | only(KEYS, "zeros", lambda k: "tp5:model.layers.7.mlp" in k)
    m = rank_layer_map(labels, KEYS)
    plain = render_text(m)
    lines = plain.splitlines()
    assert "\x1b" not in plain
    assert max(len(line) for line in lines) <= 100, max(len(line) for line in lines)
    row = next(line for line in lines if line.startswith("  tp3 "))
    assert row.count("S") == 83  # embed, 80 layers, norm, lm_head
    tp5 = next(line for line in lines if line.startswith("  tp5 "))
    assert tp5.split()[2][7] == "z"  # some keys of layer 7: lower case
    assert "S stale" in lines[0] and "Z zeros" in lines[0] and ". ok" in lines[0]
    assert lines[-3:] == [
        "patterns:",
        "  tp3 missed the update (every layer stale)",
        "  only tp3, tp5 differ (485 of their 966 keys)",
    ]
    coloured = render_text(m, color=True)
    assert "\x1b[33mS" in coloured and "\x1b[0m" in coloured
    assert coloured.count("\x1b[33m") < 40  # one escape per run, not per cell


def test_many_layers_are_grouped_to_fit():
    keys = model_keys(tp=4, layers=250)
    m = rank_layer_map(only(keys, "stale", lambda k: ":tp1:" in k), keys)
    text = render_text(m)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "layers 0-249 (3 a column)" in text


# --- the verify result -------------------------------------------------------------------------


def test_a_verify_result_gives_the_map_only_on_a_mismatch():
    result = VerifyResult(match=True, key_count=len(KEYS))
    assert result.rank_map() is None
    report = result.to_json()
    assert "map" not in report and "patterns" not in report
    result = VerifyResult(
        mismatches=only(KEYS, "stale", lambda k: ":tp3:" in k), compared_keys=list(KEYS), key_count=len(KEYS)
    )
    report = result.to_json()
    assert report["patterns"] == ["tp3 missed the update (every layer stale)"]
    assert report["map"]["rows"][3] == "tp3" and report["map"]["cells"][3][40] == "stale"
    assert {"servers", "steps", "match", "mismatches", "classes", "key_count", "reference"} <= report.keys()
    caused = result.rank_map({k: {"cause": "version:step-11"} for k in result.mismatches})
    assert caused is not None and caused.patterns == ["tp3 missed the update (every layer version:step-11)"]


def test_verify_prints_the_map_json_carries_it_and_report_writes_it(tmp_path):
    with fake_fleet(2, tp=2) as fleet:  # dp0 and dp1, merged: a transfer that does nothing
        for s in fleet:
            s.loaded = {
                f"dp{s.rank}:pp0:pcp0:tp{t}:model.layers.{i}.mlp.down_proj.weight": hashlib.sha256(
                    f"{s.rank}{t}{i}".encode()
                ).hexdigest()
                for t in range(2)
                for i in range(4)
            }
            s.weights = dict(s.loaded)
        urls = [a for s in fleet for a in ("--url", s.url)]
        out = tmp_path / "report.html"
        r = run_cli("verify", *urls, "--transfer-cmd", "true", "--report", out)
        assert r.returncode == 1, r.stderr
        assert "rank x layer map:" in r.stdout and "R untouched-since-reset" in r.stdout
        assert "  dp1 tp1  RRRR" in r.stdout, r.stdout
        assert "every key untouched-since-reset on every rank: the update reached no rank" in r.stdout
        assert "\x1b" not in r.stdout  # not a terminal: plain
        page = out.read_text()
        assert "the update reached no rank" in page and "MISMATCH: 16 keys" in page
        for s in fleet:  # the transfer did nothing: each holds the reset's zeros
            s.weights = dict(s.loaded)
        r = run_cli("verify", *urls, "--transfer-cmd", "true", "--json")
        report = json.loads(r.stdout)
        assert report["patterns"] == ["every key untouched-since-reset on every rank: the update reached no rank"]
        assert report["map"]["rows"] == ["dp0 tp0", "dp0 tp1", "dp1 tp0", "dp1 tp1"]
        for s in fleet:
            s.weights = dict(s.loaded)
        r = run_cli("verify", *urls, "--transfer", "reload", "--report", out)
        assert r.returncode == 0 and "map" not in r.stdout and "patterns" not in r.stdout
        assert "MATCH: 16 keys" in out.read_text()


# --- compare -----------------------------------------------------------------------------------


def manifests(tmp_path: Path, keys, changed) -> tuple[Path, Path]:
    base = {k: hashlib.sha256(k.encode()).hexdigest() for k in keys}
    cur = {k: (hashlib.sha256(b"new" + k.encode()).hexdigest() if changed(k) else v) for k, v in base.items()}
    (tmp_path / "base.json").write_text(json.dumps({"checksums": base}))
    (tmp_path / "cur.json").write_text(json.dumps(cur))
    return tmp_path / "base.json", tmp_path / "cur.json"


def test_compare_prints_the_map_and_patterns_and_writes_the_report(tmp_path):
    base, cur = manifests(tmp_path, model_keys(tp=4, layers=32), lambda k: ":tp3:" in k)
    out = tmp_path / "out.html"
    r = run_cli("compare", base, cur, "--report", out)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0].startswith("MISMATCH: 195 keys differ (195 changed)")
    assert "  tp3  C CCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC CC" in lines
    assert "  tp0  . ................................ .." in lines
    assert lines[-2:] == ["patterns:", "  tp3: every layer changed"]
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "tp3: every layer changed" in page and page.isascii()
    r = run_cli("compare", base, cur, "--json")
    report = json.loads(r.stdout)
    assert report["patterns"] == ["tp3: every layer changed"] and report["map"]["rows"] == ["tp0", "tp1", "tp2", "tp3"]
    r = run_cli("compare", base, base, "--report", out)
    assert r.returncode == 0 and r.stdout.startswith("match:") and len(r.stdout.splitlines()) == 1
    assert "match: 780 keys" in out.read_text() and "<table" not in out.read_text()


def test_a_report_that_cannot_be_written_is_a_usage_error(tmp_path):
    base, cur = manifests(tmp_path, model_keys(tp=1, layers=2), lambda k: "layers.1" in k)
    r = run_cli("compare", base, cur, "--report", tmp_path / "no-such-dir" / "out.html")
    assert r.returncode == 2 and "--report" in r.stderr and "Traceback" not in r.stderr


# --- HTML --------------------------------------------------------------------------------------


def test_html_escapes_everything_and_fetches_nothing():
    key = 'dp0:pp0:pcp0:tp0:model.layers.0.<script>alert("x")</script>'
    m = rank_layer_map({key: "<b>bad</b>"}, [key, "dp0:pp0:pcp0:tp1:model.layers.0.w"])
    page = render_html(m, {key: {"cause": "<i>c</i>", "where": "rows <0>", "ranges": [[0, 8]]}}, verdict="<v>")
    assert "<script" not in page and "<b>bad" not in page and "<i>c" not in page and "<v>" not in page
    assert "&lt;script&gt;" in page
    for external in ("src=", "href=", "url(", "@import", "http://", "https://"):
        assert external not in page, external


def example() -> tuple[VerifyResult, dict]:
    """The docs' example: 4 TP ranks x 32 layers, tp3 stale, a few keys with
    causes found in part of the tensor."""
    keys = model_keys(tp=4, layers=32)
    mismatches = only(keys, "stale", lambda k: ":tp3:" in k)
    mb = 1 << 20
    details = {
        "dp0:pp0:pcp0:tp1:model.layers.5.mlp.down_proj.weight": {
            "class": "changed",
            "cause": "zeros",
            "where": "rows 2048-4095 of 4096",
            "ranges": [[16 * mb, 32 * mb]],
            "block_bytes": mb,
            "blocks": 32,
            "block_causes": {"zeros": [[16 * mb, 32 * mb]]},
        },
        "dp0:pp0:pcp0:tp2:model.layers.17.self_attn.qkv_proj.weight": {
            "class": "changed",
            "cause": "dtype-roundtrip:float16",
            "where": "rows 0-1535 of 1536",
            "ranges": [[0, 12 * mb]],
            "block_bytes": mb,
            "blocks": 12,
        },
        "dp0:pp0:pcp0:tp0:model.layers.30.mlp.gate_up_proj.weight": {
            "class": "changed",
            "cause": "mixed",
            "where": "rows 0-511, 3072-3583 of 5632",
            "ranges": [[0, 4 * mb], [24 * mb, 28 * mb]],
            "block_bytes": mb,
            "blocks": 44,
            "block_causes": {"shard-of:tp1": [[0, 4 * mb]], "unknown": [[24 * mb, 28 * mb]]},
        },
    }
    mismatches |= {k: d["class"] for k, d in details.items()}
    result = VerifyResult(
        mismatches=mismatches,
        compared_keys=keys,
        key_count=len(keys),
        reference="the expected digests",
        servers=["http://10.0.0.7:8000"],
    )
    return result, details


def chromium() -> str | None:
    """The headless browser (Debian's ``chromium``); under CI=true it must be there."""
    found = next((p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None)
    if found is None and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI=true but no chromium: scripts/dev-env.sh installs Debian's chromium")
    return found


def test_the_report_in_a_real_headless_browser(tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium (apt-get install chromium; scripts/dev-env.sh does as root)")
    result, details = example()
    rank_map = result.rank_map(details)
    assert rank_map is not None
    assert rank_map.patterns == ["tp3 missed the update (every layer stale)"]
    page = render_html(
        rank_map, details, title="weight-checker verify: http://10.0.0.7:8000", verdict=verify_verdict(result.to_json())
    )
    html_file = tmp_path / "report.html"
    html_file.write_text(page.encode("ascii", "xmlcharrefreplace").decode())
    png = tmp_path / "report.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    url = html_file.as_uri()
    shot = subprocess.run(
        [browser, *flags, f"--screenshot={png}", "--window-size=1400,900", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert png.exists() and png.stat().st_size > 10_000, shot.stderr[-2000:]
    from PIL import Image

    with Image.open(png) as image:
        assert image.size == (1400, 900)
        colours = {c for _, c in image.convert("RGB").getcolors(maxcolors=1 << 20) or []}
    assert len(colours) > 20  # text, the grid's colours: not a blank page
    for label in ("stale", "zeros", "dtype-roundtrip"):  # the map's cells, as drawn
        css = STYLES[label].css
        rgb = tuple(int(css[i : i + 2], 16) for i in (1, 3, 5))
        assert rgb in colours, (label, css)
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    for pattern in rank_map.patterns:
        assert pattern in dom, pattern
    columns = 35  # embed, 32 layers, norm, lm_head
    assert dom.count('data-label="stale"') == columns and dom.count('data-label="ok"') == 3 * columns - 3
    assert 'data-label="zeros"' in dom and "rows 2048-4095 of 4096" in dom
    if os.environ.get("WEIGHT_CHECKER_UPDATE_DOCS_IMAGES") == "1":  # docs/images/verify-report.png, by hand
        shutil.copyfile(png, ROOT / "docs" / "images" / "verify-report.png")


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    import io

    from weight_checker.cli.report import print_rank_map

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    m = rank_layer_map(only(KEYS, "stale", lambda k: ":tp3:" in k), KEYS)
    monkeypatch.delenv("NO_COLOR", raising=False)
    for out, coloured in ((io.StringIO(), False), (Terminal(), True)):
        print_rank_map(m, out)
        assert ("\x1b[" in out.getvalue()) is coloured
    monkeypatch.setenv("NO_COLOR", "1")
    out = Terminal()
    print_rank_map(m, out)
    assert "\x1b[" not in out.getvalue() and "tp3 missed the update" in out.getvalue()
    out = Terminal()
    print_rank_map(None, out)  # a match: nothing
    assert out.getvalue() == ""


def test_a_fleet_names_the_engine_that_missed_the_update():
    import weight_checker

    with fake_fleet(2, independent=True) as fleet:

        def transfer() -> None:  # reaches the first replica only
            fleet[0].weights = dict(fleet[0].loaded)

        result = weight_checker.verify([s.url for s in fleet], transfer=transfer)
    m = result.rank_map()
    assert m is not None and sorted(m.rows) == sorted(s.url.removeprefix("http://") for s in fleet)
    assert m.patterns == [f"{fleet[1].url.removeprefix('http://')} missed the update (every key untouched-since-reset)"]
