#!/usr/bin/env bash
# triode replicas behind vllm-router on this machine (docs/deployment.md): REPLICAS servers of
# MODEL, each publishing its KV-cache events, and the router in front of them. Ctrl-C or
# SIGTERM stops them all. The settings, with their defaults:
#   REPLICAS=2  POLICY=kv_aware  NAME=triode  ROUTER_PORT=30000  FIRST_PORT=8001
#   FIRST_EVENTS_PORT=5557 (replica i publishes on FIRST_EVENTS_PORT + 2i, replays on the next)
#   BLOCK_SIZE=16 (the replicas' KV block size, which the router must know for kv_aware)
#   TRIODE_BIN / ROUTER_BIN: the triode and vllm-router commands (default: from PATH)
# Any further arguments go to every `triode serve`.
set -euo pipefail

model=${1:?usage: deploy/local-replicas.sh MODEL [triode serve flags...]}
shift
replicas=${REPLICAS:-2}
policy=${POLICY:-kv_aware}
name=${NAME:-triode}
router_port=${ROUTER_PORT:-30000}
first_port=${FIRST_PORT:-8001}
first_events=${FIRST_EVENTS_PORT:-5557}
triode=${TRIODE_BIN:-triode}
router=${ROUTER_BIN:-vllm-router}
block_size=${BLOCK_SIZE:-16}

trap 'trap - TERM; kill -TERM 0 2>/dev/null; wait' INT TERM EXIT

urls=()
event_flags=()
for ((i = 0; i < replicas; i++)); do
    port=$((first_port + i))
    events=$((first_events + 2 * i))
    url="http://127.0.0.1:$port"
    "$triode" serve "$model" --host 127.0.0.1 --port "$port" --served-model-name "$name" --block-size "$block_size" \
        --kv-events-config "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:$events\", \"replay_endpoint\": \"tcp://*:$((events + 1))\"}" \
        "$@" &
    urls+=("$url")
    event_flags+=(--kv-event-source "$url=tcp://127.0.0.1:$events"
                  --kv-event-replay-source "$url=tcp://127.0.0.1:$((events + 1))")
done

for url in "${urls[@]}"; do  # the router starts routing once its workers answer /health
    until curl -sf "$url/health" >/dev/null; do sleep 0.5; done
    echo "replica ready: $url"
done

policy_flags=()
if [[ $policy == kv_aware ]]; then
    policy_flags=("${event_flags[@]}" --kv-event-model "$name" --kv-event-block-size "$block_size")
fi
"$router" --worker-urls "${urls[@]}" --policy "$policy" --host 127.0.0.1 --port "$router_port" \
    --worker-startup-check-interval 1 --health-check-interval-secs 2 --health-failure-threshold 2 \
    "${policy_flags[@]}" &
until curl -sf "http://127.0.0.1:$router_port/readiness" >/dev/null; do sleep 0.5; done
echo "router ready: http://127.0.0.1:$router_port ($policy over ${#urls[@]} replicas)"
wait
