#!/usr/bin/env python3
"""Do the alert rules' job selectors match the jobs Prometheus will give kvcm's targets?

Derives the `job` label of every kvcm target three ways and runs promtool's alert rule tests
(deploy/prometheus/kvcm-alerts_test.yaml) with the test series' jobs replaced by the derived
ones: an alert keyed on a job no target gets then fails its test.

  alert_jobs.py static DEPLOY_DIR           the static jobs of DEPLOY_DIR/prometheus.yml
  alert_jobs.py render RENDER DEPLOY_DIR    from a kustomize render (RENDER, a YAML file):
      operator  ServiceMonitor / PodMonitor, as prometheus-operator relabels them: a
                ServiceMonitor's job is the value of the Service label named by spec.jobLabel,
                else the Service's name; a PodMonitor's the value of the pod label named by
                spec.jobLabel, else "<namespace>/<podmonitor name>" (pkg/prometheus/promcfg.go)
      plain     the kubernetes-pods job commented in DEPLOY_DIR/prometheus.yml, its
                relabel_configs applied to each declared container port of each rendered pod

Components: pods labelled app.kubernetes.io/name kvcm-manager or kvcm-agent; the test series
say job="kvcm-manager" / job="kvcm-agent" for them. Exit 1 on any mismatch; promtool missing
is a skip of the rule tests (exit 77 when nothing else was checked).
"""
import copy
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

COMPONENTS = ("kvcm-manager", "kvcm-agent")
failures = 0


def fail(message):
    global failures
    failures += 1
    print("FAIL:", message)


def sanitize(name):
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def selects(selector, labels):
    if set(selector) - {"matchLabels"}:
        fail(f"selector {selector}: only matchLabels is understood here")
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def pods(objs):
    """(namespace, labels, annotations, containers) of every workload's pod template."""
    for o in objs:
        if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            t = o["spec"]["template"]
            yield (o["metadata"].get("namespace", "default"), t["metadata"].get("labels", {}),
                   t["metadata"].get("annotations", {}), t["spec"]["containers"], o)


def component(labels):
    name = labels.get("app.kubernetes.io/name")
    return name if name in COMPONENTS else None


def operator_jobs(objs):
    """{component: set of jobs} under prometheus-operator, and checks of the monitors' ports."""
    jobs = {}
    monitors = [o for o in objs if o["apiVersion"].startswith("monitoring.coreos.com/")]
    for m in monitors:
        spec, ns, name = m["spec"], m["metadata"].get("namespace", "default"), m["metadata"]["name"]
        for ep in spec.get("endpoints", []) + spec.get("podMetricsEndpoints", []):
            for r in ep.get("relabelings", []):
                if r.get("targetLabel") == "job":
                    fail(f"{m['kind']}/{name}: a relabeling writes job (not modelled here)")
        job_label = spec.get("jobLabel", "")
        if m["kind"] == "ServiceMonitor":
            for svc in objs:
                if svc["kind"] != "Service" or svc["metadata"].get("namespace", "default") != ns:
                    continue
                labels = svc["metadata"].get("labels", {})
                if not selects(spec["selector"], labels):
                    continue
                job = labels.get(job_label) if job_label and labels.get(job_label) else svc["metadata"]["name"]
                for pns, plabels, _, _, _ in pods(objs):
                    if pns == ns and selects({"matchLabels": svc["spec"]["selector"]}, plabels) and component(plabels):
                        jobs.setdefault(component(plabels), set()).add(job)
                ports = {p.get("name") for p in svc["spec"].get("ports", [])}
                for ep in spec["endpoints"]:
                    if ep.get("port") not in ports:
                        fail(f"ServiceMonitor/{name}: Service {svc['metadata']['name']} has no port {ep.get('port')}")
        elif m["kind"] == "PodMonitor":
            matched = False
            for pns, plabels, _, containers, o in pods(objs):
                if pns != ns or not selects(spec["selector"], plabels):
                    continue
                matched = True
                job = plabels[job_label] if job_label and plabels.get(job_label) else f"{ns}/{name}"
                if component(plabels):
                    jobs.setdefault(component(plabels), set()).add(job)
                declared = {p.get("name"): p["containerPort"] for c in containers for p in c.get("ports", [])}
                scraped = {ep.get("port") for ep in spec["podMetricsEndpoints"]}
                for port in scraped - set(declared):
                    fail(f"PodMonitor/{name}: {o['kind']}/{o['metadata']['name']} declares no port {port}")
                for port in sorted(p for p in declared if p and p.startswith("metrics")):
                    if port not in scraped:
                        fail(f"PodMonitor/{name}: metrics port {port} of {o['metadata']['name']} is not scraped")
            if not matched:
                fail(f"PodMonitor/{name} selects no pod")
        for key in ("release",):
            if key not in m["metadata"].get("labels", {}):
                fail(f"{m['kind']}/{name}: no {key} label (kube-prometheus-stack selects monitors by it)")
    return jobs


def relabel(labels, configs):
    """Prometheus relabelling (replace, keep, drop; the defaults of each field). None: dropped."""
    labels = dict(labels)
    for c in configs:
        action = c.get("action", "replace")
        value = c.get("separator", ";").join(labels.get(s, "") for s in c.get("source_labels", []))
        regex = re.compile("^(?:" + str(c.get("regex", "(.*)")) + ")$")
        match = regex.match(value)
        if action == "keep":
            if not match:
                return None
        elif action == "drop":
            if match:
                return None
        elif action == "replace":
            if match:
                replacement = str(c.get("replacement", "$1"))
                result = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                                lambda g: match.group(int(g.group(1) or g.group(2))) or "", replacement)
                if result:
                    labels[c["target_label"]] = result
                else:
                    labels.pop(c["target_label"], None)
        else:
            fail(f"relabel action {action} not modelled")
    return labels


