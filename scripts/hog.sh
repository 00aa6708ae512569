#!/usr/bin/env bash
# Runs a command on a busy machine: two CPU busy loops (one per core of this
# 2-core kind) and a disk writer (64 MiB written and fsynced over and over),
# started first and stopped when the command ends (also on Ctrl-C). The
# command's exit code is this script's. What it is for: a test that passes on
# a quiet machine and fails here depends on timing (docs/development.md,
# "The hog check").
#
#   scripts/hog.sh bash .ci/run               # the whole CI run, busy
#   scripts/hog.sh .venv/bin/python -m pytest tests/test_checkpoint_changed.py
#
# HOG_LOOPS (default 2) and HOG_WRITE_MB (default 64; 0: no writer) change it.
set -uo pipefail
if [ $# -eq 0 ]; then
    echo "usage: scripts/hog.sh COMMAND [ARG...]" >&2
    exit 2
fi
loops=${HOG_LOOPS:-2}
write_mb=${HOG_WRITE_MB:-64}
dir=$(mktemp -d "${TMPDIR:-/tmp}/wc-hog.XXXXXX") || { echo "hog: cannot make a temporary folder" >&2; exit 2; }
pids=()
cmd=
stop() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    wait "${pids[@]}" 2>/dev/null
    rm -rf "$dir"
}
# A signal to this script is passed on to the command, which is waited for
# (bash runs a trap only once a foreground command ends: the command runs in
# the background so that a signal ends the run at once).
on_signal() {
    [ -n "$cmd" ] && kill "-$1" -- "-$cmd" 2>/dev/null  # its whole process group: make, pytest, servers
    [ -n "$cmd" ] && wait "$cmd" 2>/dev/null
    exit "$2"
}
trap stop EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
trap 'on_signal HUP 129' HUP
for _ in $(seq "$loops"); do
    ( exec 0</dev/null; while :; do :; done ) &
    pids+=($!)
done
if [ "$write_mb" -gt 0 ]; then
    # The writer's dd is killed with it (a TERM to the subshell alone would leave it writing).
    ( exec 0</dev/null; trap 'kill "$dd" 2>/dev/null; exit 0' TERM
      while :; do dd if=/dev/zero of="$dir/hog.bin" bs=1M count="$write_mb" conv=fsync status=none & dd=$!; wait "$dd"; done ) &
    pids+=($!)
fi
echo "hog: $loops busy loop(s) and a ${write_mb} MiB disk writer running (pids ${pids[*]}) while: $*" >&2
started=$(date +%s)
set -m  # the command in a process group of its own, which a signal reaches whole
"$@" &
cmd=$!
set +m
wait "$cmd"
rc=$?
cmd=
echo "hog: '$*' exited $rc after $(( $(date +%s) - started )) s under load" >&2
exit $rc
