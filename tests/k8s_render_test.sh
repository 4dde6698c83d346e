#!/usr/bin/env bash
# Renders every overlay of deploy/k8s with `kubectl kustomize` and validates each object
# against the Kubernetes OpenAPI schemas offline (kubernetes-validate bundles them), strict
# (unknown fields refused). Custom resources (monitoring.coreos.com: ServiceMonitor,
# PodMonitor; cert-manager.io: Issuer) have no schema there and are skipped explicitly, by
# name. Also checks that production requires TLS and that no Secret value is a literal
# outside the dev overlay, and (issue 26):
#   - agents: one per GPU (the launcher, GPUS_PER_NODE ports, no nvidia.com/gpu request), each
#     pod able to read only its own credential (production: a csi-driver certificate naming
#     ${POD_NAME}, no token Secret; dev: one dummy token), readiness = registered, liveness =
#     the launcher's --alive; engines' node-local Service kvcm-agent-local (50052 + 10 i);
#     dev runs on a plain kind cluster (no GPU, runtime class or node selector);
#   - managers and etcd members one per node (required anti-affinity; a preference in dev),
#     the managers' rolling update one pod at a time in place;
#   - NetworkPolicies: clients in this namespace or a labelled one admitted, others not;
#   - monitors and the plain kubernetes-pods job: the job labels of every target, derived as
#     prometheus-operator and Prometheus do, match the alert rules' selectors, and promtool's
#     alert rule tests pass with them (tests/alert_jobs.py; skipped without promtool).
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
CRD_GROUPS = ("monitoring.coreos.com/", "cert-manager.io/")  # no schema offline: skipped, by name
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


def merged_config(objs, name):
    for o in objs:
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(name):
            return o.get("data", {})
    return {}

