#!/usr/bin/env bash
# Device check: the cuda tests and bench_ready --device cuda, on a bare device machine (python3 with
# torch, no internet). Run from the repo root, with .whl/ (built by benchmarks/device/pack.sh) carried:
#   bash benchmarks/device/gpu_check.sh STAGE...
#     STAGE: setup | tests | bench:SCALE[,SCALE] | bench1:SCALE (last; uses what time is left)
# Reads .whl/site312.tar.xz and .whl/pg15.tar.xz (relative to the repo root). See benchmarks/device/README.md.
# Env: OUT (results folder), BUDGET (seconds this whole command may take), DEV (cuda | cpu),
#      PY (interpreter), SITE (folder of carried packages; extracted from .whl/site312.tar.xz if absent),
#      PGPORT (our Postgres, started as nobody from .whl/pg15.tar.xz).
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-560}
DEV=${DEV:-cuda}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site312}
PGPORT=${PGPORT:-5432}
PGROOT=${PGROOT:-/tmp/pgroot}
PGDATA=${PGDATA:-/tmp/pgdata}
MARK=${MARK:-/tmp/gpu_setup_done}
HERE=$(pwd)
T0=$(date +%s)
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
el() { echo "=== [t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

export PYTHONPATH="$SITE"
export MFSREG_TEST_PG="postgresql://postgres@127.0.0.1:$PGPORT/postgres"
export MFSREG_BENCH_PG="$MFSREG_TEST_PG"

untar() {  # $1 archive (.tar.xz), $2 folder; Python's tarfile where there is no xz
  mkdir -p "$2"
  if command -v xz >/dev/null; then tar -xJf "$1" -C "$2"
  else "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='fully_trusted')" "$1" "$2"; fi
}

aspg() {  # run a Postgres program as nobody (Postgres refuses root), with its carried libraries
  (cd /tmp && "$PY" -c 'import os, sys
os.environ["LD_LIBRARY_PATH"] = sys.argv[1]
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.execv(sys.argv[2], sys.argv[2:])' "$PGROOT/pglibs" "$PGROOT/usr/lib/postgresql/15/bin/$1" "${@:2}")
}

pg_up() {
  if [ ! -d "$PGROOT/usr" ]; then
    untar "$HERE/.whl/pg15.tar.xz" "$PGROOT" || return 1
  fi
  if [ ! -e /usr/share/zoneinfo/UTC ]; then
    echo "no /usr/share/zoneinfo/UTC: adding the carried one"
    mkdir -p /usr/share/zoneinfo/Etc && cp -n "$PGROOT/zoneinfo/UTC" /usr/share/zoneinfo/ && cp -n "$PGROOT/zoneinfo/Etc/UTC" /usr/share/zoneinfo/Etc/
  fi
  export TZ=UTC
  if [ ! -f "$PGDATA/PG_VERSION" ]; then
    rm -rf "$PGDATA"
    aspg initdb -D "$PGDATA" -U postgres --auth=trust --encoding=UTF8 --locale=C --no-sync >/dev/null || return 1
  fi
  if ! aspg pg_ctl -D "$PGDATA" status >/dev/null 2>&1; then
    aspg pg_ctl -D "$PGDATA" -l "$PGDATA/server.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $PGPORT -k /tmp" start || { tail -20 "$PGDATA/server.log"; return 1; }
  fi
  "$PY" -c "import psycopg; c = psycopg.connect('$MFSREG_TEST_PG'); print('postgres:', c.execute('select version()').fetchone()[0][:40]); c.close()"
}

stage_setup() {
  el "setup: machine"
  nvidia-smi -L 2>&1 || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], sys.executable); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  echo "cpus $(nproc); $(free -g | awk '/Mem:/{print "mem GB " $2}'); gcc: $(gcc --version 2>/dev/null | head -1 || echo none)"
  df -h "$HERE" /tmp | tail -n +1
  if [ -f "$MARK" ]; then el "setup: already done on this machine"; [ -f "$MARK.py" ] && PY=$(cat "$MARK.py"); pg_up; return; fi
  el "setup: packages"
  if [ ! -d "$SITE" ]; then untar .whl/site312.tar.xz "$(dirname "$SITE")" || return 1; fi
  "$PY" -c "import sqlalchemy, alembic, fastapi, starlette, uvicorn, pydantic, moto, flask, psycopg, boto3, zstandard, pyfastcdc, swagger_ui_bundle
from moto.server import ThreadedMotoServer
import typer, rich, httpx, xxhash, safetensors, prometheus_client, pytest, xdist, pytest_timeout, hypothesis
print('imports ok; typer', typer.__version__, 'typing_extensions from', __import__('typing_extensions').__file__)" || return 1
  el "setup: mfsreg (editable, C modules built here)"
  local sp; sp=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if [ -n "${FORCE_VENV:-}" ] || [ ! -w "$sp" ] || [ ! -w "$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")" ]; then
    echo "$sp not writable: a venv in /tmp/venv that sees it"
    "$PY" -m venv --without-pip /tmp/venv || return 1
    "/tmp/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" | xargs -I{} sh -c "echo '$sp' > {}/zz_base.pth"
    "$PY" -m pip --python /tmp/venv/bin/python install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | grep -v "root user\|^$" | tail -20
    PY=/tmp/venv/bin/python; echo "$PY" > "$MARK.py"
  else
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | grep -v "root user\|^$" | tail -20
  fi
  "$PY" -c "import mfsreg.registry.format._grouping, mfsreg.registry.format._busguard, mfsreg.registry.client._mapfiles; print('C modules ok')" || echo "C MODULES MISSING (optional: numpy / ctypes fallbacks run)"
  MF=$("$PY" -c "import sys, pathlib; print(pathlib.Path(sys.executable).with_name('mfsreg'))")
  [ -x "$MF" ] || { echo "no console script at $MF"; return 1; }
  "$MF" --version 2>&1 | head -2
  el "setup: postgres"
  pg_up || return 1
  touch "$MARK"
  el "setup: done"
}

