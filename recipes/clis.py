"""The coding CLIs that train as they ship, installed pinned from npm into an ignored folder.

    paths = install()   # {"claude": "<repo>/.agents/cli/node_modules/.bin/claude", "codex": ".../codex"}

Both are npm packages whose native binary arrives in a per-platform optional dependency; `npm install --prefix`
puts them under ROOT/node_modules. A pinned version already there is a no-op (no network). No npm, or no
registry, raises InstallError naming the package, which tests turn into a skip (never a pass).
Not here: running the CLIs (recipes/claude_code_agent.py and its Codex twin do).
"""
import fcntl
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".agents", "cli")
PINS = {"claude": ("@anthropic-ai/claude-code", "2.1.328"), "codex": ("@openai/codex", "0.169.0")}


class InstallError(RuntimeError):
    """A pinned CLI could not be installed (no npm, offline registry); the message names the package."""


def installed_version(root: str, package: str) -> str | None:
    try:
        with open(os.path.join(root, "node_modules", package, "package.json")) as f:
            return json.load(f).get("version")
    except FileNotFoundError:
        return None


def install(root: str = ROOT, names: tuple = ("claude", "codex")) -> dict[str, str]:
    """Install the pinned CLIs in `names` under root (once; default: the repository's .agents/cli); returns
    name -> absolute path of its executable."""
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    paths = {name: os.path.join(root, "node_modules", ".bin", name) for name in names}
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # two test sessions installing at once would corrupt node_modules
        for name in names:
            package, version = PINS[name]
            if installed_version(root, package) == version and os.access(paths[name], os.X_OK):
                continue
            spec = f"{package}@{version}"
            if shutil.which("npm") is None:
                raise InstallError(f"{spec}: npm is not installed (apt-get install npm), so the {name} CLI is missing")
            done = subprocess.run(["npm", "install", "--prefix", root, "--save-exact", "--no-audit", "--no-fund", spec],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0 or not os.access(paths[name], os.X_OK):
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise InstallError(f"{spec}: npm install failed (offline?): {' | '.join(tail)}")
    return paths


if __name__ == "__main__":   # python recipes/clis.py [claude] [codex]: those, else both
    for name, path in install(names=tuple(sys.argv[1:]) or tuple(PINS)).items():
        print(f"{name}: {path}")
