#!/usr/bin/env bash
# Renders every overlay of deploy/k8s with `kubectl kustomize` and validates each object
# against the Kubernetes OpenAPI schemas offline (kubernetes-validate bundles them), strict
# (unknown fields refused). Custom resources (monitoring.coreos.com: ServiceMonitor,
# PodMonitor) have no schema there and are skipped explicitly, by name. Also checks that
# production requires TLS and that no Secret value is a literal outside the dev overlay.
#   tests/k8s_render_test.sh [VENV]   # VENV: default build/k8s-venv (scripts/k8s_env.sh)
# Exit 77 (skip) when the venv is missing, unless KVCM_REQUIRE_K8S=1.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-${KVCM_K8S_VENV:-build/k8s-venv}}
k8s_version=${KVCM_K8S_VERSION:-1.33.0}

if [ ! -x "$venv/bin/kubectl" ] || [ ! -x "$venv/bin/python" ]; then
  if [ "${KVCM_REQUIRE_K8S:-0}" = 1 ]; then
    echo "FAIL: no kubectl in $venv (scripts/k8s_env.sh $venv)" >&2
    exit 1
  fi
  echo "SKIP: no kubectl in $venv (scripts/k8s_env.sh $venv makes it)"
  exit 77
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for overlay in deploy/k8s/overlays/*/; do
  name=$(basename "$overlay")
  "$venv/bin/kubectl" kustomize "$overlay" > "$out/$name.yaml"
  echo "rendered $overlay: $(grep -c '^kind:' "$out/$name.yaml") objects"
done

"$venv/bin/python" - "$k8s_version" "$out" <<'PY'
import pathlib, sys
import kubernetes_validate, yaml

version, out = sys.argv[1], pathlib.Path(sys.argv[2])
CRD_GROUPS = ("monitoring.coreos.com/",)  # no schema offline: skipped, by name
failures = 0
docs = {}
for path in sorted(out.glob("*.yaml")):
    objs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    docs[path.stem] = objs
    for obj in objs:
        what = f"{path.stem}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith(CRD_GROUPS):
            print(f"skipped (custom resource, no offline schema) {what}")
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            print(f"valid {what}")
        except kubernetes_validate.ValidationError as e:
            failures += 1
            print(f"INVALID {what}: {e.message} at {list(e.path)}")

def check(cond, message):
    global failures
    if not cond:
        failures += 1
        print("FAIL:", message)

for overlay, objs in docs.items():
    kinds = {o["kind"] for o in objs}
    for k in ("Deployment", "DaemonSet", "Service", "ConfigMap", "PodDisruptionBudget",
              "NetworkPolicy"):
        check(k in kinds, f"{overlay}: no {k}")
    for o in objs:
        if o["kind"] not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        pod = o["spec"]["template"]["spec"]
        check(pod["securityContext"].get("runAsNonRoot") is True, f"{overlay}: root pod")
        check(pod["securityContext"].get("seccompProfile", {}).get("type") == "RuntimeDefault",
              f"{overlay}: {o['kind']} seccomp")
        for c in pod["containers"]:
            sc = c["securityContext"]
            check(sc.get("readOnlyRootFilesystem") is True, f"{overlay}: writable root fs")
            check(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{overlay}: capabilities")
            check("limits" in c["resources"] and "requests" in c["resources"],
                  f"{overlay}: {c['name']} resources")
            # Secrets are files: no secret in argv, no env from a Secret.
            for a in c.get("args", []):
                check("secret_hex" not in a and "--token=" not in a, f"{overlay}: secret in argv {a}")
            for e in c.get("env", []):
                check("secretKeyRef" not in e.get("valueFrom", {}), f"{overlay}: secret in env")
            if o["kind"] == "DaemonSet":
                check(c["resources"]["limits"].get("nvidia.com/gpu") == 1, f"{overlay}: gpu limit")
    # High availability: two managers elect a leader on etcd; the standby does not listen on
    # gRPC, so probes must not need it and the Service must resolve to every manager pod.
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    manager = by_name.get(("Deployment", "kvcm-manager"))
    etcd = by_name.get(("StatefulSet", "kvcm-etcd"))
    check(manager is not None and manager["spec"]["replicas"] == 2, f"{overlay}: two managers")
    check(etcd is not None, f"{overlay}: no etcd StatefulSet")
    if etcd is not None:
        members = 1 if overlay == "dev" else 3
        check(etcd["spec"]["replicas"] == members, f"{overlay}: etcd members")
        env = {e["name"]: e.get("value", "") for e in etcd["spec"]["template"]["spec"]["containers"][0]["env"]}
        check(env["ETCD_INITIAL_CLUSTER"].count("=http://") == members,
              f"{overlay}: ETCD_INITIAL_CLUSTER lists {members} member(s)")
    if manager is not None:
        c = manager["spec"]["template"]["spec"]["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check(c[probe].get("httpGet", {}).get("port") == "metrics",
                  f"{overlay}: manager {probe} must read /metrics (a standby has no gRPC port)")
        check(any(a.startswith("--advertise_address=") for a in c["args"]),
              f"{overlay}: manager advertise_address")
    service = by_name.get(("Service", "kvcm-manager"))
    check(service is not None and service["spec"].get("clusterIP") == "None",
          f"{overlay}: kvcm-manager Service must be headless")
    check("etcd_endpoints = kvcm-etcd-0.kvcm-etcd:2379" in
          "".join(o.get("data", {}).get("kvcm-manager.conf", "") for o in objs),
          f"{overlay}: manager config has no etcd_endpoints")
    secrets = [o for o in objs if o["kind"] == "Secret"]
    check(overlay == "dev" or not secrets, f"{overlay}: literal Secrets outside dev")
    text = (out / f"{overlay}.yaml").read_text()
    if overlay == "production":
        check("insecure" not in text, "production: insecure")
        check("tls_ca_file = " in text and "--tls_ca_file=" in text, "production: mutual TLS")
    if overlay == "dev":
        check("insecure = true" in text, "dev: plaintext expected")

print(f"{failures} failure(s)")
sys.exit(1 if failures else 0)
PY