stage_tests() {
  el "tests: -m cuda"
  timeout 240 "$PY" -m pytest -q -rA -p no:cacheprovider -m cuda tests/ --ignore=tests/test_fuzz_api.py --continue-on-collection-errors --junitxml="$OUT/cuda_tests.xml" 2>&1 | tail -40
  el "tests: GPU-adjacent (-k resident or load_tensors or gpu or cuda)"
  timeout 240 "$PY" -m pytest -q -x -rfEs -p no:cacheprovider tests/test_node.py -k "resident or load_tensors or gpu or cuda" \
    --junitxml="$OUT/node_tests.xml" 2>&1 | tail -30
}

stage_bench() {  # $1: scales; $2: seconds it may take
  local name="ready-${DEV}-s${1//[.,]/_}.json"
  el "bench_ready --device $DEV --scales $1 --runs 3 (limit $2 s) -> $name"
  timeout --signal=INT --kill-after=10 "$2" "$PY" -m benchmarks.bench_ready --device "$DEV" --scales "$1" --runs 3 --out "$name"
  echo "bench exit: $?"
  [ -f "benchmarks/results/$name" ] && cp "benchmarks/results/$name" "$OUT/"
}

rc=0
for st in "$@"; do
  case $st in
    setup) stage_setup || { el "SETUP FAILED"; rc=1; break; } ;;
    tests) stage_tests ;;
    bench:*) stage_bench "${st#bench:}" "$(( $(left) < 240 ? $(left) : 240 ))" ;;
    bench1:*) l=$(( $(left) - 15 )); if [ "$l" -gt 60 ]; then stage_bench "${st#bench1:}" "$l"; else el "no time left for ${st}"; fi ;;
    *) echo "unknown stage $st"; rc=2 ;;
  esac
done
el "end (rc $rc)"
[ -f "$PGDATA/server.log" ] && tail -5 "$PGDATA/server.log" > "$OUT/pg_tail.log"
exit $rc
