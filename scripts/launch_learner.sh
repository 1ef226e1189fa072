#!/usr/bin/env bash
# Start a learner from a TOML in daemon/ (default daemon/learner.toml).
#   scripts/launch_learner.sh [CONFIG.toml] [extra `echo2swarm daemon` flags...]
# Creates the model directory and policy key named in the config if they are missing (a tiny
# local model, for trying things out), then runs the learner in the foreground. Rollout peers join
# with the address it prints:
#   echo2swarm daemon --role rollout --price 0.3 --initial-peers <address> --trust <policy_key>.pub
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
config="${1:-$here/daemon/learner.toml}"
[ $# -gt 0 ] && shift
[ -f "$config" ] || { echo "error: config $config not found" >&2; exit 2; }

if [ -n "${ECHO2SWARM_BIN:-}" ]; then
  bin="$ECHO2SWARM_BIN"
elif [ -x "$here/.venv/bin/echo2swarm" ]; then
  bin="$here/.venv/bin/echo2swarm"
else
  bin="$(command -v echo2swarm)" || { echo "error: echo2swarm not installed; run 'make install'" >&2; exit 2; }
fi
py="$(dirname "$bin")/python"

# Read [publish] model and policy_key from the TOML (paths relative to where you run this).
read -r model key < <("$py" - "$config" <<'PY'
import sys, tomllib
cfg = tomllib.load(open(sys.argv[1], "rb")).get("publish", {})
print(cfg.get("model", ""), cfg.get("policy_key", ""))
PY
)
if [ -n "$model" ] && [ ! -e "$model/config.json" ]; then
  echo "model $model missing: writing a tiny local model there"
  "$bin" tiny-model "$model"
fi
if [ -n "$key" ] && [ ! -e "$key" ]; then
  "$bin" keygen "$key"
fi
[ -n "$key" ] && echo "rollout peers pin this learner with: --trust $key.pub"
exec "$bin" daemon --config "$config" "$@"