def plain_jobs(objs, deploy):
    """{component: jobs} from the commented kubernetes-pods job of prometheus.yml."""
    text = (deploy / "prometheus.yml").read_text()
    block = re.search(r"^  # - job_name: kubernetes-pods\n(?:  #.*\n?)*", text, re.M)
    if not block:
        fail("prometheus.yml: no commented kubernetes-pods job")
        return {}
    job = yaml.safe_load("\n".join(line[4:] for line in block.group(0).splitlines()))[0]
    jobs, targets = {}, {}
    for ns, plabels, annotations, containers, o in pods(objs):
        for c in containers:
            for p in c.get("ports", []):
                meta = {"job": job["job_name"], "__address__": f"10.0.0.1:{p['containerPort']}",
                        "__meta_kubernetes_namespace": ns,
                        "__meta_kubernetes_pod_name": o["metadata"]["name"] + "-x",
                        "__meta_kubernetes_pod_container_name": c["name"],
                        "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(p["containerPort"])}
                meta.update({"__meta_kubernetes_pod_label_" + sanitize(k): v for k, v in plabels.items()})
                meta.update({"__meta_kubernetes_pod_annotation_" + sanitize(k): v for k, v in annotations.items()})
                out = relabel(meta, job.get("relabel_configs", []))
                if out is None:
                    continue
                if component(plabels):
                    jobs.setdefault(component(plabels), set()).add(out["job"])
                    targets.setdefault(component(plabels), set()).add(out["__address__"])
    for name in COMPONENTS:
        print(f"plain: {name} targets {sorted(targets.get(name, []))}")
    return jobs


def static_jobs(deploy):
    """{component: jobs} of prometheus.yml's static scrape configs, by the targets' ports."""
    config = yaml.safe_load((deploy / "prometheus.yml").read_text())
    jobs = {}
    for sc in config["scrape_configs"]:
        for st in sc.get("static_configs", []):
            for target in st["targets"]:
                port = int(target.rsplit(":", 1)[1])
                name = {9464: "kvcm-manager"}.get(port, "kvcm-agent" if 9465 <= port < 9600 else None)
                if name:
                    jobs.setdefault(name, set()).add(sc["job_name"])
    return jobs


def selectors(deploy):
    """Every job="..." an alert expression selects."""
    rules = yaml.safe_load((deploy / "kvcm-alerts.yaml").read_text())
    found = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            for job in re.findall(r'job\s*=\s*"([^"]*)"', rule["expr"]):
                found.add((rule.get("alert", rule.get("record")), job))
    return found


def check(name, jobs, deploy):
    print(f"{name}: jobs {{{', '.join(f'{k}: {sorted(v)}' for k, v in sorted(jobs.items()))}}}")
    for component_name in COMPONENTS:
        if len(jobs.get(component_name, ())) != 1:
            fail(f"{name}: {component_name} gets jobs {sorted(jobs.get(component_name, []))} (want one)")
    all_jobs = set().union(*jobs.values()) if jobs else set()
    for alert, job in sorted(selectors(deploy)):
        if job not in all_jobs:
            fail(f"{name}: alert {alert} selects job=\"{job}\", which no target gets ({sorted(all_jobs)})")
    if not shutil.which("promtool"):
        print(f"{name}: promtool not found: alert rule tests skipped")
        return
    mapping = {c: sorted(jobs[c])[0] for c in COMPONENTS if jobs.get(c)}
    tests = yaml.safe_load((deploy / "kvcm-alerts_test.yaml").read_text())
    rewritten = copy.deepcopy(tests)
    for t in rewritten["tests"]:
        for s in t.get("input_series", []):
            s["series"] = re.sub(r'job="([^"]*)"',
                                 lambda g: f'job="{mapping.get(g.group(1), g.group(1))}"', s["series"])
        for a in t.get("alert_rule_test", []):
            for e in a.get("exp_alerts", []):
                labels = e.get("exp_labels", {})
                if labels.get("job") in mapping:
                    labels["job"] = mapping[labels["job"]]
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(deploy / "kvcm-alerts.yaml", tmp)
        path = pathlib.Path(tmp) / "kvcm-alerts_test.yaml"
        path.write_text(yaml.safe_dump(rewritten, sort_keys=False))
        run = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
        if run.returncode != 0:
            fail(f"{name}: promtool test rules with jobs {mapping}:\n{run.stdout}{run.stderr}")
        else:
            print(f"{name}: promtool test rules passed with jobs {mapping}")


def main():
    mode = sys.argv[1]
    if mode == "static":
        deploy = pathlib.Path(sys.argv[2])
        check("prometheus.yml static", static_jobs(deploy), deploy)
    elif mode == "render":
        render, deploy = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
        objs = [d for d in yaml.safe_load_all(render.read_text()) if d]
        if any(o["apiVersion"].startswith("monitoring.coreos.com/") for o in objs):
            check(f"{render.stem} operator", operator_jobs(objs), deploy)
        check(f"{render.stem} plain kubernetes-pods", plain_jobs(objs, deploy), deploy)
    else:
        sys.exit(f"unknown mode {mode}")
    print(f"{failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
