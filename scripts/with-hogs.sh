#!/usr/bin/env bash
# with-hogs.sh N command...: runs command with N CPU-bound busy loops beside
# it, so that tests whose guarantees must not rest on timing (the consumer
# group's order, internal/grouptest) run on a loaded machine, as production
# ones are. Each loop is bounded by its own timeout and killed by its pid
# when the command ends; the command's exit status is returned.
set -u
n=${1:?usage: with-hogs.sh N command...}
shift
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; }
trap cleanup EXIT
for _ in $(seq "$n"); do
  timeout 1800 sh -c 'while :; do :; done' &
  pids+=($!)
done
echo "with-hogs: $n CPU hogs beside: $*"
"$@"
