#!/usr/bin/env bash
# Start Ray on one Ascend node, advertising its NPUs as the Ray resource "NPU".
#
#   cluster/start-node.sh head   [--npus N] [--port P] [--dry-run] [-- EXTRA_RAY_START_ARGS...]
#   cluster/start-node.sh worker --head-address HOST:PORT [--npus N] [--dry-run] [-- EXTRA...]
#
# The NPU count comes from `npu-smi info -l` unless --npus is given (--npus 0 advertises none).
# serve_app's model replicas ask for `resources: {NPU: worldSize}`; Ray then sets
# ASCEND_RT_VISIBLE_DEVICES for each replica. Ray can also detect NPUs itself through CANN's acl
# module, but saying the count here keeps it explicit and works where acl is not importable.
# A head with no NPUs advertises none, so nothing that needs an NPU is placed there.
# --dry-run prints the `ray start` command instead of running it.
#
# Token authentication: Ray 2.60's `ray start` turns it on where a token exists
# (~/.ray/auth_token) and, with RAY_AUTH_MODE=token, refuses to start without one; it never
# writes one itself. Its CLI (`serve deploy`, `serve status`, ...) sends the token only when
# RAY_AUTH_MODE=token. This script starts Ray with RAY_AUTH_MODE=token unless the variable says
# otherwise, and on a head with no token generates one (`ray get-auth-token --generate`); export
# the same mode in the shells that run Ray's CLI. A worker needs the head's token:
# ~/.ray/auth_token copied from the head (or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH).
# RAY_AUTH_MODE=disabled on every node and CLI turns it off.
set -euo pipefail

CANN_ENV="${CANN_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}"

usage() {
    sed -n '4,5p' "$0" | sed 's/^# *//' >&2
    exit 2
}

die() {
    echo "start-node.sh: $*" >&2
    exit 2
}

# Logical NPUs on this node: the sum of "Chip Count" over the cards (a card may hold more than
# one chip, and Ray counts chips), else "Total Count", else the number of "NPU ID" lines.
detect_npus() {
    local info
    if ! command -v npu-smi >/dev/null 2>&1; then
        echo 0
        return
    fi
    if ! info="$(npu-smi info -l 2>/dev/null)"; then
        echo "start-node.sh: 'npu-smi info -l' failed; advertising 0 NPUs" >&2
        echo 0
        return
    fi
    awk -F: '
        /Chip Count/  { chips += $2; has_chips = 1 }
        /Total Count/ { total = $2 + 0; has_total = 1 }
        /NPU ID/      { ids += 1 }
        END {
            if (has_chips) print chips + 0
            else if (has_total) print total
            else print ids + 0
        }' <<<"$info"
}

# One word as a shell would read it back: bare when safe, else in single quotes.
quote() {
    if [[ "$1" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

[[ $# -ge 1 ]] || usage
role="$1"
shift
case "$role" in
    head | worker) ;;
    -h | --help) usage ;;
    *) die "first argument must be 'head' or 'worker', got '$role'" ;;
esac

head_address="${RAY_HEAD_ADDRESS:-}"
npus=""
port=6379
dry_run=0
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --head-address | --npus | --port)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            case "$1" in
                --head-address) head_address="$2" ;;
                --npus) npus="$2" ;;
                --port) port="$2" ;;
            esac
            shift 2
            ;;
        --head-address=*) head_address="${1#*=}"; shift ;;
        --npus=*) npus="${1#*=}"; shift ;;
        --port=*) port="${1#*=}"; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage ;;
        --) shift; extra=("$@"); break ;;
        *) die "unknown argument '$1'" ;;
    esac
done

# CANN puts the runtime libraries and acl on the paths; Ray's NPU support and torch_npu need them.
# set_env.sh reads unset variables, so relax -u while sourcing it.
if [[ -f "$CANN_ENV" ]]; then
    set +u
    # shellcheck source=/dev/null
    source "$CANN_ENV"
    set -u
fi

npus_given=1
if [[ -z "$npus" ]]; then
    npus_given=0
    npus="$(detect_npus)"
fi
[[ "$npus" =~ ^[0-9]+$ ]] || die "--npus must be a whole number >= 0, got '$npus'"
npus=$((10#$npus))

export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
token_file="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && ! -s "$token_file" ]]; then
    if [[ "$role" == worker ]]; then
        message="token authentication is on and $token_file is missing: copy the head's"
        message+=" ~/.ray/auth_token there (or set RAY_AUTH_TOKEN), or set RAY_AUTH_MODE=disabled"
        message+=" on every node and CLI"
        [[ "$dry_run" -eq 1 ]] || die "$message"
        echo "start-node.sh: warning: $message" >&2
    elif [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then  # Ray generates into ~/.ray/auth_token only
        die "RAY_AUTH_TOKEN_PATH names $token_file, which is missing"
    elif [[ "$dry_run" -eq 1 ]]; then
        echo "start-node.sh: would generate the cluster's token: ray get-auth-token --generate" >&2
    else
        ray get-auth-token --generate > /dev/null
        echo "start-node.sh: generated the cluster's token in $token_file: copy it to each" \
            "worker node and to each machine that runs serve deploy" >&2
    fi
fi

cmd=(ray start)
if [[ "$role" == head ]]; then
    cmd+=(--head "--port=$port" --dashboard-host=0.0.0.0)
else
    [[ -n "$head_address" ]] || die "worker needs --head-address HOST:PORT (or RAY_HEAD_ADDRESS)"
    cmd+=("--address=$head_address")
    if [[ "$npus" -eq 0 ]]; then
        echo "start-node.sh: warning: this worker advertises no NPUs" >&2
    fi
fi
# A node advertises NPU when it has some; an explicit --npus (0 included) is always passed, so it
# also overrides Ray's own detection.
if [[ "$npus" -gt 0 || "$npus_given" -eq 1 ]]; then
    cmd+=(--resources "{\"NPU\": $npus}")
fi
cmd+=("${extra[@]}")

if [[ "$dry_run" -eq 1 ]]; then
    words=("RAY_AUTH_MODE=$(quote "$RAY_AUTH_MODE")")
    for arg in "${cmd[@]}"; do
        words+=("$(quote "$arg")")
    done
    echo "${words[*]}"
    exit 0
fi
exec "${cmd[@]}"
