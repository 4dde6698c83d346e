#!/usr/bin/env bash
# ctest k8s_tls_names_test: do the certificates name what each process is dialled by?
# Renders the production overlay and makes, with openssl, the certificates it runs with:
#   - the manager's, with the subjectAltNames README.md's operator block gives it (`leaf
#     manager ...`), checked against every name of the kvcm-manager Service a pod can dial
#     (kvcm-manager, .kvcm, .kvcm.svc, .kvcm.svc.cluster.local; the agents' --manager_address
#     among them);
#   - two agent pods' certificates as cert-manager's csi-driver issues them (the volume's
#     csi.cert-manager.io/dns-names, ${POD_NAME} and ${POD_NAMESPACE} substituted), checked
#     against the host each pod's agents advertise (KVCM_ADVERTISE_HOST, $(POD_NAME)
#     substituted): each verifies for its own pod's name and not for the other pod's, and
#     for kvcm-agent-local.<namespace>.svc, the node-local Service engines dial.
# `openssl verify -verify_hostname` does the checking, as a TLS client does.
#   tests/k8s_tls_names_test.sh README.md [VENV]   # VENV: default build/k8s-venv
# Exit 77 (skip) without VENV's kubectl, unless KVCM_REQUIRE_K8S=1.
set -euo pipefail
readme=$(realpath "$1")
cd "$(dirname "$0")/.."
venv=${2:-${KVCM_K8S_VENV:-build/k8s-venv}}
if [ ! -x "$venv/bin/kubectl" ]; then
  if [ "${KVCM_REQUIRE_K8S:-0}" = 1 ]; then
    echo "FAIL: no kubectl in $venv (scripts/k8s_env.sh $venv)" >&2
    exit 1
  fi
  echo "SKIP: no kubectl in $venv (scripts/k8s_env.sh $venv makes it)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$venv/bin/kubectl" kustomize deploy/k8s/overlays/production > "$work/production.yaml"
# name=value lines read from the render.
"$venv/bin/python" - "$work/production.yaml" > "$work/render.env" <<'PY'
import sys, yaml
objs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
ds = next(o for o in objs if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "kvcm-agent")
pod = ds["spec"]["template"]["spec"]
c = pod["containers"][0]
env = {e["name"]: e.get("value", "") for e in c["env"]}
tls = next(v for v in pod["volumes"] if v["name"] == "tls")["csi"]["volumeAttributes"]
manager = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--manager_address="))
print(f"namespace={ds['metadata']['namespace']}")
print(f"manager_host={manager.rsplit(':', 1)[0]}")
print(f"agent_dns_names={tls['csi.cert-manager.io/dns-names']}")
print(f"agent_advertise={env['KVCM_ADVERTISE_HOST']}")
PY
namespace=$(sed -n 's/^namespace=//p' "$work/render.env")
manager_host=$(sed -n 's/^manager_host=//p' "$work/render.env")
agent_dns_names=$(sed -n 's/^agent_dns_names=//p' "$work/render.env")
agent_advertise=$(sed -n 's/^agent_advertise=//p' "$work/render.env")

# The manager's subjectAltNames, as README.md's operator block makes its certificate.
manager_sans=$(sed -n 's/^leaf manager \([^ ]*\).*/\1/p' "$readme")
[ -n "$manager_sans" ] || { echo "FAIL: no 'leaf manager SANS' line in $readme"; exit 1; }
echo "manager subjectAltName=$manager_sans"

cd "$work"
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1"
openssl req -x509 $ec -subj "/CN=test CA" -keyout ca.key -out ca.pem 2> /dev/null
leaf() {  # leaf NAME SUBJECT_ALT_NAMES
  openssl req -x509 -CA ca.pem -CAkey ca.key $ec -subj "/CN=$1" -keyout "$1.key" -out "$1.pem" \
      -addext "subjectAltName=$2" -addext basicConstraints=critical,CA:FALSE \
      -addext extendedKeyUsage=serverAuth,clientAuth 2> /dev/null
}
verifies() {  # verifies CERT HOST
  openssl verify -CAfile ca.pem -verify_hostname "$2" "$1.pem" > /dev/null 2>&1
}
leaf manager "$manager_sans"
for name in "$manager_host" kvcm-manager kvcm-manager.$namespace kvcm-manager.$namespace.svc \
            kvcm-manager.$namespace.svc.cluster.local; do
  if verifies manager "$name"; then echo "ok: manager certificate verifies for $name"
  else fail "the manager's certificate ($manager_sans) does not name $name"; fi
done

# Two agent pods, as csi-driver substitutes its variables (os.Expand) and the kubelet $(VAR).
for pod in kvcm-agent-7xk2p kvcm-agent-q9d4m; do
  sans=${agent_dns_names//'${POD_NAME}'/$pod}
  sans=${sans//'${POD_NAMESPACE}'/$namespace}
  leaf "$pod" "$(sed 's/\([^,]*\)/DNS:\1/g' <<< "$sans")"
done
for pod in kvcm-agent-7xk2p kvcm-agent-q9d4m; do
  host=$(sed "s/\$(POD_NAME)/$pod/g; s/\$(POD_NAMESPACE)/$namespace/g" <<< "$agent_advertise")
  [[ $host != *'$'* ]] || fail "advertised host $host has an unknown variable"
  if verifies "$pod" "$host"; then echo "ok: $pod's certificate verifies for its advertised $host"
  else fail "$pod's certificate does not name the host its agents advertise, $host"; fi
  other=$([ $pod = kvcm-agent-7xk2p ] && echo kvcm-agent-q9d4m || echo kvcm-agent-7xk2p)
  if verifies "$other" "$host"; then fail "$other's certificate verifies for $pod's $host"
  else echo "ok: $other's certificate does not verify for $host"; fi
  if verifies manager "$host"; then fail "the manager's certificate verifies for $host"; fi
  # Engines dial their node's agent through the node-local Service.
  if verifies "$pod" "kvcm-agent-local.$namespace.svc"; then
    echo "ok: $pod's certificate verifies for kvcm-agent-local.$namespace.svc"
  else fail "$pod's certificate does not name kvcm-agent-local.$namespace.svc (engines dial it)"; fi
done
echo "$failures failure(s)"
[ $failures = 0 ]
