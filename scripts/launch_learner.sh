#!/usr/bin/env bash
# Start a learner from a TOML in daemon/ (default daemon/learner.toml).
#   scripts/launch_learner.sh [--nproc-per-node N] [--nnodes M --rdzv-endpoint HOST:PORT [--node-rank R]]
#                             [CONFIG.toml] [extra `echo2swarm daemon` flags...]
# With N = 1 and M = 1 (the default) the learner is one plain process. Otherwise torchrun starts
# N ranks on this node (M nodes: run the same command on each with the same endpoint; with
# --node-rank, node 0 is HOST and holds rank 0, else torchrun's c10d rendezvous at HOST:PORT puts
# rank 0 on any node): rank 0 runs the daemon (DHT, leases, intake, publisher, chunk service) and
# every rank trains its shards of the policy (FSDP2; docs/operations.md "A learner on several GPUs").
# Creates the model directory and policy key named in the config if they are missing, then runs
# the learner in the foreground. A missing model becomes the demo's starting model: a tiny local
# model with the same supervised warm-up on arith (`echo2swarm tiny-model DIR --task arith`), so
# GRPO starts from a model that sometimes answers right and the reward can rise. Once up, the
# learner prints what it trains, how a rollout peer joins, and where its live page and /metrics are:
#   echo2swarm daemon --role rollout --price 0.3 --initial-peers <address> --trust <policy_key>.pub
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
nproc=1 nnodes=1 endpoint="" rdzv_id="echo2swarm-learner" node_rank=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc-per-node) nproc="${2:?--nproc-per-node needs a number}"; shift 2 ;;
    --nproc-per-node=*) nproc="${1#*=}"; shift ;;
    --nnodes) nnodes="${2:?--nnodes needs a number}"; shift 2 ;;
    --nnodes=*) nnodes="${1#*=}"; shift ;;
    --rdzv-endpoint) endpoint="${2:?--rdzv-endpoint needs HOST:PORT}"; shift 2 ;;
    --rdzv-endpoint=*) endpoint="${1#*=}"; shift ;;
    --rdzv-id) rdzv_id="${2:?--rdzv-id needs a name}"; shift 2 ;;
    --rdzv-id=*) rdzv_id="${1#*=}"; shift ;;
    --node-rank) node_rank="${2:?--node-rank needs a number}"; shift 2 ;;
    --node-rank=*) node_rank="${1#*=}"; shift ;;
    *) break ;;
  esac
done
case "$nproc$nnodes$node_rank" in *[!0-9]*) echo "error: --nproc-per-node --nnodes and --node-rank take whole numbers" >&2; exit 2 ;; esac
[ "$nproc" -ge 1 ] && [ "$nnodes" -ge 1 ] || { echo "error: --nproc-per-node and --nnodes must be >= 1" >&2; exit 2; }
if [ "$nnodes" -gt 1 ] && [ -z "$endpoint" ]; then
  echo "error: --nnodes $nnodes needs --rdzv-endpoint HOST:PORT (a host every node reaches, e.g. the first node)" >&2
  exit 2
fi
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
if [ "$nproc" -eq 1 ] && [ "$nnodes" -eq 1 ]; then
  exec "$bin" daemon --config "$config" "$@"
fi
# torchrun runs `echo2swarm daemon` once per rank; ranks 1..W-1 see RANK > 0 and only train.
# If any rank dies, torchrun stops the others (no restarts: the learner resumes from its checkpoint).
if [ "$nnodes" -eq 1 ] && [ -z "$endpoint" ]; then
  rdzv=(--standalone)
elif [ -n "$node_rank" ]; then  # static: node 0 is HOST and runs rank 0 (the daemon)
  rdzv=(--node-rank "$node_rank" --master-addr "${endpoint%:*}" --master-port "${endpoint##*:}")
else
  rdzv=(--rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "$rdzv_id")
fi
echo "sharded learner: $nnodes node(s) x $nproc rank(s)"
# glibc serves allocations above 1 MiB by mmap, so FSDP's freed per-layer all-gather and reduce-scatter
# buffers go back to the system instead of staying in the heap: a CPU rank's peak at W=2 is 0.53x of one
# process's instead of 0.63x (docs/benchmarks.md, bench_learner). Host memory only; set it to override.
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1048576}"
exec "$py" -m torch.distributed.run --nnodes "$nnodes" --nproc-per-node "$nproc" "${rdzv[@]}" --max-restarts 0 \
  --no-python "$bin" daemon --config "$config" "$@"
