#!/usr/bin/env python3
"""Checks every Grafana dashboard under a directory against a live Prometheus.

  dashboard_queries.py --prometheus=http://127.0.0.1:9090 --dashboards=deploy/grafana \
      [--rate-interval=2m] [--wait-s=30] [--still=METRIC=REASON ...]

Structure (offline): schemaVersion >= 36, a `datasource` variable of type datasource for
prometheus, unique panel ids (rows' nested panels included), a gridPos inside 24 columns and
overlapping no other, a datasource on every panel, unique refIds, and only defined variables in
expressions.

Live: every query variable's label_values(...) has values, and every target's expr, with
$__rate_interval and the other variables substituted (an All value: `.*`), answers an instant
query with data. An expr that takes rate(), irate() or increase() must also have a sample > 0
("the series moves"), unless a metric it reads is named by --still (the caller could not drive
it). Exits 1 naming each failing dashboard, panel and expr.
"""

import argparse
import json
import math
import pathlib
import re
import sys
import time
import urllib.parse
import urllib.request

BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}
VAR_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
COUNTER_FN_RE = re.compile(r"\b(rate|irate|increase)\s*\(")
METRIC_RE = re.compile(r"\b(kvcm_\w+)")


def walk_panels(panels):
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


def check_structure(path, dash):
    errors = []
    if dash.get("schemaVersion", 0) < 36:
        errors.append(f"schemaVersion {dash.get('schemaVersion')} < 36")
    variables = dash.get("templating", {}).get("list", [])
    names = {v.get("name") for v in variables}
    if not any(v.get("name") == "datasource" and v.get("type") == "datasource"
               and v.get("query") == "prometheus" for v in variables):
        errors.append("no `datasource` variable of type datasource for prometheus")
    for v in variables:
        if v.get("type") == "query" and "$" not in json.dumps(v.get("datasource", "")):
            errors.append(f"variable {v.get('name')}: no datasource variable")
    ids, cells = {}, {}
    for p in walk_panels(dash.get("panels", [])):
        title = p.get("title", "?")
        if p.get("id") in ids:
            errors.append(f"panel {title!r}: id {p.get('id')} also used by {ids[p['id']]!r}")
        ids[p.get("id")] = title
        grid = p.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y")):
            errors.append(f"panel {title!r}: gridPos needs integer h, w, x, y")
        elif grid["x"] + grid["w"] > 24:
            errors.append(f"panel {title!r}: gridPos wider than 24 columns")
        elif p in dash.get("panels", []):  # a collapsed row's panels lie where it opens
            for cell in ((x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                         for y in range(grid["y"], grid["y"] + grid["h"])):
                if cells.setdefault(cell, title) != title:
                    errors.append(f"panel {title!r} overlaps {cells[cell]!r}")
                    break
        if p.get("type") == "row":
            continue
        if not p.get("datasource"):
            errors.append(f"panel {title!r}: no datasource")
        targets = p.get("targets", [])
        if not targets:
            errors.append(f"panel {title!r}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            errors.append(f"panel {title!r}: duplicate refIds {refs}")
        for t in targets:
            if not t.get("expr"):
                errors.append(f"panel {title!r} target {t.get('refId')}: no expr")
            for m in VAR_RE.finditer(t.get("expr", "")):
                name = m.group(1) or m.group(2)
                if name not in names and name not in BUILTINS:
                    errors.append(f"panel {title!r}: undefined variable ${name}")
    return [f"{path.name}: {e}" for e in errors]


def substitute(expr, rate_interval):
    def one(m):
        name = m.group(1) or m.group(2)
        if name in ("__rate_interval", "__interval", "__range"):
            return rate_interval
        return ".*"
    return VAR_RE.sub(one, expr)


class Prometheus:
    def __init__(self, base):
        self.base = base.rstrip("/")

    def get(self, path, params):
        url = f"{self.base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # 400 for a bad query: the body says why
            return json.load(e)

    def query(self, expr):
        """(error or None, samples as floats)."""
        r = self.get("/api/v1/query", {"query": expr})
        if r.get("status") != "success":
            return f"{r.get('errorType')}: {r.get('error')}", []
        data = r["data"]
        if data["resultType"] == "scalar":
            return None, [float(data["result"][1])]
        return None, [float(s["value"][1]) for s in data["result"]]


def label_values_expr(query):
    """label_values(selector, label) -> (selector, label); label_values(label) -> (None, label)."""
    m = re.fullmatch(r"\s*label_values\((?:(.*),)?\s*(\w+)\s*\)\s*", query)
    return (m.group(1).strip() if m.group(1) else None, m.group(2)) if m else (None, None)


def live_checks(prom, path, dash, rate_interval, still):
    """[(description, check)] where check() returns None when fine or the reason it is not."""
    checks = []
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        selector, label = label_values_expr(q)
        if label is None:
            checks.append((f"{path.name}: variable ${v['name']}", lambda q=q: f"not label_values(...): {q}"))
            continue
        sel = substitute(selector, rate_interval) if selector else None

        def check(sel=sel, label=label):
            params = {"match[]": sel} if sel else {}
            r = prom.get(f"/api/v1/label/{label}/values", params)
            if r.get("status") != "success":
                return f"{r.get('error')}"
            return None if r["data"] else "no values"
        checks.append((f"{path.name}: variable ${v['name']} = {q}", check))

    for p in walk_panels(dash.get("panels", [])):
        for t in p.get("targets", []):
            if not t.get("expr"):
                continue
            expr = substitute(t["expr"], rate_interval)
            must_move = bool(COUNTER_FN_RE.search(expr)) and not any(
                m in still for m in METRIC_RE.findall(expr))

            def check(expr=expr, must_move=must_move):
                error, values = prom.query(expr)
                if error:
                    return error
                if not values:
                    return "no data"
                finite = [x for x in values if not math.isnan(x)]
                if must_move and not any(x > 0 for x in finite):
                    return f"never > 0 (samples {values[:4]})"
                return None
            what = f"{path.name}: panel {p.get('title')!r} {t.get('refId')}: {expr}"
            checks.append((what, check))
    return checks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prometheus", required=True)
    ap.add_argument("--dashboards", required=True)
    ap.add_argument("--rate-interval", default="2m")
    ap.add_argument("--wait-s", type=float, default=30)
    ap.add_argument("--still", action="append", default=[],
                    help="METRIC=REASON: a counter this run cannot move")
    args = ap.parse_args()
    still = dict(s.split("=", 1) for s in args.still)

    files = sorted(pathlib.Path(args.dashboards).rglob("*.json"))
    if not files:
        print(f"no dashboards under {args.dashboards}", file=sys.stderr)
        return 1
    errors, checks = [], []
    prom = Prometheus(args.prometheus)
    for path in files:
        try:
            dash = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            errors.append(f"{path.name}: not JSON: {e}")
            continue
        errors += check_structure(path, dash)
        checks += live_checks(prom, path, dash, args.rate_interval, still)
    for e in errors:
        print(f"BAD  {e}", file=sys.stderr)

    # Scrapes and rule evaluations lag the load a little: retry what fails until the deadline.
    pending = checks
    deadline = time.monotonic() + args.wait_s
    while True:
        failed = [(what, check, why) for what, check in pending if (why := check()) is not None]
        if not failed or time.monotonic() >= deadline:
            break
        pending = [(what, check) for what, check, _ in failed]
        time.sleep(1)
    for what, _, why in failed:
        print(f"FAIL {what}\n     -> {why}", file=sys.stderr)
    for metric, reason in sorted(still.items()):
        print(f"note {metric}: checked for data only ({reason})")
    print(f"{len(files)} dashboards, {len(checks)} queries, {len(failed)} failed, "
          f"{len(errors)} structure errors")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
