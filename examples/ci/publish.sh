#!/usr/bin/env bash
# Publish a fine-tune to an mfsreg server from CI: push it, tag it, print the family's sharing.
#
#   examples/ci/publish.sh MODEL_PATH FAMILY VERSION
#
# MFSREG_URL and MFSREG_TOKEN (a push token for the family, from the CI's secrets) say where to.
# Optional: PARENT (the version it was tuned from), TAG (moved to the new version, e.g. staging),
# DESCRIPTION, and COMMIT_SHA (kept as the label commit=...). Pushing again is safe: a version
# already stored with the same content is reported as such and changes nothing.
set -euo pipefail

if [ "$#" -ne 3 ]; then
    echo "usage: $0 MODEL_PATH FAMILY VERSION (with MFSREG_URL and MFSREG_TOKEN set)" >&2
    exit 2
fi
model=$1 family=$2 version=$3
: "${MFSREG_URL:?set MFSREG_URL to the registry server}"
: "${MFSREG_TOKEN:?set MFSREG_TOKEN to a push token for $family (a CI secret)}"

args=(push "$model" --family "$family" --version "$version" --label "commit=${COMMIT_SHA:-unknown}")
if [ -n "${PARENT:-}" ]; then args+=(--parent "$PARENT"); fi
if [ -n "${DESCRIPTION:-}" ]; then args+=(--description "$DESCRIPTION"); fi
mfsreg "${args[@]}"
if [ -n "${TAG:-}" ]; then mfsreg tag set "$family" "$TAG" "$version"; fi
mfsreg stats --family "$family"
