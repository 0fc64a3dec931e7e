#!/usr/bin/env bash
# Runs ON the GPU machine (no network needed), from the repo root, once every .gpu-parts/pK made by
# recipes/gpu_stage.sh has been copied into .gpu-stage/. Rejoins the split wheels, checks them against
# SHA256SUMS / SHA256SUMS.extra and installs all wheels into .gpu-site without dependencies (the machine
# has the rest). Safe to run again. Afterwards:
#   export PYTHONPATH=$PWD/.gpu-site VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not carried
# GPU_INSTALL_DRY=1 stops after the checksums (to check the parts on a machine without Python 3.12).
set -euo pipefail
shopt -s nullglob
REPO=$PWD
STAGE=$REPO/.gpu-stage

[[ -f $STAGE/MANIFEST.parts ]] || {
  echo "no $STAGE/MANIFEST.parts: copy the parts first (mkdir -p .gpu-stage && cp .gpu-parts/pK/* .gpu-stage/)" >&2
  exit 1
}
cd "$STAGE"
# A split wheel that was already rejoined counts as present; a part copied in again after that does not,
# so a lone re-copied part can never be rejoined into a truncated wheel.
missing=$(while read -r part f; do
  base=${f%.part-??}
  [[ -e $f || ( $f != "$base" && -e $base && ! -e $base.part-aa ) ]] || echo "  $part: $f"
done < MANIFEST.parts)
[[ -z $missing ]] || { printf 'missing from .gpu-stage (copy these parts in):\n%s\n' "$missing" >&2; exit 1; }

for aa in *.part-aa; do
  w=${aa%.part-aa}
  cat "$w".part-?? > "$w"
  rm -f "$w".part-??
done

sums=()
for s in SHA256SUMS SHA256SUMS.extra; do [[ -f $s ]] && sums+=("$s"); done
(( ${#sums[@]} )) || { echo "neither SHA256SUMS nor SHA256SUMS.extra in .gpu-stage" >&2; exit 1; }
for s in "${sums[@]}"; do
  sha256sum -c --quiet "$s" || { echo "checksum failure ($s): copy the part holding it again (see MANIFEST.parts)" >&2; exit 1; }
done
echo "rejoined and verified: $(ls ./*.whl | wc -l) wheels"

if [[ ${GPU_INSTALL_DRY:-0} == 1 ]]; then echo "GPU_INSTALL_DRY=1: not installing"; exit 0; fi
cd "$REPO"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$REPO/.gpu-site" .gpu-stage/*.whl
echo "installed into .gpu-site: $(ls -d "$REPO"/.gpu-site/*.dist-info | wc -l) packages"
