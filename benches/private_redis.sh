# Sourced by the Redis load scripts: installs redis-server and
# redis-benchmark when missing, and starts a private redis-server on $PORT
# pinned to CPU 0 (no persistence), stopped when the script exits.
#
#   PORT=38200; source benches/private_redis.sh; cli PING
if ! command -v redis-server > /dev/null || ! command -v redis-benchmark > /dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools > /dev/null
fi
REDIS_DIR=$(mktemp -d)
taskset -c 0 redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$REDIS_DIR" > /dev/null &
REDIS_PID=$!
trap 'kill $REDIS_PID 2> /dev/null; rm -rf "$REDIS_DIR"' EXIT
for _ in $(seq 50); do redis-cli -p "$PORT" ping > /dev/null 2>&1 && break; sleep 0.1; done
cli() { redis-cli -p "$PORT" "$@"; }
