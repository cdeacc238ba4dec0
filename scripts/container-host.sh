#!/usr/bin/env bash
# Prepares a Docker engine for the container test (tests/container), on a host where no image
# registry is reachable and only the package registries are. Usage:
#
#   scripts/container-host.sh up STATE_DIR     start everything; prints KEY=VALUE lines (below)
#   scripts/container-host.sh down STATE_DIR   stop what `up` started (the images stay cached;
#                                              untagged ones and build cache past 10 GB go)
#
# `up` needs root and Debian's docker.io and debootstrap packages (.ci/run installs them). It
#   - starts dockerd (and its containerd) with its own socket, data and exec roots under
#     STATE_DIR, no bridge and no iptables rules: builds and containers use the host network, so
#     nothing is left on the host's network set-up and a second engine elsewhere is not disturbed;
#   - builds the base image local/python:3.11-bookworm with debootstrap from Debian's packages
#     (bookworm's python3 is 3.11), in place of python:3.11-slim-bookworm from Docker Hub. It
#     uses the host's apt sources (the mirror bookworm comes from, and bookworm's entries copied
#     into the image, so the image build's apt-get sees what the host's sees) and trusts the
#     host's CA bundle, also for pip (/etc/pip.conf);
#   - serves the torch wheel the host's pip configuration finds through a PEP 503 index on
#     127.0.0.1, for the Dockerfile's TORCH_INDEX_URL (so the build needs no torch index of its
#     own);
#   - builds local/spyre-like:latest, a stand-in for a Spyre runtime image: torch already installed
#     (in a venv on PATH, with a marker file in its package folder), only `python3` (no
#     `python`), a user with UID 1000 that exists already, and that user as the default user.
# Everything here adapts the host; the Dockerfile stays the one users build.
#
# Printed by `up`: DOCKER_HOST, DOCKER (the client to use), TORCH_INDEX_URL, BASE_IMAGE,
# SPYRE_LIKE_IMAGE.
set -euo pipefail

command=${1:?usage: $0 up|down STATE_DIR}
state=$(mkdir -p "${2:?usage: $0 up|down STATE_DIR}" && cd "$2" && pwd)
# Debian's client: another docker client may come first in PATH.
docker_cli=/usr/bin/docker
export DOCKER_HOST="unix://$state/docker.sock"
base_image=local/python:3.11-bookworm
spyre_like_image=local/spyre-like:latest
log() { echo "container-host: $*" >&2; }

stop_pid_file() {  # stop the process whose PID the file holds, waiting up to 30 s
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$file"
}

engine_up() {
    if "$docker_cli" version >/dev/null 2>&1; then
        return 0
    fi
    log "starting dockerd (data in $state/data)"
    dockerd --data-root "$state/data" --exec-root "$state/exec" --pidfile "$state/dockerd.pid" \
        -H "$DOCKER_HOST" --bridge=none --iptables=false --ip6tables=false \
        >"$state/dockerd.log" 2>&1 &
    for _ in $(seq 600); do
        "$docker_cli" version >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    log "dockerd did not start; its log:"
    tail -20 "$state/dockerd.log" >&2
    exit 1
}

host_apt() {  # $1: mirror | sources | keyrings, $2: the suite (bookworm)
    # The host's apt sources (sources.list and sources.list.d, one-line and deb822 formats) for
    # the suite and its -updates / -security suites. mirror: the URI the suite itself comes from;
    # sources: those entries as one-line "deb" lines; keyrings: the Signed-By files they name.
    python3 - "$1" "$2" <<'EOF'
import glob
import sys

mode, suite = sys.argv[1], sys.argv[2]
entries = []  # (options, uri, suite, components)
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words, options = words[1:], ""
        if words and words[0].startswith("["):
            end = next(i for i, w in enumerate(words) if w.endswith("]"))
            options, words = " ".join(words[: end + 1])[1:-1], words[end + 1 :]
        if len(words) >= 2:
            entries.append((options, words[0], words[1], " ".join(words[2:])))
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    try:
        stanzas = open(path).read().split("\n\n")
    except OSError:
        continue
    for stanza in stanzas:
        fields, key = {}, None
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line.strip()
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        signed_by = fields.get("signed-by", "")
        options = f"signed-by={signed_by}" if signed_by.startswith("/") else ""
        for uri in fields.get("uris", "").split():
            for name in fields.get("suites", "").split():
                entries.append((options, uri, name, fields.get("components", "")))
ours = [e for e in entries if e[2] == suite or e[2].startswith(suite + "-")]
if not any(e[2] == suite for e in ours):
    sys.exit(f"container-host: the host's apt sources name no mirror for {suite}")
if mode == "mirror":
    print(next(e[1] for e in ours if e[2] == suite))
for options, uri, name, components in ours if mode != "mirror" else []:
    if mode == "sources":
        print(f"deb {'[' + options + '] ' if options else ''}{uri} {name} {components}")
    elif "signed-by=" in options:
        print(options.split("signed-by=", 1)[1].split()[0])
EOF
}

