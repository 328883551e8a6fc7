#!/usr/bin/env bash
# Materialise patched copies of frozen upstream crates into .patched/<crate>.
#
# For each series folder patches/<crate>-<version>/ (a `checksum` file holding the sha256 of
# the pristine .crate archive, and *.patch files applied in name order), this script:
#   1. gets the pristine archive through cargo (never from a repository copy),
#   2. refuses it unless its sha256 matches the pinned checksum,
#   3. extracts it, applies the series, and swaps the result into .patched/<crate>.
# A stamp (hash of checksum + series) makes it idempotent: nothing is touched when the
# series is unchanged, so cargo does not rebuild the crate.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/.patched"
mkdir -p "$out"

registry_cache() { echo "${CARGO_HOME:-$HOME/.cargo}/registry/cache"; }

find_archive() { # crate version -> path of the .crate in cargo's cache, or nothing
  # `|| true`: on a fresh machine the cache folder does not exist yet, and under pipefail a
  # failing find would abort the script before cargo is asked to fetch the archive.
  find "$(registry_cache)" -name "$1-$2.crate" 2>/dev/null | head -n 1 || true
}

fetch_archive() { # crate version: let cargo download the pristine archive
  local tmp
  tmp=$(mktemp -d)
  mkdir -p "$tmp/src"
  printf '[package]\nname = "verdict-fetch"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\n%s = "=%s"\n' "$1" "$2" > "$tmp/Cargo.toml"
  echo 'fn main() {}' > "$tmp/src/main.rs"
  (cd "$tmp" && cargo fetch --quiet) || { echo "apply.sh: cargo could not fetch $1 $2" >&2; exit 1; }
  rm -rf "$tmp"
}

for series in "$root"/patches/*/; do
  series=${series%/}
  name=$(basename "$series")          # e.g. mistralrs-core-0.8.1
  crate=${name%-*}
  version=${name##*-}
  want=$(tr -d '[:space:]' < "$series/checksum")
  stamp=$( (echo "$want"; cat "$series"/*.patch 2>/dev/null || true) | sha256sum | cut -d' ' -f1)
  dest="$out/$crate"
  if [[ -f "$dest/.verdict-stamp" && "$(cat "$dest/.verdict-stamp")" == "$stamp" ]]; then
    continue
  fi

  archive=$(find_archive "$crate" "$version")
  [[ -n "$archive" ]] || { fetch_archive "$crate" "$version"; archive=$(find_archive "$crate" "$version"); }
  [[ -n "$archive" ]] || { echo "apply.sh: no archive for $crate $version after cargo fetch" >&2; exit 1; }
  got=$(sha256sum "$archive" | cut -d' ' -f1)
  if [[ "$got" != "$want" ]]; then
    echo "apply.sh: $archive has sha256 $got, expected $want; refusing to patch it" >&2
    exit 1
  fi

  work=$(mktemp -d "$out/.work.XXXXXX")
  tar -xzf "$archive" -C "$work"
  for p in "$series"/*.patch; do
    [[ -e "$p" ]] || continue
    patch --quiet --forward --batch -p1 -d "$work/$crate-$version" < "$p" \
      || { echo "apply.sh: $(basename "$p") does not apply to $crate $version" >&2; rm -rf "$work"; exit 1; }
  done
  echo "$stamp" > "$work/$crate-$version/.verdict-stamp"
  rm -rf "$dest"
  mv "$work/$crate-$version" "$dest"
  rm -rf "$work"
  echo "apply.sh: $crate $version patched with $(ls "$series"/*.patch 2>/dev/null | wc -l) patch(es) into .patched/$crate" >&2
done
