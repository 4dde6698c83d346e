#!/usr/bin/env bash
# Makes throw-away TLS certificates for tests and demos with the openssl CLI (never check
# them in; never use them in production).
#   scripts/make_test_certs.sh DIR [AGENT_ID ...]     # agents default to agent-0 agent-1
# Writes into DIR (created if missing), every key an unencrypted P-256 PEM:
#   ca.pem ca.key                   the trusted CA
#   manager.pem manager.key         server certificate of kvcm-manager
#   <agent_id>.pem <agent_id>.key   one per agent: its servers, and its client certificate;
#                                   an argument ID@NAME[,NAME...] adds each NAME to ID's
#                                   subjectAltNames: a DNS name (an agent named by its
#                                   certificate, docs/SECURITY.md), or one typed as openssl
#                                   writes it (URI:..., email:..., DNS:...). The subject's
#                                   common name is the ID.
#   client.pem client.key           a worker's / kvcmctl's client certificate
#   untrusted-ca.pem untrusted-ca.key, untrusted.pem untrusted.key
#                                   a second CA nobody trusts, and a certificate it signed
# Server certificates (manager, agents, untrusted) are valid for localhost and 127.0.0.1
# (subjectAltName) and for both server and client use; client.pem for client use only.
# tests/util/test_certs.h runs this script.
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 DIR [AGENT_ID ...]" >&2
  exit 2
fi
dir=$1
shift
agents=("$@")
[ ${#agents[@]} -gt 0 ] || agents=(agent-0 agent-1)
command -v openssl >/dev/null || { echo "$0: openssl not found (apt-get install openssl)" >&2; exit 1; }

mkdir -p "$dir"
cd "$dir"
umask 077

# A config of our own, so that the system openssl.cnf's defaults add nothing.
cat >openssl.cnf <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
EOF

days=3650
newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)

make_ca() {  # name subject
  openssl req -x509 -config openssl.cnf "${newkey[@]}" -keyout "$1.key" -out "$1.pem" \
    -days "$days" -subj "/CN=$2" -extensions ca 2>/dev/null
}

make_leaf() {  # name subject ca extensions
  openssl req -new -config openssl.cnf "${newkey[@]}" -keyout "$1.key" -out "$1.csr" \
    -subj "/CN=$2" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -set_serial "0x$(openssl rand -hex 16)" \
    -days "$days" -extfile openssl.cnf -extensions "$4" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr"
}

make_ca ca "kvcm test CA"
make_ca untrusted-ca "kvcm untrusted test CA"
make_leaf manager kvcm-manager ca server
for a in "${agents[@]}"; do
  if [[ $a == *@* ]]; then
    # A section of its own: the server one plus the extra names.
    sans=""
    IFS=',' read -ra names <<<"${a#*@}"
    for n in "${names[@]}"; do
      case $n in
        DNS:* | URI:* | email:* | IP:*) sans+=", $n" ;;
        *) sans+=", DNS:$n" ;;
      esac
    done
    printf '[%s]\nbasicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature\nextendedKeyUsage = serverAuth, clientAuth\nsubjectAltName = DNS:localhost, IP:127.0.0.1%s\n' \
      "ext_${a%%@*}" "$sans" >>openssl.cnf
    make_leaf "${a%%@*}" "${a%%@*}" ca "ext_${a%%@*}"
  else
    make_leaf "$a" "$a" ca server
  fi
done
agents=("${agents[@]%%@*}")
make_leaf client kvcm-client ca client
make_leaf untrusted kvcm-untrusted untrusted-ca server
rm -f openssl.cnf
chmod 644 ./*.pem
echo "test certificates in $PWD: ca.pem manager.pem ${agents[*]/%/.pem} client.pem untrusted.pem"
