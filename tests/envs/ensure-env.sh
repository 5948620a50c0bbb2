#!/usr/bin/env bash
# Creates or reuses the heavy test environment and prints its python on the last line.
#
# Why: the tests that run against the real sglang wheel need torch, triton and a few
# dozen of sglang's dependencies (~2 GB).  Installing them per run or into the clone
# would cost minutes and disk on every checkout, so the virtualenv lives outside the
# repo, keyed by what is in it, and every later call is a few stat()s.
#
#   key  = py<X.Y>-sglang<V>-torch<V>-<flavour>-<sha256 of the selected pins>
#          (py<X.Y>-<flavour>-<sha256> for a flavour without sglang: core)
#   root = $HICACHE_EXISTENCE_ENV_ROOT (default ~/.cache/hicache-existence/envs)
#
# The env holds: the pins of tests/envs/sglang-requirements.txt (the flavour's
# sections, a later section's pin replacing an earlier one of the same package;
# "full" and "seed" also take "server", what a real sglang server process needs),
# installed with --no-deps so nothing else sneaks in; this repo installed editable
# with its extras (reinstalled only when pyproject.toml, the repo path or the
# extras change: CI clones into a new folder each time).
#
# The pins are installed by uv when it can be had, else by pip (one log line says
# which).  Why: a cold machine builds three ~6.6 GB envs side by side (py3.11 full,
# py3.12 full, py3.11 seed); pip downloads and unpacks every wheel once per env, while
# uv unpacks each wheel once into its cache (<root>/.uv-cache, on the envs' filesystem)
# and hardlinks it into every env that takes it: torch cp311 and every py3-none wheel
# (the nvidia-* libraries, ~3 GB) are written once.  uv (pinned, UV_PIN) is installed by
# pip into a cached tools venv, <root>/tools-<sha256 of the pin>; without a network it
# cannot be, and pip builds the env as before.  uv is given pip's own effective
# sources (index, extra indexes, find-links, constraint files, CA bundle, read from the
# new venv's pip) with pip's "best version across all indexes" strategy, so a pin
# resolves to the same file either way.  The venv is still made by `python -m venv`
# (pip inside: tests and the editable install below use it).  uv compiles every module
# to .pyc as pip does (--compile-bytecode): with PYTHONDONTWRITEBYTECODE=1 (set on our
# machines) nothing is ever cached later, and every test process would compile sglang
# and torch from source (the launcher test's 420 s bound expired that way).
# The hardlinks are safe because nothing writes an installed file in place (pip and
# Python replace files, they do not rewrite them); `rm -rf <root>/.uv-cache` is safe
# whenever no build runs (the envs keep their links) and frees what no env uses.
#
# Environment:
#   HICACHE_EXISTENCE_ENV_FLAVOR   which sections of sglang-requirements.txt:
#                                  light (default: common + light; CPU torch 2.13;
#                                  storage_existence_cache, hicache_storage, plugins,
#                                  hook_registry import),
#                                  full (common + full: CUDA torch 2.14.1 + torchvision,
#                                  ~6 GB; also unified_radix_cache and managers.scheduler),
#                                  seed (common + full + seed: the same with sglang 0.5.21,
#                                  the seed's flat API generation), or
#                                  core (no section: no sglang, no torch; only this repo's
#                                  extras, resolved by pip: the per-Python matrix envs)
#   HICACHE_EXISTENCE_ENV_EXTRAS   extras of this repo to install (default: test,dev)
#   HICACHE_EXISTENCE_PYTHON       base interpreter (default: python3.11, else python3);
#                                  envs are keyed by its X.Y, one per Python and flavour
#   HICACHE_EXISTENCE_ENV_INSTALLER   auto (default: uv, pip when uv cannot be had), uv
#                                  (fail without it) or pip: what installs the pins (the
#                                  env's contents are the same; not part of the key)
#   HICACHE_EXISTENCE_ENV_REBUILD=1   discard the env of this key and build it again
#   HICACHE_EXISTENCE_ENV_KEEP_OLD=1  keep envs of the same Python and flavour with
#                                     other keys (default: removed after a successful build)
#
# Concurrency: a flock per key (<root>/.lock-<key>) serialises the builds of one env,
# so envs of different keys build side by side (run-all.sh builds them all at once);
# one flock on <root>/.lock serialises the editable installs of this repo (they build
# its C extensions into the one work tree).  The env is built in <root>/.tmp-<key>-*
# and renamed into place, so a reader never sees half an env.
# Quiet on the warm path; progress of a build goes to stderr, pip's output to a log.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
REQS="$HERE/sglang-requirements.txt"
FLAVOR="${HICACHE_EXISTENCE_ENV_FLAVOR:-light}"
EXTRAS="${HICACHE_EXISTENCE_ENV_EXTRAS:-test,dev}"
ROOT="${HICACHE_EXISTENCE_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/hicache-existence/envs}"
# Bump when the way an env is built changes (not its contents: those are hashed).
# 2: the pins installed by uv (pip without it).
LAYOUT=2
UV_PIN="uv==0.13.9"
INSTALLER="${HICACHE_EXISTENCE_ENV_INSTALLER:-auto}"