build_base_image() {
    "$docker_cli" image inspect "$base_image" >/dev/null 2>&1 && return 0
    log "building $base_image with debootstrap (a few minutes, once)"
    local rootfs="$state/rootfs"
    rm -rf "$rootfs"
    local mirror sources keyring
    mirror=$(host_apt mirror bookworm)
    sources=$(host_apt sources bookworm)
    debootstrap --variant=minbase \
        --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
        bookworm "$rootfs" "$mirror" >"$state/debootstrap.log" 2>&1
    echo "$sources" >"$rootfs/etc/apt/sources.list"
    for keyring in $(host_apt keyrings bookworm | sort -u); do
        [ -e "$rootfs$keyring" ] || install -D -m 0644 "$keyring" "$rootfs$keyring"
    done
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$rootfs/etc/pip.conf"
    rm -rf "$rootfs/var/lib/apt/lists"/* "$rootfs/var/cache/apt"/*.bin
    tar -C "$rootfs" -c . | "$docker_cli" import --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' - "$base_image" >/dev/null
    rm -rf "$rootfs"
}

index_up() {  # prints the index URL
    local index="$state/index" port
    if [ -f "$state/index.pid" ] && kill -0 "$(cat "$state/index.pid")" 2>/dev/null; then
        cat "$state/index.url"
        return 0
    fi
    mkdir -p "$index/simple/torch" "$index/files"
    if ! ls "$index/files"/torch-2.13.0*.whl >/dev/null 2>&1; then
        log "fetching the host's CPU torch wheel"
        python3 -m pip download --quiet --no-deps --only-binary=:all: torch==2.13.0 \
            -d "$index/files" >&2
    fi
    local wheel
    wheel=$(basename "$(ls "$index/files"/torch-2.13.0*.whl | head -1)")
    printf '<!DOCTYPE html><html><body><a href="/files/%s">%s</a></body></html>\n' \
        "${wheel//+/%2B}" "$wheel" >"$index/simple/torch/index.html"
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m http.server --bind 127.0.0.1 --directory "$index" "$port" \
        >"$state/index.log" 2>&1 &
    echo $! >"$state/index.pid"
    echo "http://127.0.0.1:$port/simple" | tee "$state/index.url"
}

build_spyre_like_image() {  # $1: the torch index URL
    "$docker_cli" image inspect "$spyre_like_image" >/dev/null 2>&1 && return 0
    log "building $spyre_like_image"
    "$docker_cli" build --quiet --network host --build-arg "TORCH_INDEX_URL=$1" \
        -t "$spyre_like_image" - >/dev/null <<EOF
FROM $base_image
ARG TORCH_INDEX_URL
RUN useradd --uid 1000 --create-home senuser \\
    && python3 -m venv /opt/runtime \\
    && /opt/runtime/bin/pip install --quiet --no-deps --index-url "\$TORCH_INDEX_URL" torch==2.13.0 \\
    && /opt/runtime/bin/pip install --quiet torch==2.13.0 \\
    && touch /opt/runtime/lib/python3.11/site-packages/torch/SPYRE_LIKE_BASE \\
    && rm /opt/runtime/bin/python /usr/bin/python
ENV PATH=/opt/runtime/bin:\$PATH
USER senuser
WORKDIR /home/senuser
EOF
}

case $command in
up)
    engine_up
    build_base_image
    index_url=$(index_up)
    build_spyre_like_image "$index_url"
    echo "DOCKER_HOST=$DOCKER_HOST"
    echo "DOCKER=$docker_cli"
    echo "TORCH_INDEX_URL=$index_url"
    echo "BASE_IMAGE=$base_image"
    echo "SPYRE_LIKE_IMAGE=$spyre_like_image"
    ;;
down)
    if "$docker_cli" version >/dev/null 2>&1; then
        containers=$("$docker_cli" ps -aq)
        [ -z "$containers" ] || "$docker_cli" rm -f $containers >/dev/null
        # Bound what runs leave behind: every run's builds add untagged images and build cache
        # (~2 GB per source change; 67 GB after a day of runs filled a disk). The tagged images
        # and the newest 10 GB of cache stay, so the next run still reuses its layers.
        "$docker_cli" image prune -f >/dev/null || log "could not remove untagged images"
        "$docker_cli" builder prune -f --keep-storage 10GB >/dev/null ||
            log "could not prune the build cache"
    fi
    stop_pid_file "$state/index.pid"
    # dockerd stops the containerd it started; make sure of it (by the PID it recorded).
    containerd_pid=$(cat "$state/exec/containerd/containerd.pid" 2>/dev/null || true)
    stop_pid_file "$state/dockerd.pid"
    if [ -n "$containerd_pid" ] && kill -0 "$containerd_pid" 2>/dev/null; then
        kill "$containerd_pid"
    fi
    # dockerd leaves its default network namespace mounted under the exec root.
    if mountpoint -q "$state/exec/netns/default" 2>/dev/null; then
        umount "$state/exec/netns/default"
    fi
    ;;
*)
    echo "usage: $0 up|down STATE_DIR" >&2
    exit 2
    ;;
esac