def check_agents(overlay, objs):
    ds = next(o for o in objs if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "kvcm-agent")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e for e in c.get("env", [])}
    config = merged_config(objs, "kvcm-agent-config")
    gpus = int(config.get("GPUS_PER_NODE", "0"))
    check(gpus >= 1, f"{overlay}: GPUS_PER_NODE {config.get('GPUS_PER_NODE')}")
    check(0 < float(config.get("POOL_GPU_FRACTION", "0")) <= 0.9, f"{overlay}: POOL_GPU_FRACTION")
    # The GPU share is one number: the agent ConfigMap's. Engines read the pool's size from
    # their agent (deploy/README.md, "Engines"), so no other object may carry a copy to drift.
    copies = [f"{o['kind']}/{o['metadata']['name']}" for o in objs
              if "POOL_GPU_FRACTION" in yaml.safe_dump(o) and not (
                  o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("kvcm-agent-config"))]
    check(not copies, f"{overlay}: POOL_GPU_FRACTION outside kvcm-agent-config: {copies}")
    check(c.get("command") == ["kvcm-agent-launcher"], f"{overlay}: agent command {c.get('command')}")
    if overlay == "dev":
        # A plain kind cluster: no GPU, no NVIDIA runtime, no node picked by name or GPU label;
        # the launcher's stand-in GPU list and a host-memory pool instead.
        check("runtimeClassName" not in pod, f"dev: agent runtimeClassName {pod.get('runtimeClassName')}")
        check(not pod.get("nodeSelector") and "nodeName" not in pod,
              f"dev: agent pinned to nodes {pod.get('nodeSelector') or pod.get('nodeName')}")
        check(config.get("KVCM_GPUS") and "--use_device=false" in c.get("args", []),
              "dev: agents need KVCM_GPUS and --use_device=false without a GPU")
    else:
        check(pod.get("runtimeClassName") == "nvidia", f"{overlay}: agent runtimeClassName")
        check(env.get("NVIDIA_VISIBLE_DEVICES", {}).get("value") == "all", f"{overlay}: NVIDIA_VISIBLE_DEVICES")
        check("utility" in env.get("NVIDIA_DRIVER_CAPABILITIES", {}).get("value", ""),
              f"{overlay}: nvidia-smi needs NVIDIA_DRIVER_CAPABILITIES utility")
    # The launcher's ports: GPU i's agent on 50052/50053/9465 + 10 i, each declared.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    want = {}
    for i in range(gpus):
        want.update({f"blockagent-g{i}": 50052 + 10 * i, f"data-g{i}": 50053 + 10 * i,
                     f"metrics-g{i}": 9465 + 10 * i})
    check(ports == want, f"{overlay}: agent ports {ports}, want {want} (GPUS_PER_NODE={gpus})")
    # Engines reach their node's agent of GPU i at kvcm-agent-local:50052 + 10 i, node-local.
    local = next((o for o in objs if o["kind"] == "Service" and
                  o["metadata"]["name"] == "kvcm-agent-local"), None)
    check(local is not None, f"{overlay}: no Service kvcm-agent-local for engines")
    if local is not None:
        check(local["spec"].get("internalTrafficPolicy") == "Local",
              f"{overlay}: kvcm-agent-local must be internalTrafficPolicy Local (node-local agents)")
        check(local["spec"].get("selector") == ds["spec"]["selector"]["matchLabels"],
              f"{overlay}: kvcm-agent-local selects {local['spec'].get('selector')}")
        served = {p["port"]: p["targetPort"] for p in local["spec"]["ports"]}
        check(served == {50052 + 10 * i: f"blockagent-g{i}" for i in range(gpus)},
              f"{overlay}: kvcm-agent-local ports {served}, want 50052 + 10 i -> blockagent-g<i>")
    # Readiness is registration (the launcher's --check), never a bare TCP connect.
    check(c["readinessProbe"].get("exec", {}).get("command") == ["kvcm-agent-launcher", "--check"],
          f"{overlay}: agent readiness must be registration (kvcm-agent-launcher --check)")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check("tcpSocket" not in c.get(probe, {}), f"{overlay}: agent {probe} is a TCP probe")
    # Liveness covers every agent and tolerates one being restarted by the launcher: a probe
    # of one agent's port would restart the whole pod (every GPU's cache) with it.
    check(c["livenessProbe"].get("exec", {}).get("command") == ["kvcm-agent-launcher", "--alive"],
          f"{overlay}: agent liveness must be kvcm-agent-launcher --alive")
    # Credentials: no agent pod may read another's. The tokens file holds hashes only.
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounted = {m["name"] for m in c.get("volumeMounts", [])}
    args = c.get("args", [])
    for name, v in volumes.items():
        secrets = []
        if "secret" in v:
            secrets.append((v["secret"]["secretName"], v["secret"].get("items")))
        for src in v.get("projected", {}).get("sources", []):
            if "secret" in src:
                secrets.append((src["secret"]["name"], src["secret"].get("items")))
        for secret, items in secrets:
            if secret.startswith("kvcm-tokens"):
                check(items == [{"key": "tokens", "path": "tokens"}], f"{overlay}: tokens items")
                continue
            check(overlay == "dev", f"{overlay}: agent pods mount Secret {secret}, the same in "
                  "every pod: each could read every agent's credential")
            check(items is not None and len(items) == 1,
                  f"{overlay}: agent pods mount all of Secret {secret} (every node's credential)")
    if overlay != "dev":
        check(not any(a.startswith("--token_file") for a in args), f"{overlay}: agent token file")
        tls = volumes.get("tls", {}).get("csi", {})
        attrs = tls.get("volumeAttributes", {})
        check(tls.get("driver") == "csi.cert-manager.io" and "tls" in mounted,
              f"{overlay}: agent TLS must be the pod's own csi.cert-manager.io certificate")
        names = attrs.get("csi.cert-manager.io/dns-names", "").split(",")
        # The pod's own name (its identity) and the node-local Service's, which is not under
        # the identity suffix (.kvcm-agent.<namespace>.svc), so it names no agent.
        check(names == ["${POD_NAME}.kvcm-agent.${POD_NAMESPACE}.svc",
                        "kvcm-agent-local.${POD_NAMESPACE}.svc"],
              f"{overlay}: agent certificate names {names}")
        check(pod.get("subdomain") == "kvcm-agent", f"{overlay}: agent subdomain")
        check("server auth" in attrs.get("csi.cert-manager.io/key-usages", "") and
              "client auth" in attrs.get("csi.cert-manager.io/key-usages", ""),
              f"{overlay}: agent certificate key usages")
        issuer = attrs.get("csi.cert-manager.io/issuer-name")
        check(any(o["kind"] == "Issuer" and o["metadata"]["name"] == issuer for o in objs) or
              attrs.get("csi.cert-manager.io/issuer-kind") == "ClusterIssuer",
              f"{overlay}: agent certificate Issuer {issuer} not in the render")
        # The agents advertise, and the manager maps, the name in the certificate.
        advertised = env.get("KVCM_ADVERTISE_HOST", {}).get("value", "")
        check(advertised == names[0].replace("${", "$(").replace("}", ")"),
              f"{overlay}: KVCM_ADVERTISE_HOST {advertised} is not the certificate's name")
        check("--agent_identity_dns_suffix=.kvcm-agent.$(POD_NAMESPACE).svc" in args,
              f"{overlay}: agent --agent_identity_dns_suffix")
        manager_conf = "".join(o.get("data", {}).get("kvcm-manager.conf", "") for o in objs)
        ns = ds["metadata"].get("namespace", "")
        check(f"agent_identity_dns_suffix = .kvcm-agent.{ns}.svc" in manager_conf,
              f"{overlay}: manager agent_identity_dns_suffix for namespace {ns}")
    check(any(a.startswith("--tokens_file=") for a in args), f"{overlay}: agent tokens_file")

