#!/usr/bin/env bash
# pg17-root.sh prepares and mounts a Debian trixie root filesystem holding
# PostgreSQL 17, for the test suite's PostgreSQL 17 lane (Debian 12 ships 15
# only). Runs as root.
#
#   scripts/pg17-root.sh prepare       build the root once; reuse it when ready
#   scripts/pg17-root.sh run CMD...    prepare, mount /proc and /dev in it, run
#                                      CMD with OUTBOX_TEST_PG_VERSION=17 and
#                                      OUTBOX_TEST_PG_ROOT set, then unmount
#   scripts/pg17-root.sh umount        unmount what an interrupted run left
#
# OUTBOX_PG17_ROOT chooses the directory (default below). debootstrap's
# default mirror is used: no host name is configured here.
set -euo pipefail

ROOT=${OUTBOX_PG17_ROOT:-/var/cache/outbox-relay/pg17-trixie}
READY="$ROOT/.outbox-relay-ready"
PGBIN=/usr/lib/postgresql/17/bin

die() { echo "pg17-root: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot and mount need it)"

# mounted lists what this process mounted, so that it unmounts only that.
mounted=()

do_mount() { # dir
  local dir=$1
  if ! mountpoint -q "$dir/proc"; then
    mount -t proc proc "$dir/proc"
    mounted+=("$dir/proc")
  fi
  if ! mountpoint -q "$dir/dev"; then
    mount --bind /dev "$dir/dev"
    # A slave mount: nothing mounted below it reaches the host's /dev.
    mount --make-slave "$dir/dev"
    mounted+=("$dir/dev")
  fi
  if ! mountpoint -q "$dir/dev/shm"; then
    # PostgreSQL's dynamic shared memory (posix) lives in /dev/shm.
    mount -t tmpfs -o mode=1777 shm "$dir/dev/shm"
    mounted+=("$dir/dev/shm")
  fi
}

do_umount() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount "${mounted[$i]}" || umount -l "${mounted[$i]}" || true
  done
  mounted=()
}

umount_all() { # dir: every mount below dir, deepest first
  local dir=$1 m
  for m in "$dir/dev/shm" "$dir/dev" "$dir/proc"; do
    if mountpoint -q "$m"; then umount "$m" || umount -l "$m"; fi
  done
}

prepare() {
  if [ -f "$READY" ] && [ -x "$ROOT$PGBIN/postgres" ]; then
    echo "pg17-root: reusing $ROOT ($(cat "$READY"))"
    return
  fi
  local start=$SECONDS tmp="$ROOT.partial"
  if ! command -v debootstrap >/dev/null 2>&1; then
    echo "pg17-root: installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  [ -d "$tmp" ] && { umount_all "$tmp"; rm -rf "$tmp"; }
  mkdir -p "$(dirname "$ROOT")"
  echo "pg17-root: debootstrap --variant=minbase trixie $tmp"
  debootstrap --variant=minbase trixie "$tmp" >"$tmp.log" 2>&1 || { tail -20 "$tmp.log" >&2; die "debootstrap failed (log: $tmp.log)"; }
  # The package must neither start a server nor create a cluster: the test
  # harness runs its own initdb.
  printf '#!/bin/sh\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
  chmod 755 "$tmp/usr/sbin/policy-rc.d"
  mkdir -p "$tmp/etc/postgresql-common"
  echo "create_main_cluster = false" >"$tmp/etc/postgresql-common/createcluster.conf"
  trap do_umount EXIT
  do_mount "$tmp"
  echo "pg17-root: apt-get install postgresql-17 in the root"
  chroot "$tmp" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql-17' >>"$tmp.log" 2>&1 \
    || { tail -20 "$tmp.log" >&2; die "apt-get install postgresql-17 failed (log: $tmp.log)"; }
  do_umount
  trap - EXIT
  local version
  version=$(chroot "$tmp" "$PGBIN/postgres" --version)
  [ -d "$ROOT" ] && { umount_all "$ROOT"; rm -rf "$ROOT"; }
  mv "$tmp" "$ROOT"
  rm -f "$tmp.log"
  echo "$version" >"$READY"
  echo "pg17-root: prepared $ROOT with $version in $((SECONDS - start)) s"
}

case "${1:-}" in
prepare)
  prepare
  ;;
run)
  shift
  [ $# -gt 0 ] || die "usage: $0 run CMD..."
  prepare
  trap do_umount EXIT
  do_mount "$ROOT"
  set +e
  OUTBOX_TEST_PG_VERSION=17 OUTBOX_TEST_PG_ROOT="$ROOT" "$@"
  rc=$?
  set -e
  exit $rc
  ;;
umount)
  umount_all "$ROOT"
  ;;
*)
  die "usage: $0 prepare | run CMD... | umount"
  ;;
esac
