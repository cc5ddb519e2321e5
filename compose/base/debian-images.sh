#!/usr/bin/env bash
# Makes what Docker Hub would give, where it cannot be reached: a Debian bookworm base
# with Python 3.11 (for python:3.11-slim-bookworm), the same with a C compiler (for
# python:3.11-bookworm, the build stage) and Prometheus from Debian's package (for
# prom/prometheus). The base comes from debootstrap and the machine's configured Debian
# mirror (or $DEBIAN_MIRROR), imported with `docker import`; the other two are built on
# it. Run as root (debootstrap), from anywhere:
#   compose/base/debian-images.sh            # radixserve-base:bookworm{,-build},
#                                            # radixserve-prometheus:debian
# Images that exist already are kept (FORCE=1 remakes them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
suite=bookworm
base=radixserve-base:$suite

mirror() {  # the first Debian archive URI in the apt sources, else deb.debian.org
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    local uri
    uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '/^URIs:/ {print $2}' | grep -v -- '-security' | head -n1 || true)
    if [ -z "$uri" ]; then
        uri=$(awk '$1 == "deb" && $0 !~ /security/ {print $2; exit}' \
            /etc/apt/sources.list 2>/dev/null || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

have() { [ -z "${FORCE:-}" ] && docker image inspect "$1" >/dev/null 2>&1; }

if have "$base"; then
    echo "$base: present"
else
    command -v debootstrap >/dev/null || { echo "debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    url=$(mirror)
    echo "$base: debootstrap $suite from $url"
    start=$SECONDS
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$suite" "$root" "$url" >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
    echo "$base: made in $((SECONDS - start)) s"
fi

build() {  # tag, dockerfile
    if have "$1"; then echo "$1: present"; return; fi
    start=$SECONDS
    docker build --quiet --network host --build-arg "BASE_IMAGE=$base" -t "$1" \
        -f "$2" "$(dirname "$2")" >/dev/null
    echo "$1: built in $((SECONDS - start)) s"
}
build "$base-build" "$here/Dockerfile.build"
build radixserve-prometheus:debian "$here/../prometheus/Dockerfile"
