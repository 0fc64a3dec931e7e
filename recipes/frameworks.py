"""Pinned installer for five Python agent frameworks the tests run as they ship against the chat server.

    root = install()   # pip install --target .agents/py (ignored folder), then root is on sys.path

openai-agents, langchain-openai, langchain-anthropic, pydantic-ai (the slim wheel with its OpenAI and Anthropic
extras) and smolagents, plus the dependencies .venv lacks, each pinned and installed with --no-deps: the frameworks
then run on .venv's own openai, anthropic and pydantic, never on copies that replace them. A pin already in
`root` is not fetched again. Offline, the error names the packages that could not be installed.
"""
import os
import subprocess
import sys

FRAMEWORKS = ["openai-agents==0.24.0", "langchain-openai==1.7.4", "langchain-anthropic==1.7.10",
              "pydantic-ai-slim==2.68.0", "smolagents==1.26.0"]
# What pip's resolver adds for the five beside .venv (`pip install --dry-run --report`), nothing .venv has.
MISSING_DEPS = ["langchain-core==1.8.3", "langchain-protocol==0.0.20", "langsmith==0.15.1", "jsonpatch==1.48",
                "jsonpointer==3.12", "tenacity==9.2.1", "uuid_utils==0.19.0", "orjson==3.13.0",
                "requests-toolbelt==1.0.0", "zstandard==0.25.0", "pydantic-graph==2.68.0", "genai-prices==0.2.3",
                "griffelib==2.4.1", "logfire-api==5.6.0", "websockets==16.1.1", "distro==1.9.0"]
PINS = FRAMEWORKS + MISSING_DEPS


def installed(root: str, pin: str) -> bool:
    name, version = pin.split("==")
    return os.path.isdir(os.path.join(root, f"{name.replace('-', '_').lower()}-{version}.dist-info"))


def install(root: str = ".agents/py", pins: list[str] = PINS) -> str:
    """Install the pins `root` lacks and put `root` on sys.path; RuntimeError naming them if pip fails."""
    root = os.path.abspath(root)
    todo = [pin for pin in pins if not installed(root, pin)]
    if todo:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               "--no-deps", "--target", root, *todo], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"could not install {' '.join(todo)} into {root} (offline?): {done.stderr[-600:]}")
    if root not in sys.path:
        sys.path.insert(0, root)
    return root


if __name__ == "__main__":
    print(install(*sys.argv[1:]))