def peer_admitted(rule_from, policy_ns, pod_ns, ns_labels, pod_labels):
    for peer in rule_from:
        if set(peer) - {"podSelector", "namespaceSelector"}:
            check(False, f"peer {peer}: ipBlock not modelled")
            continue
        ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
        ns_ok = pod_ns == policy_ns if ns_sel is None else all(
            ns_labels.get(k) == v for k, v in ns_sel.get("matchLabels", {}).items())
        pod_ok = pod_sel is None or all(
            pod_labels.get(k) == v for k, v in pod_sel.get("matchLabels", {}).items())
        if ns_ok and pod_ok:
            return True
    return False

def admitted(objs, target_labels, port, pod_ns, ns_labels, pod_labels):
    policies = [o for o in objs if o["kind"] == "NetworkPolicy" and all(
        target_labels.get(k) == v for k, v in o["spec"]["podSelector"].get("matchLabels", {}).items())]
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports):
                continue
            if peer_admitted(rule.get("from", []), pol["metadata"].get("namespace", "default"),
                             pod_ns, ns_labels, pod_labels):
                return True
    return False

def check_network_policies(overlay, objs):
    ns = next(o["metadata"]["name"] for o in objs if o["kind"] == "Namespace")
    gpus = int(merged_config(objs, "kvcm-agent-config").get("GPUS_PER_NODE", "1"))
    manager, agent = {"app.kubernetes.io/name": "kvcm-manager"}, {"app.kubernetes.io/name": "kvcm-agent"}
    client = {"kvcm.io/client": "true"}
    engines_ns = {"kubernetes.io/metadata.name": "engines", "kvcm.io/clients": "true"}
    other_ns = {"kubernetes.io/metadata.name": "other"}
    own_ns = {"kubernetes.io/metadata.name": ns}
    targets = [("manager", manager, 50051)] + [
        (f"agent gpu{i} BlockAgent", agent, 50052 + 10 * i) for i in range(gpus)]
    for what, labels, port in targets:
        check(admitted(objs, labels, port, ns, own_ns, client),
              f"{overlay}: a client in {ns} cannot reach the {what} ({port})")
        check(admitted(objs, labels, port, "engines", engines_ns, client),
              f"{overlay}: a client in a namespace labelled kvcm.io/clients cannot reach the {what}")
        check(not admitted(objs, labels, port, "other", other_ns, client),
              f"{overlay}: a client in an unlabelled namespace reaches the {what}")
        check(not admitted(objs, labels, port, "engines", engines_ns, {"app": "x"}),
              f"{overlay}: an unlabelled pod of a labelled namespace reaches the {what}")
    for i in range(gpus):
        check(admitted(objs, agent, 9465 + 10 * i, "monitoring",
                       {"kubernetes.io/metadata.name": "monitoring"}, {}),
              f"{overlay}: Prometheus cannot scrape agent gpu{i} (port {9465 + 10 * i})")
    check(not admitted(objs, agent, 50053, "engines", engines_ns, client),
          f"{overlay}: clients reach the agents' data port")

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
                # One agent per GPU, sharing the node's GPUs with the engines: no GPU taken.
                for kind in ("requests", "limits"):
                    check("nvidia.com/gpu" not in c["resources"][kind],
                          f"{overlay}: the agent pod {kind} nvidia.com/gpu (engines lose it)")
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
    # One manager (and one etcd member) per node, required outside dev: a preference lets a
    # busy cluster put both on one node. Then a rolling update cannot surge (a third node free
    # of managers may not exist): it replaces one pod at a time while the other serves. Dev
    # (one kind node) keeps a preference, or its second manager would stay Pending.
    for what, obj in (("manager", manager), ("etcd", etcd)):
        if obj is None:
            continue
        anti = obj["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
        required = anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        on_hosts = [t for t in required if t.get("topologyKey") == "kubernetes.io/hostname"]
        if overlay == "dev":
            check(not required, f"dev: {what} anti-affinity required (one kind node)")
        else:
            check(len(on_hosts) == 1 and "preferredDuringSchedulingIgnoredDuringExecution" not in anti,
                  f"{overlay}: {what} anti-affinity by node must be required, not preferred: {anti}")
    if manager is not None:
        anti = manager["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
        if overlay == "dev":
            check("preferredDuringSchedulingIgnoredDuringExecution" in anti,
                  "dev: manager anti-affinity should stay a preference")
        rolling = manager["spec"]["strategy"].get("rollingUpdate", {})
        check(rolling.get("maxSurge") == 0 and rolling.get("maxUnavailable") == 1,
              f"{overlay}: manager rollingUpdate {rolling}, want maxSurge 0, maxUnavailable 1")
        pdb = by_name.get(("PodDisruptionBudget", "kvcm-manager"))
        check(pdb is not None and pdb["spec"].get("minAvailable") == 1,
              f"{overlay}: manager PodDisruptionBudget must keep one manager")
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

    if "DaemonSet" in kinds:
        check_agents(overlay, objs)
    check_network_policies(overlay, objs)

print(f"{failures} failure(s)")
sys.exit(1 if failures else 0)
PY

# The job labels every target gets, against the alert rules (promtool's tests when present).
for render in "$out"/*.yaml; do
  "$venv/bin/python" tests/alert_jobs.py render "$render" deploy/prometheus
done
