#!/usr/bin/env bash
# Builds the device kit's two archives from scratch, on this (x86-64 Debian) machine:
#   $OUTDIR/site312.tar.xz  cp312 packages the device's python3.12 + torch image lacks, installed into
#                           one folder, site312/ (botocore's service data pruned to s3 + sts)
#   $OUTDIR/pg15.tar.xz     this machine's Postgres 15 (initdb, pg_ctl, postgres, pg_isready, its lib/
#                           and share/) with the shared libraries ldd lists beyond glibc, and zoneinfo UTC
# benchmarks/device/gpu_check.sh reads them from .whl/ on the device (run with carry [".whl"]).
# Run from anywhere in the repo:   bash benchmarks/device/pack.sh
# Env: OUTDIR (default .whl, in the repo root), WORK (scratch, default /tmp/mfsreg-kit),
#      PYVER (3.12; 3.11 builds site311.tar.xz for a local dry run), PARTS ("site pg"),
#      HOSTPY (python with pip, default python3), OFFLINE=1 (reuse $WORK/wheels-cpNNN, no download).
set -euo pipefail

# The packages, pinned in this one place (the versions packed for the first device kit).
PINS=(
  alembic==1.20.1 annotated_types==0.8.0 blinker==1.9.0 boto3==1.44.8 botocore==1.44.8
  cffi==2.1.1 cryptography==50.0.2 fastapi==0.165.0 flask==3.1.3 flask_cors==6.0.5
  itsdangerous==2.2.0 jmespath==1.1.0 mako==1.4.3 moto==5.2.5 opentelemetry_api==1.45.2
  psycopg==3.3.9 psycopg_binary==3.3.9 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5
  pyfastcdc==0.3.1 responses==0.26.3 s3transfer==0.19.3 setuptools==84.2.1 sqlalchemy==2.1.9
  starlette==1.10.0 swagger_ui_bundle==1.1.0 typing_extensions==4.16.0 typing_inspection==0.4.5
  uvicorn==0.55.0 xmltodict==1.0.4 zstandard==0.25.0
)
BOTOCORE_KEEP=(s3 sts)                       # botocore/data/<service> folders kept
PRUNE=('zstandard/_cffi.*.so')               # unused: zstandard loads its C backend (backend_c)
PG_BINS=(initdb pg_ctl postgres pg_isready)
PG_LIB_SKIP=(bitcode llvmjit.so llvmjit_types.bc pgxs)   # JIT and build files: not needed, and pull in LLVM
GLIBC_RE='^(libc|libm|libresolv|libpthread|libdl|librt|ld-linux-x86-64)\.so'  # on every image

ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$ROOT"
OUTDIR=${OUTDIR:-.whl}
WORK=${WORK:-/tmp/mfsreg-kit}
PYVER=${PYVER:-3.12}
PARTS=${PARTS:-site pg}
HOSTPY=${HOSTPY:-python3}
TAG=${PYVER/./}
PLAT=(--only-binary=:all: --python-version "$PYVER" --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$OUTDIR" "$WORK"
OUTDIR=$(cd "$OUTDIR" && pwd)
export XZ_OPT=${XZ_OPT:--6 -T0}

# .whl/ must never be committed: ignore it in this checkout.
EXC=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXC")"
grep -qxF /.whl/ "$EXC" 2>/dev/null || echo /.whl/ >> "$EXC"

pack_site() {
  local wheels="$WORK/wheels-cp$TAG" site="$WORK/site/site$TAG"
  if [ -z "${OFFLINE:-}" ]; then
    rm -rf "$wheels"
    "$HOSTPY" -m pip download -q --no-deps "${PLAT[@]}" -d "$wheels" "${PINS[@]}" \
      2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  fi
  local n; n=$(ls "$wheels"/*.whl | wc -l)
  [ "$n" -eq "${#PINS[@]}" ] || { echo "expected ${#PINS[@]} wheels in $wheels, found $n"; exit 1; }
  rm -rf "$WORK/site" && mkdir -p "$site"
  "$HOSTPY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --root-user-action=ignore \
    "${PLAT[@]}" --target "$site" "$wheels"/*.whl
  local keep d
  for d in "$site"/botocore/data/*/; do
    keep=; for k in "${BOTOCORE_KEEP[@]}"; do [ "$(basename "$d")" = "$k" ] && keep=1; done
    [ -n "$keep" ] || rm -rf "$d"
  done
  for d in "${PRUNE[@]}"; do rm -f "$site"/$d; done
  find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
  tar -C "$WORK/site" --owner=0 --group=0 -cJf "$OUTDIR/site$TAG.tar.xz" "site$TAG"
  echo "site$TAG.tar.xz: $(du -h "$OUTDIR/site$TAG.tar.xz" | cut -f1), $(ls -d "$site"/*.dist-info | wc -l) packages"
}

pack_pg() {
  local src=/usr/lib/postgresql/15 share=/usr/share/postgresql/15 pg="$WORK/pg"
  [ -x "$src/bin/postgres" ] || { echo "no Postgres 15 in $src (apt-get install postgresql-15)"; exit 1; }
  rm -rf "$pg" && mkdir -p "$pg/usr/lib/postgresql/15/bin" "$pg/usr/lib/postgresql/15/lib" \
    "$pg/usr/share/postgresql" "$pg/pglibs" "$pg/zoneinfo/Etc"
  local f b s skip objs=()
  for b in "${PG_BINS[@]}"; do cp -L "$src/bin/$b" "$pg/usr/lib/postgresql/15/bin/"; objs+=("$src/bin/$b"); done
  for f in "$src"/lib/*; do
    b=$(basename "$f"); skip=
    for s in "${PG_LIB_SKIP[@]}"; do [ "$b" = "$s" ] && skip=1; done
    [ -n "$skip" ] && continue
    cp -rL "$f" "$pg/usr/lib/postgresql/15/lib/"
    case $b in *.so) objs+=("$f") ;; esac
  done
  cp -rL "$share" "$pg/usr/share/postgresql/" && rm -rf "$pg/usr/share/postgresql/15/man"
  for f in "${objs[@]}"; do ldd "$f"; done | awk '/=>/ && $3 ~ /^\// {print $3}' | sort -u |
    while read -r f; do basename "$f" | grep -qE "$GLIBC_RE" || cp -L "$f" "$pg/pglibs/"; done
  cp -L /usr/share/zoneinfo/Etc/UTC "$pg/zoneinfo/Etc/UTC" && cp -L /usr/share/zoneinfo/UTC "$pg/zoneinfo/UTC"
  tar -C "$pg" --owner=0 --group=0 -cJf "$OUTDIR/pg15.tar.xz" .
  echo "pg15.tar.xz: $(du -h "$OUTDIR/pg15.tar.xz" | cut -f1), $(ls "$pg/pglibs" | wc -l) libraries"
}

for p in $PARTS; do
  case $p in site) pack_site ;; pg) pack_pg ;; *) echo "unknown part $p"; exit 2 ;; esac
done
echo "kit in $OUTDIR: $(du -ch "$OUTDIR"/*.tar.xz | tail -1 | cut -f1) in all (carry limit 64 MiB with the tree)"
