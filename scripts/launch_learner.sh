#!/usr/bin/env bash
# Start a learner from a TOML in daemon/ (default daemon/learner.toml).
#   scripts/launch_learner.sh [CONFIG.toml] [extra `echo2swarm daemon` flags...]
# Creates the model directory and policy key named in the config if they are missing, then runs
# the learner in the foreground. A missing model becomes the demo's starting model: a tiny local
# model with the same supervised warm-up on arith (`echo2swarm tiny-model DIR --task arith`), so
# GRPO starts from a model that sometimes answers right and the reward can rise. Once up, the
# learner prints what it trains, how a rollout peer joins, and where its live page and /metrics are:
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

# Read [publish] model and policy_key, and [train] task, from the TOML (paths relative to where you run this).
IFS=$'\t' read -r model key task < <("$py" - "$config" <<'PY'
import sys, tomllib
cfg = tomllib.load(open(sys.argv[1], "rb"))
publish, train = cfg.get("publish", {}), cfg.get("train", {})
print("\t".join([publish.get("model") or "-", publish.get("policy_key") or "-", train.get("task", "arith")]))
PY
)
[ "$model" = "-" ] && model=""
[ "$key" = "-" ] && key=""
if [ -n "$model" ] && [ ! -e "$model/config.json" ]; then
  echo "model $model missing: writing the demo's starting model there, a tiny local model with a supervised"
  echo "warm-up on arith until it answers about 30 % of prompts right (under a minute on 2 cores), so the"
  echo "reward has room to rise; point [publish] model at a Hugging Face model directory for a real run"
  if [ "$task" != "arith" ]; then
    echo "note: this config trains task '$task'; the tiny model only knows arith and will likely earn no reward on it"
  fi
  "$bin" tiny-model "$model" --task arith
fi
if [ -n "$key" ] && [ ! -e "$key" ]; then
  "$bin" keygen "$key"
fi
echo "starting the learner ($config); once it is up it prints what it trains, how rollout peers join,"
echo "and where its live page and Prometheus /metrics are"
exec "$bin" daemon --config "$config" "$@"
