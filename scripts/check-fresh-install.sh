#!/usr/bin/env bash
# Proves that a fresh clone installs and serves: what `make test` cannot see, since its venv has
# the dev extra, which brings packages the project itself may have forgotten to declare.
#
#   1. a new virtual environment in a temporary directory;
#   2. torch==2.13.0 first and alone (a plain `torch` from the project's requirements could pull a
#      multi-GB CUDA build), then the project WITHOUT extras, built from a copy of the repository's
#      files as a clone would have them (so the wheel, package data included, is what is tested);
#   3. every module of the installed package imported (scripts/import_every_module.py);
#   4. `mmserve serve --port 0` with the repository's config.toml, until GET /health answers 200;
#      then SIGTERM, and the server must exit 0 (drained) within STOP_TIMEOUT_S.
# The server is stopped and the directory removed on every exit: success, failure or Ctrl-C.
#
# Usage: scripts/check-fresh-install.sh   (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
START_TIMEOUT_S=${START_TIMEOUT_S:-180}  # install done: model load and bind, on a busy 2-core machine
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-40}     # above [server] shutdown_grace_s (30 s): an idle server exits at once

started=$SECONDS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mmserve-fresh-install.XXXXXX")
venv=$tmp/venv
log=$tmp/server.log
server_pid=

step() { echo "[fresh-install $((SECONDS - started))s] $*"; }
fail() { echo "check-fresh-install: $*" >&2; exit 1; }

# Stops the server if it runs: SIGTERM, up to STOP_TIMEOUT_S for it to drain, then SIGKILL.
# Sets server_status to its exit status (137 when killed).
stop_server() {
    server_status=
    [ -n "$server_pid" ] || return 0
    kill -TERM "$server_pid" 2>/dev/null || true
    local waited=0
    while kill -0 "$server_pid" 2>/dev/null && [ "$waited" -lt $((STOP_TIMEOUT_S * 10)) ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    if kill -0 "$server_pid" 2>/dev/null; then
        echo "check-fresh-install: the server did not stop within ${STOP_TIMEOUT_S}s of SIGTERM; killing it" >&2
        kill -KILL "$server_pid" 2>/dev/null || true
    fi
    server_status=0
    wait "$server_pid" || server_status=$?
    server_pid=
}

cleanup() {
    local status=$?
    stop_server
    if [ "$status" -ne 0 ] && [ -s "$log" ]; then
        echo "check-fresh-install: the server's last log lines:" >&2
        tail -n 15 "$log" >&2
    fi
    [ "$status" -ne 0 ] || step "passed; removing $tmp"
    rm -rf "$tmp"
    [ "$status" -ne 0 ] || step "done in $((SECONDS - started)) s"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step "copying the repository's files (as a clone has them) to $tmp/src"
mkdir "$tmp/src"
# tracked files plus new ones not ignored, from the working tree; ignored ones (.venv, caches) never
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$tmp/src"

step "creating a virtual environment with $PYTHON"
"$PYTHON" -m venv "$venv"
step "installing torch==2.13.0 (pinned first: the CPU wheel)"
"$venv/bin/pip" install --quiet torch==2.13.0
step "installing the project without extras"
"$venv/bin/pip" install --quiet "$tmp/src"

# from the temporary directory, isolated (-I): the repository's own mmserve/ must not be importable
cd "$tmp"
step "importing every module of the package"
"$venv/bin/python" -I "$repo/scripts/import_every_module.py"
"$venv/bin/python" -I -c 'import mmserve, sys; sys.exit(0 if mmserve.__file__.startswith(sys.prefix) else
    f"mmserve was imported from {mmserve.__file__}, not from the fresh environment {sys.prefix}")'

step "starting mmserve serve --port 0 --config config.toml"
"$venv/bin/mmserve" serve --port 0 --config "$repo/config.toml" 2>"$log" >/dev/null &
server_pid=$!

# The JSON log's http.listening event names the bound URLs; then /health must answer 200.
"$venv/bin/python" -I - "$log" "$server_pid" "$START_TIMEOUT_S" <<'EOF'
import json, os, sys, time, urllib.error, urllib.request

log, pid, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])


def alive() -> bool:
    """Whether the server runs (it is the shell's child, not ours: an exited one may be a zombie)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except ProcessLookupError:
        return False
    except OSError:  # no /proc: kill(0) succeeded
        return True


def listening_url() -> str | None:
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "http.listening":
                return event["urls"][0]
    return None


url = None
while time.monotonic() < deadline:
    if not alive():
        sys.exit("check-fresh-install: the server exited before /health answered 200")
    url = url or listening_url()
    if url:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    print(f"GET {url}/health: 200 {r.read().decode()[:200]}")
                    sys.exit(0)
        except (urllib.error.URLError, OSError):
            pass  # 503 while starting, or not accepting yet
    time.sleep(0.25)
sys.exit(f"check-fresh-install: no 200 from /health within {sys.argv[3]} s "
         f"({'listening on ' + url if url else 'no http.listening event in the log'})")
EOF

step "stopping the server (SIGTERM)"
stop_server
[ "$server_status" = 0 ] || fail "the server exited with status $server_status after SIGTERM (expected 0: drained)"
step "the server stopped (status 0)"
