# shellcheck shell=bash
# Sourced by scripts that need system programs (a Redis/Valkey server, headless Chromium):
# `ensure_debian_packages PROGRAM:PACKAGE...` installs, with apt-get, the Debian package of
# each program that is not on PATH. It runs `apt-get update` once per call that installs
# anything, says what it installs, and returns non-zero when an install fails, so a caller
# can report the gate that needs the program instead of failing quietly.
#
#   ensure_debian_packages redis-server:redis-server chromium:chromium

ensure_debian_packages() {
    local missing=() pair program package
    for pair in "$@"; do
        program="${pair%%:*}"
        package="${pair#*:}"
        command -v "$program" >/dev/null 2>&1 || missing+=("$package")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "cannot install ${missing[*]}: apt-get is not available" >&2
        return 1
    fi
    local sudo=()
    [[ $(id -u) -ne 0 ]] && sudo=(sudo)
    echo "==> installing Debian packages: ${missing[*]} (apt-get; about a minute)"
    "${sudo[@]}" apt-get update -qq >/dev/null &&
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
}