log() { printf '[ensure-env] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

COMMON_MODULES="sglang.srt.mem_cache.buffer_mode.storage_existence_cache
  sglang.srt.mem_cache.hicache_storage sglang.srt.plugins sglang.srt.plugins.hook_registry
  sglang.srt.mem_cache.storage.backend_factory"
FULL_MODULES="$COMMON_MODULES sglang.srt.mem_cache.unified_radix_cache sglang.srt.managers.scheduler
  sglang.srt.entrypoints.http_server"
case "$FLAVOR" in
  light) SECTIONS="common light" MODULES="$COMMON_MODULES" ;;
  full) SECTIONS="common full server" MODULES="$FULL_MODULES" ;;
  seed) SECTIONS="common full server seed" MODULES="$FULL_MODULES" ;;
  core) SECTIONS="" MODULES="" ;;
  *) die "HICACHE_EXISTENCE_ENV_FLAVOR must be light, full, seed or core, not '$FLAVOR'" ;;
esac
case "$INSTALLER" in
  auto | uv | pip) ;;
  *) die "HICACHE_EXISTENCE_ENV_INSTALLER must be auto, uv or pip, not '$INSTALLER'" ;;
esac
[ -f "$REQS" ] || die "missing $REQS"

# --- the base interpreter -------------------------------------------------------------
PYBIN="${HICACHE_EXISTENCE_PYTHON:-}"
if [ -z "$PYBIN" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PYBIN=python3.11; else PYBIN=python3; fi
fi
command -v "$PYBIN" >/dev/null 2>&1 || die "no interpreter '$PYBIN'"

# --- the key --------------------------------------------------------------------------
# The pins of the flavour's sections, comments and blanks stripped; a section's pin
# replaces an earlier one of the same package in place (seed's sglang==0.5.21 replaces
# common's 0.5.23).  With one pin per package, the output is the file's order.
PINS="$(awk -v want=" $SECTIONS " '
  /^#@ / { sec = $2; next }
  index(want, " " sec " ") {
    sub(/#.*/, ""); gsub(/[ \t]+/, ""); if (!length) next
    name = tolower($0); sub(/[=<>!~;\[].*/, "", name); gsub(/_/, "-", name)
    if (name in at) line[at[name]] = $0; else { at[name] = ++n; line[n] = $0 }
  }
  END { for (i = 1; i <= n; i++) print line[i] }
' "$REQS")"
pin_of() { printf '%s\n' "$PINS" | sed -n "s/^$1==//p" | head -n 1; }
SGLANG_V="$(pin_of sglang)"
TORCH_V="$(pin_of torch)"
if [ "$FLAVOR" != core ]; then
  [ -n "$SGLANG_V" ] && [ -n "$TORCH_V" ] || die "$REQS pins no sglang or no torch for '$FLAVOR'"
fi

# The interpreter version is read from the env itself on the warm path (no extra
# process): a python3.X base gives py3.X, anything else says what it is.
case "$PYBIN" in
  python3.1[0-9] | */python3.1[0-9]) PYVER="${PYBIN##*python}" ;;
  *) PYVER="$("$PYBIN" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ;;
esac
HASH="$(printf 'layout=%s\n%s\n' "$LAYOUT" "$PINS" | sha256sum | cut -c1-10)"
if [ "$FLAVOR" = core ]; then
  KEY="py${PYVER}-${FLAVOR}-${HASH}"
else
  KEY="py${PYVER}-sglang${SGLANG_V}-torch${TORCH_V/+/-}-${FLAVOR}-${HASH}"
fi
ENV="$ROOT/$KEY"
PY="$ENV/bin/python"

# What the editable install was made from; a change means `pip install -e` again.
# The compiled index is built by that install, so its sources count too.
if [ -f "$REPO/pyproject.toml" ]; then
  REPO_STAMP="$(cat "$REPO/pyproject.toml" "$REPO"/setup.py $(find "$REPO/hicache_existence" -name '*.[ch]' | sort) 2>/dev/null \
    | sha256sum | cut -c1-64) $REPO [$EXTRAS]"
else
  REPO_STAMP="no-pyproject $REPO"
fi

# The editable install builds the C extensions into the work tree, so a fresh
# clone at a path used before (same stamp) has none of them: check for them too,
# for this env's Python (each Python of the matrix builds its own next to the others).
built_in_place() {
  local c
  for c in $(find "$REPO/hicache_existence" -name '*.c'); do
    [ -e "$c" ] || continue
    compgen -G "${c%.c}.cpython-${PYVER//./}-*.so" >/dev/null || return 1
  done
}

ready() {
  [ -f "$ENV/.hicache-env-complete" ] && [ -x "$PY" ] \
    && [ "$(cat "$ENV/.hicache-env-repo" 2>/dev/null)" = "$REPO_STAMP" ] \
    && built_in_place
}

# --- warm path: no lock, no process beyond the stamp read ----------------------------
if [ "${HICACHE_EXISTENCE_ENV_REBUILD:-0}" != 1 ] && ready; then
  echo "$PY"
  exit 0
fi

# --- slow path, serialised per key ------------------------------------------------------
mkdir -p "$ROOT"
exec 9>"$ROOT/.lock-$KEY"
if ! flock -n 9; then
  log "another ensure-env.sh is building $KEY; waiting"
  flock 9
fi

if [ "${HICACHE_EXISTENCE_ENV_REBUILD:-0}" = 1 ] && [ -d "$ENV" ]; then
  log "HICACHE_EXISTENCE_ENV_REBUILD=1: removing $ENV"
  rm -rf -- "$ENV"
fi
# A directory without the completion marker was not made by a finished build.
if [ -d "$ENV" ] && [ ! -f "$ENV/.hicache-env-complete" ]; then
  log "removing incomplete $ENV"
  rm -rf -- "$ENV"
fi

TMP=""
cleanup() { if [ -n "$TMP" ]; then rm -rf -- "$TMP"; fi; }
trap cleanup EXIT

# pip's own chatter goes to a log; shown only when a step fails.
run_logged() {
  local logfile="$1"
  shift
  if ! "$@" >>"$logfile" 2>&1; then
    log "failed: $*"
    tail -n 40 "$logfile" >&2
    exit 1
  fi
}

# uv, from a cached tools venv next to the envs (made by pip, once per pin, under a
# lock: the envs built side by side wait for the first); nothing when it cannot be
# had (no network): the caller falls back to pip.
uv_binary() { # base-python build-log -> prints the path of uv, or nothing
  local tools="$ROOT/tools-$(printf '%s' "$UV_PIN" | sha256sum | cut -c1-10)"
  if [ ! -f "$tools/.hicache-env-complete" ]; then
    (
      exec 7>"$ROOT/.lock-$(basename "$tools")"
      flock 7
      [ ! -f "$tools/.hicache-env-complete" ] || exit 0
      rm -rf -- "$tools"
      if "$1" -m venv "$tools" >>"$2" 2>&1 \
        && "$tools/bin/python" -m pip install --disable-pip-version-check --no-input -q \
          "$UV_PIN" >>"$2" 2>&1 && "$tools/bin/uv" --version >>"$2" 2>&1; then
        touch "$tools/.hicache-env-complete"
      else
        log "could not install $UV_PIN into $tools (see $2)"
        rm -rf -- "$tools"
      fi
    )
  fi
  if [ -f "$tools/.hicache-env-complete" ]; then echo "$tools/bin/uv"; fi
}

# pip's effective sources for uv, read from pip itself (its config files and PIP_*
# variables: here find-links=/opt/wheels, two file:// extra indexes and a constraint
# file), so that the pins resolve to the same files: "VAR=value" lines for uv's
# environment (the CA bundle, the timeout), a "--" line, then uv's flags one a line.
# Fails on a setting with no counterpart given here (proxy, trusted hosts,
# --only-binary/--no-binary, --pre, ...): pip builds the env then.
pip_sources() { # venv-python
  "$1" - <<'PY'
import sys
from pip._internal.commands import create_command

o = create_command("install").parse_args([])[0]
unsupported = [
    name
    for name, value in (
        ("proxy", o.proxy),
        ("trusted-host", o.trusted_hosts),
        ("only-binary/no-binary", o.format_control.only_binary | o.format_control.no_binary),
        ("pre", o.pre),
        ("prefer-binary", o.prefer_binary),
        ("client-cert", o.client_cert),
    )
    if value
]
if unsupported:
    sys.exit("pip is configured with " + ", ".join(unsupported) + ": not passed on to uv")
lines = ["UV_HTTP_TIMEOUT=%d" % int(o.timeout)]
if o.cert:
    lines.append("SSL_CERT_FILE=" + o.cert)
lines.append("--")
if o.no_index:
    lines.append("--no-index")
else:
    lines += ["--index-url", o.index_url]
    for url in o.extra_index_urls:
        lines += ["--extra-index-url", url]
for link in o.find_links:
    lines += ["--find-links", link]
for path in o.constraints:
    lines += ["--constraint", path]
print("\n".join(lines))
PY
}

if [ ! -d "$ENV" ]; then
  START=$(date +%s)
  # We hold this key's lock: any .tmp-<key>-* left here is a dead build's.
  rm -rf -- "$ROOT"/.tmp-"$KEY"-*
  TMP="$ROOT/.tmp-$KEY-$$"
  BLOG="$TMP/.hicache-env-build.log"
  log "building $KEY (flavour $FLAVOR) in $ROOT"
  BASE="$("$PYBIN" -c 'import sys; print(sys.executable)')"
  "$BASE" -m venv --prompt "$KEY" "$TMP"
  printf '%s\n' "$PINS" >"$TMP/.hicache-env-pins"
  if [ -n "$PINS" ]; then
    npins="$(printf '%s\n' "$PINS" | wc -l)"
    UV=""
    if [ "$INSTALLER" != pip ]; then
      UV="$(uv_binary "$BASE" "$BLOG")"
      if [ -n "$UV" ] && ! pip_sources "$TMP/bin/python" >"$TMP/.hicache-env-uv" 2>>"$BLOG"; then
        log "pip's configuration cannot be passed on to uv: $(tail -n 1 "$BLOG")"
        UV=""
      fi
      [ -n "$UV" ] || [ "$INSTALLER" != uv ] || die "HICACHE_EXISTENCE_ENV_INSTALLER=uv: no uv ($UV_PIN)"
    fi
    if [ -n "$UV" ]; then
      mapfile -t uv_args <"$TMP/.hicache-env-uv"
      log "installing $npins pinned packages (--no-deps) with $("$UV" --version) (cache $ROOT/.uv-cache)"
      # uv_args: VAR=value..., "--", flags...; env(1) takes the first part.
      for ((i = 0; i < ${#uv_args[@]}; i++)); do [ "${uv_args[i]}" != -- ] || break; done
      run_logged "$BLOG" env "${uv_args[@]:0:i}" "$UV" pip install --no-config \
        --python "$TMP/bin/python" --cache-dir "$ROOT/.uv-cache" --index-strategy unsafe-best-match \
        "${uv_args[@]:i+1}" --compile-bytecode --no-deps -r "$TMP/.hicache-env-pins"
    else
      log "installing $npins pinned packages (--no-deps) with pip$([ "$INSTALLER" = pip ] || echo ' (no uv)')"
      run_logged "$BLOG" "$TMP/bin/python" -m pip install --disable-pip-version-check \
        --no-input --no-deps -r "$TMP/.hicache-env-pins"
    fi
  fi
  # venv and pip write the build path into bin/ (activate scripts, shebangs); point
  # them at the final path before the rename.
  grep -rlIF -- "$TMP" "$TMP/bin" | while IFS= read -r f; do
    sed -i "s#$TMP#$ENV#g" "$f"
  done || true
  log "pins installed in $(( $(date +%s) - START ))s"
  T_IMPORTS=$(date +%s)
  [ -z "$MODULES" ] || log "checking imports"
  # shellcheck disable=SC2086
  run_logged "$BLOG" "$TMP/bin/python" -c '
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    print("import ok:", name)
' $MODULES
  printf '%s\n' "$FLAVOR" >"$TMP/.hicache-env-flavor"
  touch "$TMP/.hicache-env-complete"
  mv -T -- "$TMP" "$ENV"
  TMP=""
  log "built $ENV in $(( $(date +%s) - START ))s (imports $(( $(date +%s) - T_IMPORTS ))s; $(du -sh "$ENV" | cut -f1))"

  if [ "${HICACHE_EXISTENCE_ENV_KEEP_OLD:-0}" != 1 ]; then
    # Only this Python's: the matrix keeps one env per Python and flavour.
    for old in "$ROOT/py${PYVER}-"*; do
      [ -d "$old" ] && [ "$old" != "$ENV" ] || continue
      if [ "$(cat "$old/.hicache-env-flavor" 2>/dev/null)" = "$FLAVOR" ]; then
        log "removing superseded $(basename "$old")"
        rm -rf -- "$old"
      fi
    done
  fi
fi

if [ "$(cat "$ENV/.hicache-env-repo" 2>/dev/null)" != "$REPO_STAMP" ] || ! built_in_place; then
  # The repo's editable installs take turns: each builds the C extensions in place.
  exec 8>"$ROOT/.lock"
  if ! flock -n 8; then
    log "another ensure-env.sh is installing a repo; waiting"
    flock 8
  fi
  if [ -f "$REPO/pyproject.toml" ]; then
    log "installing $REPO[$EXTRAS] (editable)"
    # The pins constrain whatever the extras pull in, so a test dependency cannot
    # silently move a package the sglang imports were checked with.
    T_REPO=$(date +%s)
    run_logged "$ENV/.hicache-env-build.log" "$PY" -m pip install --disable-pip-version-check \
      --no-input -e "$REPO[$EXTRAS]" -c "$ENV/.hicache-env-pins"
    log "installed $REPO[$EXTRAS] in $(( $(date +%s) - T_REPO ))s"
  else
    log "no $REPO/pyproject.toml yet: skipping the editable install"
  fi
  printf '%s\n' "$REPO_STAMP" >"$ENV/.hicache-env-repo.tmp"
  mv -f -- "$ENV/.hicache-env-repo.tmp" "$ENV/.hicache-env-repo"
fi

echo "$PY"
